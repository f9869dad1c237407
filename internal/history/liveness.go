package history

import (
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/anishathalye/porcupine"
)

// Liveness: a client that keeps retrying one request under one key converges. It gets the one
// answer, even when each of its attempts is shorter than the work, and a duplicate has the
// answer within LivenessBound of it being stored. The model above checks what the answers
// are (safety); this checks that they come, and when. It checks chains: one client retrying
// one request (Session.Retry), from its first call until it has a final outcome or gives up.

// LivenessBound is the contract's bound: a client that keeps retrying has the answer within
// half a second of it being stored.
const LivenessBound = 500 * time.Millisecond

// LivenessSlack is what the harness adds to LivenessBound before it calls an answer late: the
// retrying client's own pause between two attempts (up to 300 ms), an attempt that gave up just
// as the answer was stored (one more round trip), and the scheduler of a loaded machine (two
// cores, the race detector, other tests). LivenessBound+LivenessSlack, 1.5 s, is still far
// below what a client that waits out a lease (seconds) or never gets the answer shows.
const LivenessSlack = time.Second

// FaultGrace is how long after a fault ended a chain that overlapped it is not held to the
// bound, besides the lease of its key (a lease a killed server or backend held runs out only
// then): pools reconnect, a restarted server warms up. A chain that overlaps a fault (or its
// grace) is excused, not checked: faults stop everything for a while, and the bound is about
// a system that works.
const FaultGrace = time.Second

// The kinds of liveness violations.
var (
	kindGaveUp = "liveness: a client that kept retrying never got the answer"
	kindLate   = fmt.Sprintf("liveness: a retrying client had no answer %s after it was stored (bound %s + slack %s)",
		LivenessBound+LivenessSlack, LivenessBound, LivenessSlack)
)

// Chain is one client retrying one request until it has a final outcome (Session.Retry): the
// unit of the liveness check.
type Chain struct {
	In Input // the request (In.Call: the first attempt's call)
	// Start is the first attempt's call; End the last attempt's return, or when the client
	// gave up.
	Start, End time.Duration
	// Attempts is how many attempts it made; Last is what the last one learned.
	Attempts int
	Last     Output
	// Done: it ended with a final outcome. Cut: the run's context ended first (not checked).
	// Neither: it gave up (its time ran out).
	Done, Cut bool
}

// storeSeen is a watcher's observation: the answer to request fp under key was stored at (or
// before) at.
type storeSeen struct {
	key, fp, answer string
	at              time.Duration
}

// beginChain records the start of a chain now.
func (h *History) beginChain(in Input) *Chain {
	c := &Chain{In: in, Start: h.Now()}
	h.mu.Lock()
	defer h.mu.Unlock()
	h.chains = append(h.chains, c)
	return c
}

// endChain records the end of a chain now.
func (h *History) endChain(c *Chain, attempts int, last Output, done, cut bool) {
	now := h.Now()
	h.mu.Lock()
	defer h.mu.Unlock()
	c.End, c.Attempts, c.Last, c.Done, c.Cut = now, attempts, last, done, cut
}

// Stored records that the answer (Output.Status and Body) to the request with fingerprint fp
// under key was seen stored now, from outside the clients (Session.Watch): it was stored at
// this instant at the latest.
func (h *History) Stored(key, fp string, answer Output) {
	at := h.Now()
	h.mu.Lock()
	defer h.mu.Unlock()
	h.stored = append(h.stored, storeSeen{key: key, fp: fp, answer: answer.answer(), at: at})
}

// Chains returns the chains recorded (copies).
func (h *History) Chains() []Chain {
	h.mu.Lock()
	defer h.mu.Unlock()
	out := make([]Chain, len(h.chains))
	for i, c := range h.chains {
		out[i] = *c
	}
	return out
}

// evidence is an instant by which an answer was stored: the return of an operation that got it
// (fresh or replayed; the answer is stored before it is sent), or a watcher's observation.
type evidence struct {
	fp, answer string
	at         time.Duration
	by         string
}

// checkLiveness checks every chain that was not cut against the bound: it returns how many it
// checked, how many a fault excused, and the violations. When the answer was stored is the
// earliest evidence of it (evidence), an upper bound: the delay it measures is never more
// than the real one, so a violation it reports is one.
func checkLiveness(h *History, parts [][]porcupine.Operation, faults []Fault, timeout time.Duration) (checked, excused int, out []Violation) {
	h.mu.Lock()
	obs := slices.Clone(h.stored)
	h.mu.Unlock()
	byKey := map[string][]evidence{}
	opsOf := map[string][]porcupine.Operation{}
	for _, p := range parts {
		for _, op := range p {
			in, o := op.Input.(Input), op.Output.(Output)
			opsOf[in.Key] = append(opsOf[in.Key], op)
			if o.Outcome == Answered || o.Outcome == Replayed {
				by := fmt.Sprintf("c%d's fresh answer", in.Client)
				if o.Outcome == Replayed {
					by = fmt.Sprintf("c%d's replay", in.Client)
				}
				byKey[in.Key] = append(byKey[in.Key], evidence{in.Fingerprint, o.answer(), o.Return, by})
			}
		}
	}
	for _, s := range obs {
		byKey[s.key] = append(byKey[s.key], evidence{s.fp, s.answer, s.at, "a watcher of the key table"})
	}
	bound := LivenessBound + LivenessSlack
	for _, c := range h.Chains() {
		if c.Cut {
			continue
		}
		checked++
		if c.Done && c.Last.Outcome != Replayed {
			continue // a fresh answer (its own), or a decision that is not the answer (a mismatch)
		}
		// The earliest evidence that the answer it waited for was stored.
		first := evidence{at: -1}
		for _, e := range byKey[c.In.Key] {
			match := e.fp == c.In.Fingerprint
			if c.Done {
				match = e.answer == c.Last.answer()
			}
			if match && (first.at < 0 || e.at < first.at) {
				first = e
			}
		}
		from := max(first.at, c.Start)
		kind, window := kindGaveUp, [2]time.Duration{c.Start, c.End}
		switch {
		case first.at >= 0 && c.End-from > bound:
			kind, window = kindLate, [2]time.Duration{from, c.End}
		case c.Done:
			continue // converged in time
		}
		if overlaps(faults, window, FaultGrace+c.In.Lease) {
			excused++
			continue
		}
		var b strings.Builder
		fmt.Fprintf(&b, "chain: c%d retried %s (%s route) from %s to %s, %d attempts; ", c.In.Client, short(c.In.Request, 60),
			c.In.Route, at(int64(c.Start)), at(int64(c.End)), c.Attempts)
		last := describeOutput(c.Last)
		if c.Last.RetryAfter > 0 {
			last += fmt.Sprintf(" Retry-After %s", c.Last.RetryAfter)
		}
		switch {
		case c.Done:
			fmt.Fprintf(&b, "the answer was stored by %s at the latest (%s), and it got it at %s: %s after (bound %s)\n",
				at(int64(first.at)), first.by, at(int64(c.End)), time.Duration(c.End-from).Round(time.Millisecond), bound)
		case kind == kindLate:
			fmt.Fprintf(&b, "the answer was stored by %s at the latest (%s), and it still had not got it when it gave up at %s: "+
				"%s after (bound %s); its last attempt: %s\n", at(int64(first.at)), first.by, at(int64(c.End)),
				time.Duration(c.End-from).Round(time.Millisecond), bound, last)
		case first.at >= 0:
			fmt.Fprintf(&b, "it gave up without the answer, which was stored only at %s (%s); its last attempt: %s\n",
				at(int64(first.at)), first.by, last)
		default:
			fmt.Fprintf(&b, "it gave up without the answer: no answer to it was stored meanwhile; its last attempt: %s\n", last)
		}
		timeline, _, _ := explain(opsOf[c.In.Key], faults, timeout)
		b.WriteString(timeline)
		out = append(out, Violation{Key: c.In.Key, Kinds: []string{kind}, Timeline: b.String()})
	}
	slices.SortStableFunc(out, func(a, b Violation) int { return strings.Compare(a.Key, b.Key) })
	return checked, excused, out
}

// overlaps tells whether a fault, or the grace after it, overlaps the window.
func overlaps(faults []Fault, window [2]time.Duration, grace time.Duration) bool {
	for _, f := range faults {
		if f.From <= window[1] && f.To+grace >= window[0] {
			return true
		}
	}
	return false
}

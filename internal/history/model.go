// Package history checks histories of real clients against a model of the idempotency
// contract, with porcupine (github.com/anishathalye/porcupine), through faults.
//
// A history is every call a client made under an idempotency key, with its call and return
// times and what it learned (a fresh answer, a replay, 422, 409, a failure, nothing at all),
// and, per key, the effects observed once everything settled (ledger rows, payouts at a
// provider). The model says, per (principal, key), which histories the contract allows:
//
//   - a key lives in generations; within one, the first request's fingerprint binds the key;
//   - a repeat with the same fingerprint gets exactly the first answer (status and body byte
//     for byte) with the replay marker; another fingerprint gets a mismatch (HTTP 422
//     idempotency_key_reuse); a repeat while the work runs may be told so (409);
//   - a generation has at most one effect, and an answer that names an effect names one
//     that exists and that no other generation named;
//   - a provider key belongs to one generation: every attempt of a generation that reports
//     one reports the same, and no later generation reports an earlier one's;
//   - a new generation starts only after a release, or once the key expired: the TTL after the
//     stored answer (on every path), or the TTL after the end of a lease that never answered.
//
// Time is part of the model: every input and output carries its call and return time, and
// the step function decides conservatively. An operation's effect happened at some instant
// between its call and its return, so a new generation is legal only if it could have
// happened at least the TTL after the earliest instant the previous answer could have been
// stored (the call of the operation that stored it), within ClockSlack. Outcomes that are
// not known (a timeout, a cut connection, a killed server) return at the end of the history:
// the operation may have taken effect at any instant after its call, or not at all.
//
// Check runs porcupine over each key's history and, for a key that no linearization
// explains, writes a timeline (one line per operation, with the generation it was placed in
// and why the rest could not be) and porcupine's HTML visualisation.
package history

import (
	"cmp"
	"encoding/binary"
	"fmt"
	"hash/fnv"
	"slices"
	"strings"
	"time"

	"github.com/anishathalye/porcupine"
)

// ClockSlack is how much earlier than the model's bound a new generation may appear without
// being called a violation. Every clock involved (the clients', the server's, PostgreSQL's) is
// the same machine's, so the slack covers only the rounding between Go's monotonic clock and
// the database's wall clock, not a skew between machines.
const ClockSlack = 50 * time.Millisecond

// Route says how a request holds its key while its work runs.
type Route uint8

const (
	// Transactional: the claim, the work and the answer commit together (a transactional
	// claim, p_lease NULL; Do; the ledger's deposits and transfers).
	Transactional Route = iota
	// Leased: the claim commits on its own and the work runs under a lease (DoLease, the
	// payouts route, idem_begin with p_lease).
	Leased
)

// String is "tx" or "lease".
func (r Route) String() string {
	if r == Leased {
		return "lease"
	}
	return "tx"
}

// Outcome is what a client learned of one operation.
type Outcome uint8

// The outcomes. Answered, Replayed, Mismatch and Busy are decisions; Failed and Unknown say
// the client does not know what happened; Held, Released and Lost are what a client that
// drives the SQL API (or DoLease) itself knows of a claim it made.
const (
	// Answered: a fresh answer, without the replay marker: this operation ran the work (or
	// refused it with a final error) and its answer was stored.
	Answered Outcome = iota + 1
	// Replayed: the stored answer, with the replay marker.
	Replayed
	// Mismatch: the key is bound to another request (HTTP 422 idempotency_key_reuse, SQL
	// outcome mismatch, ErrMismatch).
	Mismatch
	// Busy: the key is in use (HTTP 409 request_in_progress, SQL in_progress or a lock
	// timeout, ErrInProgress). On a lease route it is also what an attempt whose lease was
	// lost answers, after it did its work, and one whose store was acknowledged too late.
	Busy
	// Failed: an answer that decides nothing (a 5xx, an error from the database): the
	// operation may have taken effect or not, within its call and return.
	Failed
	// Unknown: no answer at all (a timeout, a hang-up, a cut connection, a killed server). The
	// operation may take effect at any instant after its call, even after the client gave up.
	Unknown
	// Held: a lease claim was made and deliberately left to run out without an answer.
	Held
	// Released: a lease claim was made and released without an answer.
	Released
	// Lost: a lease claim was made, then found taken over (idem_complete or idem_extend
	// raised 55000; ErrLeaseLost): another attempt of the same generation holds the key, or
	// (a store retried after its acknowledgement was lost) this one's answer is stored.
	Lost
	// Observed is not a client's operation: it is the effects found under the key once the
	// history ended (Output.Effects).
	Observed
	// NotSent: the request never left the client (no connection could be made: a refused
	// dial, a database that does not accept connections), so it did nothing.
	NotSent
)

var outcomeNames = map[Outcome]string{Answered: "answered", Replayed: "replayed", Mismatch: "mismatch", Busy: "busy",
	Failed: "failed", Unknown: "unknown", Held: "held", Released: "released", Lost: "lost", Observed: "observed",
	NotSent: "not sent"}

// String is the outcome's name, as the timelines and the counts show it.
func (o Outcome) String() string {
	if s, ok := outcomeNames[o]; ok {
		return s
	}
	return fmt.Sprintf("outcome(%d)", uint8(o))
}

// Input is what an operation sent.
type Input struct {
	// Key names the partition: the principal and the idempotency key.
	Key string
	// Client is who sent it (a goroutine, a connection), for the timeline.
	Client int
	// Request is what was sent, readable ("POST /v1/payouts amount=100").
	Request string
	// Fingerprint binds the key: two operations with the same fingerprint are the same request.
	Fingerprint string
	// Route is how the request holds the key while it works.
	Route Route
	// TTL is how long an answer is kept after it is stored (and a lease claim past its lease).
	TTL time.Duration
	// Lease is the claim's lease, for a Leased route: the lease ends at least this long after
	// the claim.
	Lease time.Duration
	// Call is when the operation was sent, since the history began.
	Call time.Duration
}

// Output is what an operation learned.
type Output struct {
	// Outcome is the kind of answer.
	Outcome Outcome
	// Status and Body are the answer (Answered, Replayed; informative otherwise).
	Status int
	Body   string
	// ProviderKey is the provider key the operation reported or used ("" unknown).
	ProviderKey string
	// Effect names the effect the answer claims ("deposit 17", "payout po_3"); "" for an
	// answer that names none (a final error).
	Effect string
	// Return is when the answer came back, since the history began; for Unknown, the end of
	// the history (Client gave up at GaveUp).
	Return time.Duration
	// GaveUp is when a client without an answer stopped waiting (Unknown), for the timeline.
	GaveUp time.Duration
	// StoreSent is when a client that stores the answer itself (the SQL API, the work of Do
	// and DoLease) sent what stores it: the answer was stored after it. Zero when unknown.
	// End turns it into StoredAfter.
	StoreSent time.Time
	// StoredAfter is StoreSent since the history began: a better bound than the call for when
	// an Answered operation's answer was stored. Zero: the call.
	StoredAfter time.Duration
	// Note is a readable detail (an error).
	Note string
	// Effects are the effects found under the key afterwards (Observed).
	Effects []string
}

func (o Output) answer() string { return fmt.Sprintf("%d %s", o.Status, o.Body) }

type phase uint8

const (
	free phase = iota // no live claim: never claimed, or released
	held              // a committed lease claim without an answer
	done              // an answer is stored
)

func (p phase) String() string { return [...]string{"free", "held", "done"}[p] }

// unknown stands for a value that exists but was not seen yet (an answer stored by an
// operation whose client never learned it, its effect, its provider key).
const unknown = "?"

// state is the model's state of one key. It is comparable (porcupine merges equal states).
type state struct {
	phase  phase
	gen    int    // generations so far
	fp     string // the current generation's fingerprint
	answer string // done: its answer, or unknown
	pk     string // its provider key, "" when not seen
	effect string // the effect its answer names: "" none, unknown when not seen
	// since is, when done, the earliest instant the answer can have been stored; when held,
	// the earliest instant the lease can end. The key expires at least ttl after it.
	since int64
	ttl   int64
	// releasable: the lease is held by an operation that may still release it (its outcome
	// allows a release), so a later claim may find the key free.
	releasable bool
	// What earlier generations left: provider keys seen, effects named, and how many had an
	// effect that nobody saw named.
	pastPKs     string
	pastEffects string
	pastUnknown int
}

// hash is a hash of every field (equal states hash alike).
func (s state) hash() uint64 {
	h := fnv.New64a()
	var b [8]byte
	releasable := int64(0)
	if s.releasable {
		releasable = 1
	}
	for _, n := range []int64{int64(s.phase), int64(s.gen), s.since, s.ttl, int64(s.pastUnknown), releasable} {
		binary.LittleEndian.PutUint64(b[:], uint64(n))
		h.Write(b[:])
	}
	for _, str := range []string{s.fp, s.answer, s.pk, s.effect, s.pastPKs, s.pastEffects} {
		h.Write([]byte(str))
		h.Write([]byte{0xff})
	}
	return h.Sum64()
}

func (s state) describe() string {
	if s.gen == 0 && s.phase == free {
		return "new key"
	}
	var b strings.Builder
	fmt.Fprintf(&b, "gen %d %s", s.gen, s.phase)
	if s.phase != free {
		fmt.Fprintf(&b, " fp=%s", short(s.fp, 40))
	}
	switch s.phase {
	case done:
		fmt.Fprintf(&b, " answer=%s stored>=%s", short(s.answer, 60), at(s.since))
	case held:
		fmt.Fprintf(&b, " lease-end>=%s", at(s.since))
	}
	if s.pk != "" {
		fmt.Fprintf(&b, " pk=%s", short(s.pk, 12))
	}
	return b.String()
}

func at(ns int64) string { return fmt.Sprintf("+%.3fs", time.Duration(ns).Seconds()) }

func short(s string, n int) string {
	s = strings.ReplaceAll(strings.TrimSpace(s), "\n", " ")
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}

// rule names one promise of the contract, so that a violation can say which it breaks: a
// history that is illegal, but legal once a rule is relaxed, breaks that rule.
type rule uint16

const (
	ruleTTL      rule = 1 << iota // a new generation only after a release or once the key expired
	ruleAnswer                    // a replay is the stored answer, and only a stored answer is replayed
	ruleMismatch                  // a mismatch only for another request than the one holding the key
	rulePK                        // one provider key per generation, never an earlier generation's
	ruleEffects                   // one effect per generation, and every named effect exists
	ruleTakeover                  // a lease is taken over only once it can have run out
)

var ruleKinds = []struct {
	r    rule
	kind string
}{
	{rulePK, "a provider key reused by a later generation, or two in one generation"},
	{ruleTTL, "a new generation before the TTL after the answer (or the lease's end) ran out"},
	{ruleAnswer, "a replay that is not the stored answer"},
	{ruleMismatch, "a mismatch where none is due"},
	{ruleEffects, "effects that do not match the generations"},
	{ruleTakeover, "a takeover of a lease still running"},
}

// reason is why something an operation may have done was impossible, and which rule said so.
type reason struct {
	r    rule
	text string
}

// action is what an operation may have done at its linearization point.
type action uint8

const (
	actNoop         action = iota // nothing: refused, rolled back, or never reached the store
	actReplay                     // got the stored answer
	actMismatch                   // refused: another request holds the key
	actClaimStore                 // claimed (a new generation, or a takeover) and stored an answer
	actClaimHold                  // claimed, then left the lease held (run out, or taken over later)
	actClaimRelease               // claimed, then released
)

// actions lists what an operation with this outcome on this route may have done.
func actions(r Route, o Outcome) []action {
	switch o {
	case Answered:
		return []action{actClaimStore}
	case Replayed:
		return []action{actReplay}
	case Mismatch:
		return []action{actMismatch}
	case NotSent:
		return []action{actNoop}
	case Busy:
		if r == Leased {
			// 409 is also what an attempt whose lease was lost answers, after its work; and
			// one whose answer was stored but whose store's acknowledgement was lost (its
			// retry of the store finds the claim completed, which reads as taken over).
			return []action{actNoop, actClaimHold, actClaimStore}
		}
		return []action{actNoop}
	case Held:
		return []action{actClaimHold}
	case Lost:
		return []action{actClaimHold, actClaimStore} // as a lease route's 409
	case Released:
		return []action{actClaimRelease, actClaimHold} // a release that failed leaves it held
	case Failed, Unknown:
		if r == Leased {
			return []action{actNoop, actClaimStore, actClaimHold, actClaimRelease}
		}
		return []action{actNoop, actClaimStore}
	}
	return nil
}

// stepper applies the model with some rules relaxed (none, to check; one at a time, to say
// which rule a violation breaks), and collects why steps were impossible.
type stepper struct {
	relaxed rule
	why     []reason
}

// refuse records why a step is impossible, and tells whether the rule holds (false: relaxed,
// the step goes on).
func (st *stepper) refuse(r rule, format string, args ...any) bool {
	if st.relaxed&r != 0 {
		return false
	}
	st.why = append(st.why, reason{r, fmt.Sprintf(format, args...)})
	return true
}

// step returns every state the key may be in after the operation (none: it cannot have
// happened; st.why says why).
func (st *stepper) step(s state, in Input, out Output) (next []state) {
	call, ret := int64(in.Call), int64(out.Return)
	if out.Outcome == Observed {
		if st.observe(s, out.Effects) {
			return []state{s}
		}
		return nil
	}
	for _, a := range actions(in.Route, out.Outcome) {
		switch a {
		case actNoop:
			next = append(next, s)
		case actReplay:
			switch {
			case s.phase != done:
				if !st.refuse(ruleAnswer, "a replay, but no answer is stored (%s)", s.describe()) {
					next = append(next, s) // relaxed: a replay that tells nothing
				}
			case s.fp != in.Fingerprint:
				if !st.refuse(ruleAnswer, "a replay of another request's answer: the key is bound to %s", short(s.fp, 60)) {
					next = append(next, s)
				}
			default:
				if n, ok := st.bind(s, out, false); ok {
					next = append(next, n)
				}
			}
		case actMismatch:
			switch {
			case s.phase == free && st.refuse(ruleMismatch, "a mismatch, but nothing holds the key (%s)", s.describe()):
			case s.phase != free && s.fp == in.Fingerprint && st.refuse(ruleMismatch, "a mismatch for the very request that holds the key"):
			default:
				next = append(next, s)
			}
		case actClaimStore, actClaimHold, actClaimRelease:
			for _, c := range st.claim(s, in, ret) {
				if out.ProviderKey != "" && a != actClaimStore {
					var ok bool
					if c, ok = st.learnPK(c, out.ProviderKey); !ok {
						continue
					}
				}
				switch a {
				case actClaimStore:
					c.phase, c.since = done, call
					if out.Outcome == Answered {
						c.since = max(call, int64(out.StoredAfter))
					}
					if out.Outcome == Answered {
						c.answer = out.answer()
						var ok bool
						if c, ok = st.bind(c, out, true); !ok {
							continue
						}
					} else {
						c.answer, c.effect = unknown, unknown
					}
					next = append(next, c)
				case actClaimHold:
					c.phase, c.since = held, max(c.since, call+int64(in.Lease))
					c.releasable = slices.Contains(actions(in.Route, out.Outcome), actClaimRelease)
					if c.effect == "" {
						c.effect = unknown // the work may have run (a provider called)
					}
					next = append(next, c)
				case actClaimRelease:
					if in.Route != Leased {
						continue
					}
					if c.effect == "" {
						c.effect = unknown
					}
					c.phase, c.since = free, 0
					next = append(next, c)
				}
			}
		}
	}
	return next
}

// step is the model with every rule in force; why says why there is no next state.
func step(s state, in Input, out Output) (next []state, why []string) {
	var st stepper
	next = st.step(s, in, out)
	if len(next) > 0 {
		return next, nil
	}
	for _, r := range st.why {
		why = append(why, r.text)
	}
	return nil, why
}

// claim returns the states after the operation claimed the key: a new generation when the
// key is free or could have expired; the same generation when a lease on it could have run
// out (a takeover), or when it was released and the same request claims it again (a retry of
// a request whose work failed may keep its provider key, or get a new one).
func (st *stepper) claim(s state, in Input, ret int64) (claims []state) {
	slack, ttl := int64(ClockSlack), int64(in.TTL)
	if s.phase == held && s.releasable {
		// Its holder may have released it since (an operation is one point in the model, but
		// a claim released later is two: others may see it held, then free).
		f := s
		f.phase, f.since, f.releasable = free, 0, false
		claims = append(claims, st.claim(f, in, ret)...)
	}
	switch {
	case s.phase == free:
		claims = append(claims, s.newGen(in, ttl))
	case ret+slack >= s.since+min(s.ttl, ttl):
		claims = append(claims, s.newGen(in, ttl))
	case s.phase == done && st.refuse(ruleTTL, "the answer of generation %d was stored at %s at the earliest (the call of "+
		"the operation that stored it, or when it sent what stores it) and is kept the TTL (%s) after it: a new generation "+
		"cannot start before %s, and this operation returned at %s", s.gen, at(s.since), time.Duration(min(s.ttl, ttl)),
		at(s.since+min(s.ttl, ttl)), at(ret)):
	case s.phase == held && st.refuse(ruleTTL, "the lease of generation %d can have ended at %s at the earliest and its key "+
		"lives the TTL (%s) after that: a new generation cannot start before %s, and this operation returned at %s",
		s.gen, at(s.since), time.Duration(min(s.ttl, ttl)), at(s.since+min(s.ttl, ttl)), at(ret)):
	default:
		claims = append(claims, s.newGen(in, ttl))
	}
	switch {
	case s.phase == held && s.fp == in.Fingerprint:
		if ret+int64(ClockSlack) >= s.since ||
			!st.refuse(ruleTakeover, "a takeover of generation %d's lease before it can have run out (%s)", s.gen, at(s.since)) {
			t := s
			t.ttl = min(t.ttl, ttl)
			claims = append(claims, t)
		}
	case s.phase == free && s.gen > 0 && s.fp == in.Fingerprint:
		t := s // released, claimed again by the same request
		t.ttl = min(t.ttl, ttl)
		claims = append(claims, t)
	}
	return claims
}

func (s state) newGen(in Input, ttl int64) state {
	n := s
	if s.gen > 0 {
		if s.pk != "" {
			n.pastPKs = addSorted(n.pastPKs, s.pk)
		}
		switch s.effect {
		case "":
		case unknown:
			n.pastUnknown++
		default:
			n.pastEffects = addSorted(n.pastEffects, s.effect)
		}
	}
	n.gen, n.fp, n.answer, n.pk, n.effect, n.since, n.ttl, n.releasable = s.gen+1, in.Fingerprint, "", "", "", 0, ttl, false
	return n
}

// bind checks an answer (fresh when fresh) against the generation's, and learns what it
// tells: the answer, its effect, its provider key.
func (st *stepper) bind(s state, out Output, fresh bool) (state, bool) {
	if !fresh {
		switch {
		case s.answer == unknown:
			s.answer = out.answer()
		case s.answer != out.answer():
			if st.refuse(ruleAnswer, "a replay that differs from the stored answer: stored %s, got %s",
				short(s.answer, 80), short(out.answer(), 80)) {
				return s, false
			}
			return s, true // relaxed: the replay tells nothing
		}
	}
	if out.ProviderKey != "" {
		var ok bool
		if s, ok = st.learnPK(s, out.ProviderKey); !ok {
			return s, false
		}
	}
	if eff := out.Effect; eff != "" {
		switch {
		case hasSorted(s.pastEffects, eff):
			if st.refuse(ruleEffects, "the answer names %q, the effect of an earlier generation: generation %d has no effect of its own",
				eff, s.gen) {
				return s, false
			}
		case s.effect != "" && s.effect != unknown && s.effect != eff:
			if st.refuse(ruleEffects, "the answer names %q, the generation's answer named %q", eff, s.effect) {
				return s, false
			}
		default:
			s.effect = eff
		}
	}
	return s, true
}

// learnPK checks a provider key reported by an attempt of the current generation: the same
// as every other attempt's, and no earlier generation's.
func (st *stepper) learnPK(s state, pk string) (state, bool) {
	switch {
	case s.pk != "" && s.pk != pk:
		return s, !st.refuse(rulePK, "provider key %s, but generation %d's is %s: one generation, two provider keys",
			short(pk, 16), s.gen, short(s.pk, 16))
	case hasSorted(s.pastPKs, pk):
		return s, !st.refuse(rulePK, "provider key %s belongs to an earlier generation, and generation %d got it again",
			short(pk, 16), s.gen)
	}
	s.pk = pk
	return s, true
}

// observe checks the effects found under the key afterwards against the generations: every
// effect an answer named exists, and the others are no more than the generations whose
// effect nobody saw named.
func (st *stepper) observe(s state, effects []string) bool {
	named := map[string]bool{}
	for _, e := range splitSorted(s.pastEffects) {
		named[e] = true
	}
	unseen := s.pastUnknown
	switch s.effect {
	case "":
	case unknown:
		unseen++
	default:
		named[s.effect] = true
	}
	found := map[string]bool{}
	var extra []string
	for _, e := range effects {
		found[e] = true
		if !named[e] {
			extra = append(extra, e)
		}
	}
	var missing []string
	for e := range named {
		if !found[e] {
			missing = append(missing, e)
		}
	}
	slices.Sort(missing)
	switch {
	case len(missing) > 0 && st.refuse(ruleEffects, "an answer names %s, which does not exist afterwards (found %v)",
		strings.Join(missing, ", "), effects):
		return false
	case len(extra) > unseen && st.refuse(ruleEffects, "%d effects no answer names (%v), but only %d generation(s) (of %d) "+
		"can have had an unseen one: more effects than generations", len(extra), extra, unseen, s.gen):
		return false
	}
	return true
}

func addSorted(list, v string) string {
	items := splitSorted(list)
	if i, ok := slices.BinarySearch(items, v); !ok {
		items = slices.Insert(items, i, v)
	}
	return strings.Join(items, "\x00")
}

func hasSorted(list, v string) bool {
	_, ok := slices.BinarySearch(splitSorted(list), v)
	return ok
}

func splitSorted(list string) []string {
	if list == "" {
		return nil
	}
	return strings.Split(list, "\x00")
}

// Model is the contract as a porcupine model. It is nondeterministic (an operation whose
// outcome is unknown may have done several things), so its state is the set of states the key
// may be in, without the states another one dominates (one that allows at least as much from
// then on), sorted so that equal sets are equal slices. Its operations' Input and Output are
// Input and Output; Partition splits a history by Input.Key.
func Model() porcupine.Model { return relaxing(0) }

// relaxing is the model with the rules in relaxed not enforced.
func relaxing(relaxed rule) porcupine.Model {
	return porcupine.Model{
		Partition: partition,
		Init:      func() interface{} { return []state{{}} },
		Step: func(set, in, out interface{}) (bool, interface{}) {
			st := stepper{relaxed: relaxed}
			var next []state
			for _, s := range set.([]state) {
				next = append(next, st.step(s, in.(Input), out.(Output))...)
			}
			next = prune(next)
			return len(next) > 0, next
		},
		Equal: func(a, b interface{}) bool { return slices.Equal(a.([]state), b.([]state)) },
		Hash: func(set interface{}) uint64 {
			var h uint64
			for _, s := range set.([]state) {
				h = h*1099511628211 + s.hash()
			}
			return h
		},
		DescribeOperation: func(in, out interface{}) string { return describeOp(in.(Input), out.(Output)) },
		DescribeState:     func(set interface{}) string { return describeStates(set.([]state)) },
	}
}

// dominates tells whether every history legal from b is legal from a: the same but for an
// earlier bound (since), more generations whose effect nobody saw, and the generation number,
// which only names generations.
func (a state) dominates(b state) bool {
	return a.phase == b.phase && (a.gen > 0) == (b.gen > 0) && a.fp == b.fp && a.ttl == b.ttl &&
		a.pastEffects == b.pastEffects && a.since <= b.since && a.pastUnknown >= b.pastUnknown &&
		// an answer, a provider key or an effect not seen yet binds to anything later
		(a.answer == b.answer || a.answer == unknown) && (a.pk == b.pk || a.pk == "") &&
		(a.effect == b.effect || (a.effect == unknown && b.effect == "")) &&
		(a.releasable || !b.releasable) && subset(a.pastPKs, b.pastPKs)
}

// subset tells whether every item of the sorted list a is in the sorted list b.
func subset(a, b string) bool {
	if a == b || a == "" {
		return true
	}
	for _, item := range splitSorted(a) {
		if !hasSorted(b, item) {
			return false
		}
	}
	return true
}

// prune drops the states another one dominates (of two that dominate each other, the later
// generation), and sorts the rest.
func prune(states []state) []state {
	var out []state
	for i, s := range states {
		keep := true
		for j, o := range states {
			if i == j || !o.dominates(s) {
				continue
			}
			if !s.dominates(o) || o.gen < s.gen || (o.gen == s.gen && j < i) {
				keep = false
				break
			}
		}
		if keep {
			out = append(out, s)
		}
	}
	slices.SortFunc(out, func(a, b state) int {
		if c := cmp.Compare(a.hash(), b.hash()); c != 0 {
			return c
		}
		return cmp.Compare(a.gen, b.gen)
	})
	return out
}

func partition(ops []porcupine.Operation) [][]porcupine.Operation {
	byKey := map[string][]porcupine.Operation{}
	var keys []string
	for _, op := range ops {
		k := op.Input.(Input).Key
		if _, ok := byKey[k]; !ok {
			keys = append(keys, k)
		}
		byKey[k] = append(byKey[k], op)
	}
	out := make([][]porcupine.Operation, 0, len(keys))
	for _, k := range keys {
		out = append(out, byKey[k])
	}
	return out
}

func describeOp(in Input, out Output) string {
	if out.Outcome == Observed {
		return fmt.Sprintf("effects afterwards: %v", out.Effects)
	}
	s := fmt.Sprintf("c%d %s → %s", in.Client, short(in.Request, 60), out.Outcome)
	if out.Status != 0 {
		s += fmt.Sprintf(" %d", out.Status)
	}
	if out.Outcome == Answered || out.Outcome == Replayed {
		s += " " + short(out.Body, 80)
	}
	if out.ProviderKey != "" {
		s += " pk=" + short(out.ProviderKey, 12)
	}
	if out.Note != "" {
		s += " (" + short(out.Note, 60) + ")"
	}
	return s
}

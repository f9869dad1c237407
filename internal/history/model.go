// Package history checks histories of real clients against a model of the idempotency
// contract, with porcupine (github.com/anishathalye/porcupine), through faults.
//
// A history is every call a client made under an idempotency key, with its call and return
// times and what it learned (a fresh answer, a replay, 422, 409, a failure, nothing at all),
// and, per key, the effects observed once everything settled (ledger rows, payouts at a
// provider). The model says, per (principal, key), which histories the contract allows:
//
//   - a key lives in generations; within one, the first request's fingerprint binds the key;
//   - a repeat with the same fingerprint gets exactly the first answer (status, the stored
//     headers the harness sees, and body byte for byte) with the replay marker; another fingerprint gets a mismatch (HTTP 422
//     idempotency_key_reuse); a repeat while the work runs may be told so (409);
//   - a generation has at most one effect, and an answer that names an effect names one
//     that exists and that no other generation named;
//   - a provider key belongs to one generation: every attempt of a generation that reports
//     one reports the same, and no later generation reports an earlier one's;
//   - a new generation starts only after a release, or once the key expired: the TTL after the
//     stored answer (on every path), or the TTL after the end of a lease that never answered.
//   - the SQL API's in_progress (with a retry_after) says a claim of the request is live, and
//     a lease held ends no earlier than its call plus retry_after;
//   - an attempt told its store was refused never becomes the answer (fencedAnswers, beside
//     the model: it needs no order).
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
//
// Check also checks liveness (liveness.go): a client that keeps retrying (Session.Retry) must
// end with the answer, and have it within LivenessBound plus LivenessSlack of it being stored.
package history

import (
	"fmt"
	"slices"
	"strings"
	"time"
)

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
	ruleLive                      // in_progress only while a claim of the request is live
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
	{ruleLive, "an in_progress where no claim of the request can be live"},
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
	if out.Outcome == Busy && out.Live {
		// The store said a lease claim of this very request is live, until at least LiveFor
		// after the call: the key is claimed by it (held; or done, since a fresh answer is one
		// point in the model though its claim was live while its work ran), and a lease held
		// ends no earlier.
		if s.phase == free || s.fp != in.Fingerprint {
			if st.refuse(ruleLive, "in_progress (a lease claim of this request live for %s more), but no claim of it can be "+
				"live: %s", out.LiveFor, s.describe()) {
				return nil
			}
			return []state{s}
		}
		if s.phase == held {
			s.since = max(s.since, call+int64(out.LiveFor))
		}
		return []state{s}
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
						c.answer = out.full()
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
			s.answer = out.full()
		case s.answer != out.full():
			if st.refuse(ruleAnswer, "a replay that differs from the stored answer: stored %s, got %s",
				short(s.answer, 80), short(out.full(), 80)) {
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

package history

import "time"

// The scenarios every harness runs.

// Storm: two or three clients send the same request at once and retry it until each has a
// final answer.
func Storm(route Route, weight int) Scenario {
	return Scenario{Name: "storm " + route.String(), Weight: weight, Run: func(s *Session) {
		k := s.Key(route)
		r := s.Request(k, 0)
		n := 2 + s.IntN(2)
		var fns []func()
		for i := range n {
			c := s.Client(i)
			fns = append(fns, func() { s.Until(c, r, 4, 0) })
		}
		s.Parallel(fns...)
	}}
}

// Changed: two clients send different requests under one key, the second a moment after
// the first; each retries until final; one of them repeats afterwards.
func Changed(route Route, weight int) Scenario {
	return Scenario{Name: "changed body " + route.String(), Weight: weight, Run: func(s *Session) {
		k := s.Key(route)
		a, b := s.Request(k, 0), s.Request(k, 1)
		offset := time.Duration(s.IntN(150)) * time.Millisecond
		s.Parallel(
			func() { s.Until(s.Client(0), a, 4, 0) },
			func() { s.Sleep(offset); s.Until(s.Client(1), b, 4, 0) },
		)
		s.Until(s.Client(2), []Request{a, b}[s.IntN(2)], 3, 0)
	}}
}

// Hangup: the client gives up on its first attempt a few milliseconds in (it hangs up), then
// retries; a second client sends the same request meanwhile.
func Hangup(route Route, weight int) Scenario {
	return Scenario{Name: "hang-up " + route.String(), Weight: weight, Run: func(s *Session) {
		k := s.Key(route)
		r := s.Request(k, 0)
		first := time.Duration(2+s.IntN(60)) * time.Millisecond
		s.Parallel(
			func() { s.Until(s.Client(0), r, 4, first) },
			func() { s.Sleep(time.Duration(s.IntN(100)) * time.Millisecond); s.Until(s.Client(1), r, 4, 0) },
		)
	}}
}

// Expiry: a request answered; around when the key expires (a little before, or after: the TTL
// after the answer, and for a lease the TTL after the lease's end, which outlasts the answer),
// the key is used again, by another request or the same one; then that one is repeated.
func Expiry(route Route, weight int) Scenario {
	return Scenario{Name: "expiry " + route.String(), Weight: weight, Run: func(s *Session) {
		k := s.Key(route)
		first := s.Until(s.Client(0), s.Request(k, 0), 4, 0)
		if !Final(first.Outcome) {
			return
		}
		expiry := first.Return + k.TTL
		if route == Leased {
			expiry += k.Lease
		}
		s.SleepUntil(expiry + time.Duration(s.IntN(700)-150)*time.Millisecond)
		next := s.Request(k, s.IntN(2))
		s.Until(s.Client(1), next, 4, 0)
		s.Until(s.Client(2), next, 3, 0)
	}}
}

// The liveness scenarios: clients that keep retrying (Session.Retry), their keys watched
// (Session.Watch); the liveness check holds them to the bound.

// Outlast: one client retries a request whose work takes longer than each of its attempts
// (the harness makes the route's work slow: attempt must be shorter than it): every attempt
// gives up after attempt, and the client retries, honouring Retry-After, for up to span. It
// must get the answer, within the bound after it was stored.
func Outlast(route Route, attempt, span time.Duration, weight int) Scenario {
	return Scenario{Name: "outlast " + route.String(), Weight: weight, Run: func(s *Session) {
		k := s.Key(route)
		r := s.Request(k, 0)
		defer s.Watch(k, r)()
		s.Retry(s.Client(0), r, RetryOptions{AttemptTimeout: attempt, For: span})
	}}
}

// Duplicate: a client sends a request and waits for its answer (attempts of the runner's
// OpTimeout, longer than the work); a second client sends the same request offset later,
// while the work runs, and retries, honouring Retry-After, for up to span. Both must get the
// answer, the second within the bound after the first's was stored.
func Duplicate(route Route, offset, span time.Duration, weight int) Scenario {
	return Scenario{Name: "duplicate " + route.String(), Weight: weight, Run: func(s *Session) {
		k := s.Key(route)
		r := s.Request(k, 0)
		defer s.Watch(k, r)()
		s.Parallel(
			func() { s.Retry(s.Client(0), r, RetryOptions{For: span}) },
			func() { s.pause(offset); s.Retry(s.Client(1), r, RetryOptions{For: span}) },
		)
	}}
}

// The scenarios at the contract's time bounds.

// edgeMargin is how long before the earliest instant the model lets a key expire ExpiryEdge
// probes it: long enough that the probe returns before that instant (minus ClockSlack), so a
// key gone early is a violation; short enough that a key deleted a second early, or kept the
// TTL after its claim rather than its answer, is already gone.
const edgeMargin = 500 * time.Millisecond

// ExpiryEdge: under a key with a TTL of ttl (0: the harness's; another only on a harness that
// claims with the key's TTL), a request whose work takes work (its claim and its answer that
// far apart), answered fresh; the same request again edgeMargin before the earliest instant
// the model lets the key expire (the TTL after the answer was stored, as the model bounds it: when its client
// sent what stores it, else the call): it must be replayed; a key cleaned up early, or kept the
// TTL after the claim instead of the answer, is a new generation there, which the model
// refuses (an attempt that decides nothing, through a fault, is tried again while there is
// time). Then again just after that instant (replayed or a new generation, both allowed), and
// a repeat. The event "expiry probed before the edge tx|lease" counts the probes that returned
// in time to tell.
func ExpiryEdge(route Route, work, ttl time.Duration, weight int) Scenario {
	return Scenario{Name: "expiry edge " + route.String(), Weight: weight, Run: func(s *Session) {
		k := s.Key(route)
		if ttl > 0 {
			k.TTL = ttl
		}
		r := s.Request(k, 0)
		r.Work = work
		var first Output
		var call time.Duration
		for range 3 {
			call = s.Now()
			if first = s.Send(s.Client(0), r, work+s.r.OpTimeout); Final(first.Outcome) || s.stopping() {
				break
			}
			s.Sleep(time.Duration(50+s.IntN(250)) * time.Millisecond)
		}
		if first.Outcome != Answered {
			return
		}
		edge := max(call, first.StoredAfter) + k.TTL
		again := s.Request(k, 0)
		s.SleepUntil(edge - edgeMargin)
		// Again at once while an attempt decides nothing (a fault) and there is time to tell.
		for s.Now() < edge-edgeMargin/3 && !s.stopping() {
			out := s.Send(s.Client(1), again, edgeMargin)
			if Final(out.Outcome) {
				if out.Return < edge-ClockSlack {
					s.Event("expiry probed before the edge " + route.String())
				}
				break
			}
			s.Sleep(20 * time.Millisecond)
		}
		s.SleepUntil(edge + 200*time.Millisecond)
		s.Until(s.Client(2), again, 2, 0)
	}}
}

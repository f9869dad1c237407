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

package history

import "time"

// The SQL level's own scenarios, for what only a client of the SQL API can do.

// deadLeaseTakeover: a lease claim dies (left to run out); after its end, a transactional
// claim of the same request takes the key over and answers; a repeat comes after the dead
// lease's end plus the TTL, but before the answer plus the TTL: it must get the answer.
func deadLeaseTakeover(weight int) Scenario {
	return Scenario{Name: "dead lease, transactional takeover", Weight: weight, Run: func(s *Session) {
		k := s.Key(Leased)
		k.TTL = 3 * time.Second
		hold := s.Request(k, 0)
		hold.Hold = true
		held := s.Until(s.Client(0), hold, 3, 0)
		if held.Outcome != Held {
			return
		}
		s.SleepUntil(held.Return + k.Lease + 1500*time.Millisecond)
		tx := s.Request(k, 0)
		tx.Route, tx.RouteSet = Transactional, true
		answer := s.Until(s.Client(1), tx, 3, 0)
		if answer.Outcome != Answered {
			return
		}
		s.SleepUntil(answer.Return + 2*time.Second)
		s.Until(s.Client(2), tx, 3, 0)
	}}
}

// leaseExpiry: a lease claim left to run out; another request meanwhile (refused), then after
// the lease's end plus the TTL (a new generation).
func leaseExpiry(weight int) Scenario {
	return Scenario{Name: "lease expiry", Weight: weight, Run: func(s *Session) {
		k := s.Key(Leased)
		hold := s.Request(k, 0)
		hold.Hold = true
		p := hold.Payload.(sqlPayload)
		p.payOnHold = true
		hold.Payload = p
		held := s.Until(s.Client(0), hold, 3, 0)
		if held.Outcome != Held {
			return
		}
		other := s.Request(k, 1)
		s.SleepUntil(held.Return + k.Lease + 300*time.Millisecond)
		s.Until(s.Client(1), other, 2, 0)
		s.SleepUntil(held.Return + k.Lease + k.TTL + 300*time.Millisecond)
		s.Until(s.Client(1), other, 3, 0)
		s.Until(s.Client(2), other, 2, 0)
	}}
}

// releaseReuse: a lease claim released (its work failed), then another request at once: a
// new generation, with a provider key of its own.
func releaseReuse(weight int) Scenario {
	return Scenario{Name: "release, then reuse", Weight: weight, Run: func(s *Session) {
		k := s.Key(Leased)
		rel := s.Request(k, 0)
		rel.Release = true
		if out := s.Until(s.Client(0), rel, 3, 0); out.Outcome != Released {
			return
		}
		next := s.Request(k, s.IntN(2))
		s.Until(s.Client(1), next, 3, 0)
		s.Until(s.Client(2), next, 2, 0)
	}}
}

// staleHolder: a lease claim whose holder stalls past its lease (its work takes the lease and
// 600 ms more) while the same request takes the key over 100 ms after the lease's end (or, told
// in_progress while the holder's claim, which came back late, still runs, within a pause of its
// end) and answers 900 ms later; the stale holder tries
// to complete in between, and must be told it lost (55000): only the attempt that holds the key stores its answer (fencing). Then a
// repeat, which must replay the taker's answer (its attempt is in the body).
func staleHolder(weight int) Scenario {
	return Scenario{Name: "stale holder", Weight: weight, Run: func(s *Session) {
		k := s.Key(Leased)
		stale, taker := s.Request(k, 0), s.Request(k, 0)
		stale.Work, taker.Work = k.Lease+600*time.Millisecond, 900*time.Millisecond
		var first, second Output
		start := s.Now()
		s.Parallel(
			func() { first = s.Send(s.Client(0), stale, k.Lease+2*time.Second) },
			func() {
				s.SleepUntil(start + k.Lease + 100*time.Millisecond)
				// Told in_progress until the stale lease ends (the holder's claim may have come
				// back late), then it takes over, within a pause (300 ms) of the end.
				second = s.Until(s.Client(1), taker, 10, 3*time.Second)
			},
		)
		if second.Outcome == Answered {
			s.Event("takeover")
		}
		if first.Outcome == Lost || second.Outcome == Lost {
			s.Event("lost lease")
		}
		s.Until(s.Client(2), s.Request(k, 0), 2, 0)
	}}
}

// contention: a lease claim left held; the same request at half the lease, 300 ms and 100 ms
// before the lease's end (from the holder's call: earlier than the end), each of which must
// be told it is in progress: a takeover before the lease's end is a violation. Then the same
// request after the end, which takes it over.
func contention(weight int) Scenario {
	return Scenario{Name: "contention on a holder", Weight: weight, Run: func(s *Session) {
		k := s.Key(Leased)
		hold := s.Request(k, 0)
		hold.Hold = true
		call := s.Now()
		if held := s.Send(s.Client(0), hold, 0); held.Outcome != Held {
			return
		}
		for _, at := range []time.Duration{k.Lease / 2, k.Lease - 300*time.Millisecond, k.Lease - 100*time.Millisecond} {
			s.SleepUntil(call + at)
			if out := s.Send(s.Client(1), hold, 0); out.Outcome == Busy && out.Note == "in_progress" {
				s.Event("in_progress before the lease's end")
			}
		}
		s.SleepUntil(call + k.Lease + 100*time.Millisecond)
		if out := s.Until(s.Client(2), s.Request(k, 0), 8, 0); out.Outcome == Answered {
			s.Event("takeover")
		}
	}}
}

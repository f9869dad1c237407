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

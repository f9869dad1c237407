package history

import (
	"context"
	"time"
)

// RetryOptions say how a client retries (Session.Retry).
type RetryOptions struct {
	// AttemptTimeout: each attempt gives up after it (0: the runner's OpTimeout).
	AttemptTimeout time.Duration
	// For is how long the client keeps retrying after its first call before it gives up. Make it
	// longer than the work plus LivenessBound and LivenessSlack: a client that gives up is a
	// liveness violation.
	For time.Duration
}

// Retry sends r as client c until its outcome is final, as a client that keeps retrying: each
// attempt gives up after AttemptTimeout; between two it waits what the answer asked
// (Output.RetryAfter, honoured as sent) or else 50 to 300 ms. A wait that would end past For
// after the first call ends there, and the client gives up. The attempts form a Chain, which
// the liveness check checks. Unlike Until it goes on once the run is big enough (a chain
// begun is finished); only the run's context cuts it.
func (s *Session) Retry(c int, r Request, o RetryOptions) Output {
	chain := s.r.H.beginChain(input(c, r))
	deadline := chain.Start + o.For
	var out Output
	for n := 1; ; n++ {
		out = s.send(c, r, o.AttemptTimeout)
		if Final(out.Outcome) || s.ctx.Err() != nil {
			s.r.H.endChain(chain, n, out, Final(out.Outcome), s.ctx.Err() != nil)
			return out
		}
		wait := max(time.Duration(50+s.IntN(250))*time.Millisecond, out.RetryAfter)
		if now := s.Now(); now+wait >= deadline {
			s.pause(deadline - now)
			s.r.H.endChain(chain, n, out, false, s.ctx.Err() != nil)
			return out
		}
		s.pause(wait)
	}
}

// pause pauses the session for d, whether or not the run is big enough.
func (s *Session) pause(d time.Duration) {
	select {
	case <-time.After(d):
	case <-s.ctx.Done():
	}
}

// StoreWatcher is a Harness that can look from outside the clients whether a key's answer is
// stored (the key table), and what it is. Session.Watch uses it: the liveness check then knows
// when an answer was stored even when no client got it fresh (its client had hung up).
type StoreWatcher interface {
	// Stored returns the key's stored answer (status and body, as a replay sends them), or
	// ok false when none is stored.
	Stored(ctx context.Context, k Key) (status int, body string, ok bool, err error)
}

// watchEvery is how often Watch looks: the instant it records is at most this much (and a
// query) after the answer was stored.
const watchEvery = 20 * time.Millisecond

// Watch looks every 20 ms, when the harness is a StoreWatcher, whether the answer under k is
// stored, and records the first instant it saw one (History.Stored) as r's; until then, or
// until stop is called. Use it on a key only r uses.
func (s *Session) Watch(k Key, r Request) (stop func()) {
	w, ok := s.r.Harness.(StoreWatcher)
	if !ok {
		return func() {}
	}
	ctx, cancel := context.WithCancel(s.ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for ctx.Err() == nil {
			q, cancelQ := context.WithTimeout(ctx, time.Second)
			status, body, found, err := w.Stored(q, k)
			cancelQ()
			if err == nil && found {
				s.r.H.Stored(k.String(), r.Fingerprint, Output{Status: status, Body: body})
				return
			}
			select {
			case <-time.After(watchEvery):
			case <-ctx.Done():
			}
		}
	}()
	return func() { cancel(); <-done }
}

package idemhttp

import (
	"context"
	"errors"
	"math"
	"math/rand/v2"
	"strconv"
	"time"

	"github.com/pgidem/pgidem/internal/dbidem"
)

// lease runs the handler of a committed lease claim, for work outside the database, and
// records its answer, fenced by the claim's token:
//
//   - the handler's context carries the request's values but not its cancellation (a client
//     that disconnects does not stop the work; the answer is recorded for its retry), and ends
//     at the route's LeaseTimeout;
//   - a heartbeat extends the lease every third of it while the handler runs, so duplicates
//     keep getting 409 with Retry-After however long the work takes;
//   - when the lease is lost (taken over, or not extended in time), the handler's context ends
//     with cause ErrLeaseLost, its answer is neither recorded nor sent: the client gets 409
//     request_in_progress, and its retry gets the answer of the attempt that holds the key;
//   - a 2xx or a final error is stored, anything else releases the claim (a retry runs the
//     work again, and a provider that deduplicates by ClaimInfo.ProviderKey does not repeat
//     it).
func (q *request) lease(ctx context.Context, claim dbidem.Claim, attempt int64) State {
	start := time.Now()
	timeout := q.rt.LeaseTimeout
	if timeout <= 0 {
		timeout = dbidem.DefaultLeaseTimeout
	}
	l := dbidem.KeepAlive(context.WithoutCancel(ctx), q.m.o.DB, claim.Principal, claim.Key, attempt,
		dbidem.LeaseOptions{Lease: claim.Lease, Timeout: timeout, OnExtend: func() { q.m.o.Metrics.LeaseExtended(q.action) }})
	hctx, handlerSpan := q.startSpan(l.Context(), "idem.handler")
	rec, st, v := q.run(hctx, nil, true)
	endHandlerSpan(handlerSpan, rec, v)
	_, done := q.startSpan(context.WithoutCancel(ctx), "idem.complete")
	// The heartbeat stops before the answer is recorded (an extension after it would find the
	// claim completed and report the lease lost); the lease it extended outlasts the recording
	// by two thirds at least, and the recording is fenced by the token anyway.
	lost := l.Stop()
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), claim.Lease)
	defer cancel()
	var err error
	switch {
	case lost:
	case v == rollBack:
		_, err = dbidem.Release(ctx, q.m.o.DB, claim.Principal, claim.Key, attempt)
	default:
		resp, big := q.stored(rec, st)
		if big {
			q.m.o.Metrics.Count(q.action, StateOversize)
		}
		err = q.complete(ctx, claim, attempt, resp)
	}
	lost = lost || errors.Is(err, dbidem.ErrClaimLost)
	switch {
	case lost:
		endSpan(done, "lease_lost", dbidem.ErrLeaseLost)
	case v == rollBack:
		endSpan(done, "released", err)
	default:
		endSpan(done, [...]string{commit: "completed", final: "final"}[v], err)
	}
	q.m.o.Metrics.LeaseEnded(q.action, lost, time.Since(start))
	log := q.m.o.Logger.With("key_hash", keyHash(claim.Principal, claim.Key), "attempt", attempt,
		"extensions", l.Extensions(), "request_id", q.r.Header.Get(q.m.o.CorrelationHeader))
	switch {
	case lost:
		log.Error("idem: lease lost: another attempt may hold the key; this attempt's answer is not recorded and not sent")
		q.inProgress(claim.Lease)
	case err != nil && v == rollBack:
		log.Error("idem: lease not released; the key stays in progress until the lease runs out, then a retry runs the work again", "error", err)
		q.answer(rec)
	case err != nil:
		log.Error("idem: lease answer not recorded; the key stays in progress until the lease runs out, then a retry runs the work again", "error", err)
		q.w.Header().Set("Retry-After", strconv.Itoa(max(int(math.Ceil(claim.Lease.Seconds())), 1)))
		q.m.problem(q.w, q.r, CodeOutcomeUnknown, "the work was done but its answer could not be recorded: retry with the same key "+
			"after Retry-After to get an answer (work that an outside provider deduplicates is not repeated)", nil)
	default:
		q.answer(rec)
	}
	return StateAcquired
}

// complete stores the lease's answer, trying again while a failure may be passing (the
// heartbeat keeps the lease meanwhile), until ctx ends.
func (q *request) complete(ctx context.Context, claim dbidem.Claim, attempt int64, resp dbidem.Response) error {
	for wait := 20 * time.Millisecond; ; wait *= 2 {
		err := dbidem.Complete(ctx, q.m.o.DB, claim.Principal, claim.Key, attempt, resp)
		if err == nil || errors.Is(err, dbidem.ErrClaimLost) || errors.Is(err, dbidem.ErrInvalidArgument) {
			return err
		}
		select {
		case <-ctx.Done():
			return errors.Join(err, ctx.Err())
		case <-time.After(wait/2 + rand.N(wait/2)):
		}
	}
}

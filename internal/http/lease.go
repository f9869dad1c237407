package idemhttp

import (
	"context"
	"errors"
	"math"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

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
//     with cause ErrLeaseLost. A 2xx answer the handler still gives is recorded, fenced by the
//     token, and sent if no other attempt has taken the key over (the lease ran out without an
//     extension landing, D149) and the key has not expired (its TTL past the lease's end); any
//     other answer, or a 2xx once another attempt holds the key, is neither recorded nor sent:
//     the client gets 409 request_in_progress, and its retry gets the answer of the attempt
//     that holds the key;
//   - the handler's steps (Step) commit with their recovery points; a takeover skips those
//     its generation recorded, and a step that finds the claim taken over loses the lease;
//   - a 2xx or a final error is stored; anything else ends the lease at once without an
//     answer (idem_yield): the client's retry of the same request takes the key over and runs
//     the work again under the same ClaimInfo.ProviderKey, which a provider that deduplicates
//     does not repeat; another request under the key gets 422 until the key expires.
func (q *request) lease(ctx context.Context, claim dbidem.Claim, d dbidem.Decision) State {
	start := time.Now()
	if lo, ok := q.m.o.Metrics.(LeaseClaimObserver); ok {
		lo.LeaseClaimed(q.action) // an Observer that exports its lease figures from the first lease on
	}
	attempt := d.Attempt
	// Every line this lease logs names the key's hash, the attempt and the request.
	llog := q.m.o.Logger.With("key_hash", KeyHash(claim.Principal, claim.Key), "attempt", attempt,
		"request_id", q.r.Header.Get(q.m.o.CorrelationHeader))
	timeout := q.rt.LeaseTimeout
	if timeout <= 0 {
		timeout = dbidem.DefaultLeaseTimeout
	}
	// The work outlives the client but not the middleware's Shutdown.
	wctx, untrack := q.m.work.context(context.WithoutCancel(ctx))
	defer untrack()
	db := slotted{q: q.m.o.DB, slots: q.m.leaseSlots}
	if errors.Is(context.Cause(wctx), ErrShutdown) {
		// Shutdown's deadline passed between the claim's COMMIT and the work's start: the work
		// does not start (its context is ended already), and the claim is given up, fenced by
		// its token, as a handler that stopped at the deadline gives it up: the client's retry
		// runs the work, under the same provider key, on another process (D179).
		yctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), min(claim.Lease, 5*time.Second))
		yielded, err := dbidem.PersistYield(yctx, db, claim.Principal, claim.Key, attempt)
		cancel()
		retry := "1"
		if yielded {
			q.m.watches.signal(watchKey{claim.Principal, claim.Key})
		} else if err != nil && !errors.Is(err, dbidem.ErrClaimLost) {
			llog.Error("idem: lease not ended; the key stays in progress until the lease runs out, then a retry runs the work again",
				"error", err)
			// The claim stands until its lease runs out: a retry before that would get 409.
			retry = strconv.Itoa(max(int(math.Ceil(claim.Lease.Seconds())), 1))
		}
		// No LeaseEnded: the work did not run.
		q.w.Header().Set("Retry-After", retry)
		q.m.problem(q.w, q.r, CodeShuttingDown, "this server is shutting down; the work did not start: retry with the same key", nil)
		return StateAcquired
	}
	// The heartbeat outlives Shutdown's deadline, which ends the handler's context (below): a
	// handler that goes on into the grace keeps its lease, extended, until it returns, or
	// another process took the key over at the lease's end and ran the work beside it, and the
	// answer given in the grace was lost (D270).
	// It ends when this function does, whatever way (a handler's runtime.Goexit included).
	beats, endBeats := context.WithCancel(context.WithoutCancel(wctx))
	defer endBeats()
	l := dbidem.KeepAlive(beats, db, claim.Principal, claim.Key, attempt,
		dbidem.LeaseOptions{Lease: claim.Lease, Timeout: timeout, Start: d.Sent,
			OnExtend: func() { q.m.o.Metrics.LeaseExtended(q.action) }})
	if l.Lost() {
		// The claim waited so long (on another holder of the key) that its lease ran out
		// before the work could start, and it could not be renewed: another attempt may hold
		// the key; the work does not start.
		l.Stop()
		llog.Error("idem: a lease ran out before its work started; the work did not run", "extensions", l.Extensions())
		q.m.o.Metrics.LeaseEnded(q.action, true, time.Since(start))
		q.m.o.Metrics.Count(q.action, StateBusy) // on top of acquired: the client got 409
		retry := claim.Lease
		if !l.TakenOver() {
			// Lost by this process's clock alone (the extension's reply lost, the database
			// unreachable): the claim may stand, extended by an extension that landed, and
			// every retry would wait it out. Given up, fenced by the token, as DoLease does
			// (D168); nothing when another attempt holds the key.
			// Bounded as giveUpUnknownClaim is: the client waits for its 409 meanwhile.
			yctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), min(claim.Lease, 5*time.Second))
			if yielded, _ := dbidem.PersistYield(yctx, db, claim.Principal, claim.Key, attempt); yielded {
				retry = time.Second
				q.m.watches.signal(watchKey{claim.Principal, claim.Key})
			}
			cancel()
		}
		q.inProgress(retry)
		return StateBusy
	}
	// The handler's steps (Step) commit with their recovery points, fenced by the token; the
	// ones this generation recorded before (a takeover, a retry after a yield) are skipped.
	lc := dbidem.LeaseClaim{Principal: claim.Principal, Key: claim.Key, Attempt: attempt, ProviderKey: d.ProviderKey,
		RecoveryPoint: d.RecoveryPoint}
	// The handler's context ends with the lease (lost, or its LeaseTimeout) and at Shutdown's
	// deadline (cause ErrShutdown).
	lctx, endWork := context.WithCancelCause(l.Context())
	defer endWork(nil)
	defer context.AfterFunc(wctx, func() { endWork(context.Cause(wctx)) })()
	sctx := dbidem.WithSteps(lctx, dbidem.NewSteps(q.m.o.DB, &lc, d, l, q.txOptions()))
	hctx, handlerSpan := q.startSpan(sctx, "idem.handler")
	// A handler that panics with http.ErrAbortHandler (run passes only that panic on) asks for
	// the connection to be dropped without an answer: the claim is given up as for any other
	// failure, then the panic goes on to net/http. Before, the claim stood until its lease ran
	// out and every retry got 409 meanwhile.
	aborted := false
	rec, st, v := func() (rec *recorder, st *state, v verdict) {
		defer func() {
			if p := recover(); p != nil {
				if p != http.ErrAbortHandler {
					panic(p)
				}
				aborted = true
				rec, st, v = nil, nil, rollBack
			}
		}()
		return q.run(hctx, nil, true)
	}()
	endHandlerSpan(handlerSpan, rec, v)
	// The handler's context ended (Shutdown, the route's LeaseTimeout) and it stopped without
	// answering: net/http would send an empty 200, and it would be stored as the answer of work
	// that did not run. The lease is given up instead, as for a failure, and the client told to
	// retry (this process or another runs the work again, under the same provider key). A lost
	// lease is the case below of its own (lost).
	ended := v == commit && rec != nil && rec.status == 0 && hctx.Err() != nil
	shutdown := ended && errors.Is(context.Cause(hctx), ErrShutdown)
	if ended {
		v = rollBack
	}
	if q.earlierTakeover && v == final {
		// A body of another type than JSON took over, under the earlier release's
		// fingerprint, a lease that may be a JSON request's of this release (the row does not
		// say which, D178), and its handler refused it (415 for a type it does not read):
		// stored, that refusal would be the final answer of work the JSON request may have
		// half done (steps recorded, a provider paid). It is sent as it is, not stored, and
		// the lease given up: the request the key was claimed for takes it over at once (D205).
		v = rollBack
	}
	_, done := q.startSpan(context.WithoutCancel(ctx), "idem.complete")
	// The heartbeat stops before the answer is recorded (an extension after it would find the
	// claim completed and report the lease lost). The recording (or the release) is tried,
	// again after each failure that may pass (dbidem.Persist), until the lease's end by this
	// process's clock and at least one lease from now (AnswerDeadline): past the end another attempt may have taken the key over, and then
	// the recording, fenced by the token, fails (the client gets 409); while none has, it
	// still lands.
	//
	// A 2xx that the handler wrote after its lease was lost is recorded too (D149): the lease
	// may have run out without an extension landing (the database unreachable, the key's row
	// locked) while no other attempt took the key over, and then the fenced recording lands and
	// the client gets the answer instead of a rerun. Once another attempt holds the key it
	// fails with ErrClaimLost. Written: a handler that returns without writing anything (the
	// documented reaction to a lost lease; net/http would send an empty 200) answers nothing.
	// A lost lease's other answers (an error, often the handler's reaction to its context's
	// end) are not recorded: the claim is given up instead where no extension found it taken
	// over (D164), and the client told 409.
	lost := l.Stop()
	if lost && l.RanOutAfterItsHeartbeat() {
		// The route's LeaseTimeout ended the handler's context, and the heartbeat with it; the
		// handler answered after the lease ran out. Recorded as any answer, fenced by the
		// token (a 422 stored, a handler that wrote nothing given up with its 500), as before
		// D241: the recording fails with ErrClaimLost once another attempt holds the key.
		lost = false
	}
	late := lost && v == commit && rec != nil && rec.status != 0
	ctx, cancel := context.WithDeadline(context.WithoutCancel(ctx), l.AnswerDeadline())
	defer cancel()
	var err error
	yielded := false // a lease that ran out by this process's clock alone, given up
	switch {
	case lost && !late:
		if !l.TakenOver() {
			// No extension was heard of (their replies lost, the database unreachable), none
			// found the key taken over: the claim may still stand, and every retry would wait
			// it out. Fenced by the token, the yield finds nothing when another attempt holds
			// the key (D164).
			// Bounded as giveUpUnknownClaim is: the client waits for its answer meanwhile.
			yctx, ycancel := context.WithTimeout(ctx, min(claim.Lease, 5*time.Second))
			var yerr error
			yielded, yerr = dbidem.PersistYield(yctx, db, claim.Principal, claim.Key, attempt)
			ycancel()
			if yerr != nil && !errors.Is(yerr, dbidem.ErrClaimLost) {
				llog.Warn("idem: a lease that ran out by this process's clock could not be given up; the key waits for its lease to run out",
					"error", yerr)
			}
		}
	case v == rollBack:
		_, err = dbidem.PersistYield(ctx, db, claim.Principal, claim.Key, attempt)
	default:
		resp, big := q.stored(rec, st)
		if big {
			q.m.o.Metrics.Count(q.action, StateOversize)
		}
		err = q.complete(ctx, db, claim, attempt, resp)
		if errors.Is(err, dbidem.ErrClaimLost) && v != rollBack {
			// The claim is gone: another attempt holds the key, or the key expired under this
			// one (its lease and its TTL ran out: a handler that went on past them, or
			// extensions that did not land that long) and nobody took it. In the second case
			// the answer is stored all the same, for the key nobody holds (a new generation
			// with this answer, which the work's provider call had), instead of a 409 whose
			// retry would run the work again under a new provider key (D249). SaveFinal
			// overwrites no live row: another attempt's key stays its own.
			if saved, serr := dbidem.SaveFinal(ctx, db, claim, resp); serr == nil && saved {
				err = nil
				llog.Warn("idem: a lease's key expired before its work ended, and no other attempt had taken it: its answer was stored for the key")
			}
		}
	}
	// unanswered: the client gets 409, another attempt answers. lost: the lease was lost and
	// its answer not recorded (a late 2xx that could not be recorded by the deadline is
	// answered 503 outcome_unknown below, as any answer not recorded, and counts as lost).
	unanswered := (lost && !late && !yielded) || errors.Is(err, dbidem.ErrClaimLost)
	if late && err == nil {
		llog.Warn("idem: a lease ran out before its work ended, but no other attempt had taken the key over: its answer was recorded")
	}
	lost = unanswered || yielded || (late && err != nil)
	switch {
	case lost:
		endSpan(done, "lease_lost", dbidem.ErrLeaseLost)
	case v == rollBack:
		endSpan(done, "yielded", err)
	default:
		endSpan(done, [...]string{commit: "completed", final: "final"}[v], err)
	}
	q.m.o.Metrics.LeaseEnded(q.action, lost, time.Since(start))
	if !lost || yielded {
		// The duplicates of this process waiting on the key claim again now: a replay, or a
		// takeover of the lease this attempt gave up.
		q.m.watches.signal(watchKey{claim.Principal, claim.Key})
		if !lost && v != rollBack && err == nil {
			q.m.typical.add(q.action, time.Since(start))
		}
	}
	log := llog.With("extensions", l.Extensions())
	if aborted {
		if err != nil {
			log.Error("idem: the handler aborted; its lease was not ended, and the key stays in progress until the lease runs out", "error", err)
		}
		panic(http.ErrAbortHandler)
	}
	switch {
	case yielded:
		// Given up: the client's retry runs the work again at once, under the same provider
		// key. A handler's error is sent as it is; nothing else was answered.
		log.Error("idem: lease ran out by this process's clock (no extension heard of); its claim was given up, and a retry runs the work again")
		if v == rollBack && rec != nil && rec.status != 0 {
			q.answer(rec)
		} else {
			q.m.o.Metrics.Count(q.action, StateBusy) // on top of acquired: the client gets 409
			q.inProgress(time.Second)
		}
	case unanswered:
		log.Error("idem: lease lost: another attempt may hold the key; this attempt's answer is not recorded and not sent")
		// The lease's end has passed by this process's clock: the retry learns from the
		// database at once whether another attempt holds the key (and then waits for its
		// answer as a duplicate) or takes the key over.
		q.m.o.Metrics.Count(q.action, StateBusy) // on top of acquired: the client gets 409
		q.inProgress(time.Second)
	case shutdown:
		// The handler wrote nothing to send: the client is told to retry, also when the lease
		// could not be given up (the retry then takes it over once it runs out).
		if err != nil {
			log.Error("idem: lease not ended; the key stays in progress until the lease runs out, then a retry runs the work again", "error", err)
		}
		q.w.Header().Set("Retry-After", "1")
		q.m.problem(q.w, q.r, CodeShuttingDown, "this server shut down before the work answered; the work was given up: retry with the same key", nil)
	case ended:
		// The route's LeaseTimeout ended the work before it answered, as above.
		if err != nil {
			log.Error("idem: lease not ended; the key stays in progress until the lease runs out, then a retry runs the work again", "error", err)
		}
		q.m.problem(q.w, q.r, CodeInternalError, "the work did not answer within the route's lease timeout; it was given up: "+
			"retrying with the same key runs it again, under the same provider key", nil)
	case err != nil && v == rollBack:
		log.Error("idem: lease not ended; the key stays in progress until the lease runs out, then a retry runs the work again", "error", err)
		q.answer(rec)
	case err != nil:
		log.Error("idem: lease answer not recorded, or not known to be; if not, the key stays in progress until the lease runs out, then a retry runs the work again", "error", err)
		q.w.Header().Set("Retry-After", strconv.Itoa(max(int(math.Ceil(claim.Lease.Seconds())), 1)))
		q.m.problem(q.w, q.r, CodeOutcomeUnknown, "the work was done but its answer could not be recorded: retry with the same key "+
			"after Retry-After to get an answer (work that an outside provider deduplicates is not repeated)", nil)
		// On top of acquired, as a transactional route's commit whose outcome is unknown: the
		// database failed and the client got a 5xx.
		q.m.o.Metrics.Count(q.action, StateStoreError)
		return StateStoreError
	default:
		q.answer(rec)
	}
	return StateAcquired
}

// complete stores the lease's answer, trying again while a failure may be passing, until ctx
// (the lease's AnswerDeadline) ends; a try whose reply was lost and that landed counts as
// stored (dbidem.PersistAnswer).
func (q *request) complete(ctx context.Context, db dbidem.Querier, claim dbidem.Claim, attempt int64, resp dbidem.Response) error {
	return dbidem.PersistAnswer(ctx, db, db, claim, attempt, resp)
}

// slotted is the database as lease work uses it outside the claim (its extensions, the
// recording of its answer and the read that tells whether a lost one landed, the giving up of
// its lease, the duplicates' looks): while the key table is locked (a migration's swap, VACUUM
// FULL, pg_repack) those statements all wait on it, and they must not take every connection of
// the pool. Each takes one of the lease slots, as many as MaxWaitingClaims or half the pool's
// connections, whichever is more; the others wait in Go, without a connection, as long as their
// context lets them. As many as MaxWaitingClaims alone (one at a pool of 4) queued every
// lease's heartbeat behind a statement that waited on one key's locked row, or behind slow
// writes, and leases were lost with the pool idle (D229).
type slotted struct {
	q     dbidem.Querier
	slots leaseSlots
}

// leaseSlots bound the statements of lease work outside its claim that run at once.
type leaseSlots chan struct{}

// newLeaseSlots returns as many slots as waiting or half of maxConns, whichever is more.
func newLeaseSlots(waiting int, maxConns int32) leaseSlots {
	return make(leaseSlots, max(waiting, int(maxConns)/2))
}

// take waits for a slot until ctx ends; release gives it back.
func (l leaseSlots) take(ctx context.Context) (release func(), err error) {
	select {
	case l <- struct{}{}:
		return func() { <-l }, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

func (s slotted) acquire(ctx context.Context) (func(), error) {
	return s.slots.take(ctx)
}

// Reserve takes a slot on ctx for a statement that dbidem sends from a goroutine of its own,
// on a context that never ends (an answer's recording, D165): the wait for the slot ends with
// ctx, and the statement, once sent, holds the slot until PostgreSQL answers it (release), or
// for dbidem's boundedHold at most.
func (s slotted) Reserve(ctx context.Context) (dbidem.Querier, func(), error) {
	release, err := s.acquire(ctx)
	if err != nil {
		return nil, nil, err
	}
	return s.q, release, nil
}

func (s slotted) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	release, err := s.acquire(ctx)
	if err != nil {
		return errRow{err}
	}
	returned := false
	defer func() {
		if !returned {
			release() // the pool's code panicked: the slot goes back all the same (D225)
		}
	}()
	row := s.q.QueryRow(ctx, sql, args...)
	returned = true
	return &slottedRow{row: row, release: release}
}

func (s slotted) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	release, err := s.acquire(ctx)
	if err != nil {
		return pgconn.CommandTag{}, err
	}
	defer release()
	return s.q.Exec(ctx, sql, args...)
}

// slottedRow gives its slot back once scanned (every caller scans).
type slottedRow struct {
	row     pgx.Row
	release func()
	once    sync.Once
}

func (r *slottedRow) Scan(dest ...any) error {
	defer r.once.Do(r.release)
	return r.row.Scan(dest...)
}

type errRow struct{ err error }

func (r errRow) Scan(...any) error { return r.err }

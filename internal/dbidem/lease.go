package dbidem

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Leases: work outside the database (a call to a payment provider, an e-mail) runs under a
// lease claim, committed on its own before the work starts. While the work runs, a heartbeat
// extends the lease (idem_extend), so a duplicate keeps being told the work is in progress for
// as long as it runs; when an extension finds the claim gone (taken over, the key cleaned up) or
// none succeeds before the lease runs out, the work's context ends with ErrLeaseLost.

// ErrLeaseLost is the cause (context.Cause) of a lease's context when the lease was lost: an
// extension found the claim no longer in progress with its token, or the lease ran out before
// an extension succeeded (the database could not be reached), so another attempt may have
// taken the key over. The work should stop. A result it still returns with a nil error
// (DoLease), or a 2xx a lease route's handler still writes, is recorded only while no other
// attempt has taken the key over: by the recording fenced by the token while the key has not
// expired (its TTL past the lease's end), and, once it has expired (or was released) with
// nobody holding it, for the key as a new generation's answer (idem_save_final).
var ErrLeaseLost = errors.New("idem: lease lost")

// extendSQL reads the lease's new end in microseconds (microsSQL).
var extendSQL = `SELECT ` + fmt.Sprintf(microsSQL, `idem.idem_extend(p_principal => $1::text, p_key => $2::text, p_attempt => $3::bigint, p_lease => $4::interval)`)

// Extend moves the lease of the in-progress lease claim with this attempt to lease from now
// (never earlier), and the key's expiry with it, and returns the lease's new end as the
// database's clock has it. It returns ErrClaimLost when no lease claim with this attempt is in
// progress: it was taken over by a later attempt, completed, released, or the key expired and
// was cleaned up.
func Extend(ctx context.Context, q Querier, principal, key string, attempt int64, lease time.Duration) (time.Time, error) {
	if lease == 0 {
		// interval sends 0 as NULL (the functions' default), which idem_extend refuses as a
		// NULL: say what was wrong
		return time.Time{}, fmt.Errorf("%w: idem_extend: the lease must be positive, got 0", ErrInvalidArgument)
	}
	var end *int64
	err := q.QueryRow(ctx, extendSQL, principal, key, attempt, interval(lease)).Scan(&end)
	return microsTime(end), classify(err)
}

// LeaseOptions configure KeepAlive.
type LeaseOptions struct {
	// Lease is what each extension asks for: the lease then runs until this long after it.
	// Required; the claim's Lease as a rule.
	Lease time.Duration
	// Start is when the lease began by this process's clock, at or before the database began
	// counting it: the claim's Decision.Sent (taken just before the claim was sent), or the
	// moment just before an Extend was sent. The local deadline is Start plus Lease, so it is
	// never later than the database's, whatever the claim waited for and however long its
	// COMMIT took; the first extension is due Interval after Start. Zero: now, which is late
	// by the claim's round trips and waits (a takeover may then begin before this process
	// sees its lease as lost).
	Start time.Time
	// Interval is the time between extensions. 0: a third of Lease, so that one extension may
	// fail and the next still lands before the lease runs out; two in a row lose it (the third
	// would be due at its end).
	Interval time.Duration
	// Timeout bounds the work: the context ends then (cause context.DeadlineExceeded), whether
	// the lease holds or not. 0: no bound.
	Timeout time.Duration
	// OnExtend, if set, is called after each extension that succeeded (for metrics).
	OnExtend func()
}

// Lease is the heartbeat of one lease claim. Its context is the work's: it ends when the lease
// is lost (cause ErrLeaseLost), at LeaseOptions.Timeout, when the parent ends, or at Stop.
type Lease struct {
	ctx    context.Context
	cancel context.CancelCauseFunc
	stop   chan struct{}
	done   chan struct{}
	once   sync.Once
	lost   atomic.Bool
	// takenOver: the loss was found in the database (ErrClaimLost), not by this process's
	// clock alone.
	takenOver atomic.Bool
	beats     atomic.Int64
	end       atomic.Pointer[time.Time]
	lease     time.Duration
	// stoppedAt is when Stop was first called: a lease that ran out after it was not lost.
	stoppedAt atomic.Pointer[time.Time]
}

// KeepAlive starts the heartbeat of the lease claim (principal, key, attempt), which was made
// (or last extended) at opts.Start with opts.Lease, and returns it. When the first extension
// is due already (the claim came back late), KeepAlive makes it before it returns; if that
// fails because the claim was taken over, or the lease has run out meanwhile, the returned
// Lease is lost at once (Lost is true): do not start the work. Every opts.Interval it extends
// the lease on q (a pool: a connection is held only while the statement runs). An extension
// that fails for another reason (the database cannot be reached) is tried again at the next
// beat; the lease counts as lost when it runs out, by this process's clock, without one having
// succeeded. The work runs on Lease.Context; call Stop when it is done (and its answer
// recorded, which Complete fences by the same attempt).
func KeepAlive(parent context.Context, q Querier, principal, key string, attempt int64, opts LeaseOptions) *Lease {
	interval := opts.Interval
	if interval <= 0 {
		interval = opts.Lease / 3
	}
	ctx, cancel := context.WithCancelCause(parent)
	l := &Lease{ctx: ctx, cancel: cancel, stop: make(chan struct{}), done: make(chan struct{}), lease: opts.Lease}
	if opts.Timeout > 0 {
		var stopTimer context.CancelFunc
		l.ctx, stopTimer = context.WithTimeout(ctx, opts.Timeout)
		go func() { <-l.done; stopTimer() }()
	}
	start := opts.Start
	if start.IsZero() {
		start = time.Now()
	}
	if time.Since(start) >= interval {
		// The claim came back late (it waited on another holder of the key, or its COMMIT
		// did): the first extension is due, perhaps the lease's end is past. Extend before
		// the work starts: fenced by the token, it succeeds only while no other attempt took
		// the key over, and then the work runs under a lease that runs from now.
		began := time.Now()
		ectx, cancel := context.WithTimeout(ctx, interval)
		_, err := Extend(ectx, q, principal, key, attempt, opts.Lease)
		cancel()
		switch {
		case err == nil:
			start = began
			l.beats.Add(1)
			callOnExtend(opts.OnExtend)
		case errors.Is(err, ErrClaimLost) || !time.Now().Before(start.Add(opts.Lease)):
			// Taken over, or the lease ran out without an extension: the work must not start.
			end := start.Add(opts.Lease)
			l.end.Store(&end)
			l.lose(errors.Is(err, ErrClaimLost))
			close(l.done)
			return l
		}
	}
	end := start.Add(opts.Lease)
	l.end.Store(&end)
	go l.beat(q, principal, key, attempt, start, opts.Lease, interval, opts.OnExtend)
	return l
}

func (l *Lease) beat(q Querier, principal, key string, attempt int64, start time.Time, lease, interval time.Duration, onExtend func()) {
	defer close(l.done)
	end := start.Add(lease) // by this process's clock: never later than the database's end
	next := time.NewTimer(time.Until(start.Add(interval)))
	defer next.Stop()
	// The lease's end is watched by a timer of its own, not by this loop, which waits through
	// each extension: an extension still in flight at the end (blocked on a locked table, on a
	// connection that does not answer) returns only once its cancel has gone through, or when
	// a Querier that ignores its context gives up, and the work would learn of the loss that
	// much after the database's lease had ended, when another process may already hold the
	// key (D261).
	fired := make(chan struct{})
	expiry := time.AfterFunc(time.Until(end), func() {
		defer close(fired)
		// Not when Stop came first (the work ended before the loss was seen), nor when the
		// context ended first (the parent, the Timeout): the heartbeat ended with it, and
		// Lost tells the rest by the clock.
		if !l.stopped() && l.ctx.Err() == nil {
			l.lose(false)
		}
	})
	defer func() {
		// The heartbeat ends with the timer's decision made: Stop, which waits for the
		// heartbeat, reports the loss the work was told, and nothing changes it after.
		if !expiry.Stop() {
			<-fired
		}
	}()
	for {
		select {
		case <-l.stop:
			return
		case <-l.ctx.Done():
			return
		case <-next.C:
		}
		if l.stopped() {
			// Stop was called while the last extension was in flight, and the next one fell
			// due meanwhile: select picks among ready cases at random, so without this check
			// half such Stops would start one more extension, wait through it, and then, if
			// it ran to the lease's end, as likely see the lease lost as stopped.
			return
		}
		began := time.Now()
		next.Reset(interval)
		deadline := began.Add(interval)
		if end.Before(deadline) {
			deadline = end
		}
		ctx, cancel := context.WithDeadline(context.Background(), deadline)
		err := extendSafely(ctx, q, principal, key, attempt, lease)
		cancel()
		switch {
		case err == nil:
			if !expiry.Stop() {
				// The lease ran out by this process's clock while the extension was on its
				// way: it is lost, and an extension heard of after that does not undo it.
				return
			}
			end = began.Add(lease) // sent after began: never later than the database's new end
			e := end
			l.end.Store(&e)
			expiry.Reset(time.Until(end))
			l.beats.Add(1)
			callOnExtend(onExtend)
		case errors.Is(err, ErrClaimLost):
			l.lose(true)
			return
		}
	}
}

// End is when the lease runs out by this process's clock, as far as it knows: Start plus the
// lease, moved on by each extension that succeeded. The database's end is never earlier.
func (l *Lease) End() time.Time { return *l.end.Load() }

// stopped tells whether Stop was called.
func (l *Lease) stopped() bool {
	select {
	case <-l.stop:
		return true
	default:
		return false
	}
}

func (l *Lease) lose(takenOver bool) {
	if takenOver {
		l.takenOver.Store(true)
	}
	l.lost.Store(true)
	l.cancel(ErrLeaseLost)
}

// Context is the work's context: it carries the parent's values and ends with cause
// ErrLeaseLost when the lease is lost.
func (l *Lease) Context() context.Context { return l.ctx }

// AnswerDeadline is the deadline, read after Stop, for recording the work's answer (Complete)
// or giving its claim up (Yield): End, or one lease from now if that is later. Until End no other
// attempt can have taken the key over. Past it one may have, and then the recording, fenced by
// the attempt, fails with ErrClaimLost; but while none has, it still succeeds, so a recording
// delayed past End (a slow database, a lock, a stalled process) is not given up while it can
// still land: the client gets the answer instead of an unknown outcome.
func (l *Lease) AnswerDeadline() time.Time {
	end, floor := l.End(), time.Now().Add(l.lease)
	if end.After(floor) {
		return end
	}
	return floor
}

// Lost tells whether the lease was lost: another attempt may hold the key. The work's answer
// must not be sent as recorded unless its recording (Complete, fenced by the attempt) still
// succeeds, which it does only while no other attempt has taken the key over and the key has
// not expired (its TTL past the lease's end).
//
// The heartbeat ends with the lease's context (the parent's end, LeaseOptions.Timeout) and
// extends the lease no more: past End the lease is lost then too, unless Stop came first.
func (l *Lease) Lost() bool {
	if l.lost.Load() {
		return true
	}
	end := l.End()
	if s := l.stoppedAt.Load(); s != nil {
		return !s.Before(end)
	}
	return !time.Now().Before(end)
}

// RanOutAfterItsHeartbeat tells whether the lease counts as lost only because it ran out, by
// this process's clock, after its heartbeat had ended with its context (the parent's end,
// LeaseOptions.Timeout) and before Stop: no extension failed, none found the key taken over.
// A caller whose recording of the answer is fenced by the attempt anyway (the middleware's)
// may record it as for a lease not lost.
func (l *Lease) RanOutAfterItsHeartbeat() bool { return !l.lost.Load() && l.Lost() }

// TakenOver tells whether the lease was lost because the database said the claim is no longer
// this attempt's (an extension or a step found another attempt holding the key, or the claim
// given up): not when it ran out by this process's clock alone, with no extension heard of
// (their replies lost, the database unreachable), when the claim may still stand (D164).
func (l *Lease) TakenOver() bool { return l.takenOver.Load() }

// Extensions is how many extensions succeeded.
func (l *Lease) Extensions() int64 { return l.beats.Load() }

// Stop ends the heartbeat and the context, and waits for the heartbeat to finish: an extension
// in flight runs to its end (at most a third of the lease by default), and none starts after
// it. It reports whether the lease was lost before Stop was called, or before the heartbeat saw
// the stop. Safe to call more than once. One limit: an extension still waiting on the key's
// row when the lease ran out is given up and cancelled, and the server hears of the cancel a
// moment later; a row freed in that moment lets it land. The database's lease then runs on
// past End (by about a lease), with nobody working under it: a takeover waits for its end, as
// for any lease, and the key is never held by two attempts at once. Only an extension sent
// less than the functions' lock timeout (2 s) before the end can land so (its wait for the row
// ends by then): with the default Interval, a lease over 6 s starts none then (one that first
// waited for a pool connection may still be sent then).
func (l *Lease) Stop() (lost bool) {
	l.once.Do(func() {
		now := time.Now()
		l.stoppedAt.Store(&now)
		close(l.stop)
	})
	<-l.done
	l.cancel(context.Canceled)
	return l.Lost()
}

// Persist runs record (the Complete of a lease's answer, or the Yield that gives its claim up)
// until it succeeds, fails for a reason no retry changes (ErrClaimLost: another attempt holds
// the key, or the claim is no longer in progress; ErrInvalidArgument), or ctx ends, pausing a
// little longer each time (20 ms, doubling, jittered). Give ctx the Lease's AnswerDeadline. A
// recording can fail for a while and then land: each function gives up waiting for the key's
// row after its own lock timeout (2 s by default), a connection can break, a database restart.
// Since the recording is fenced by the attempt, trying again is safe: it lands only while the
// claim is still this attempt's. When ctx ends first, the last failure is returned joined
// with ctx's error. When ctx has a deadline, each try gets a third of the time left when
// Persist started, and at least persistTryFloor (the functions' own lock timeout, 2 s, which
// bounds every wait of theirs, and ClaimReplyMargin): a try whose connection stopped
// answering (black-holed: nothing comes back, nothing closes) is given up and the next one
// goes on another connection, where it used to take all of ctx (D168). A statement that
// commits on its own is abandoned, not canceled (Complete: ErrCommitUnknown), and
// PersistAnswer tells when it landed.
func Persist(ctx context.Context, record func(ctx context.Context) error) error {
	var perTry time.Duration
	if deadline, ok := ctx.Deadline(); ok {
		perTry = max(time.Until(deadline)/3, persistTryFloor)
	}
	for wait := 20 * time.Millisecond; ; wait = min(2*wait, time.Second) {
		tctx, cancel := ctx, context.CancelFunc(func() {})
		if perTry > 0 {
			tctx, cancel = context.WithTimeoutCause(ctx, perTry, errNoReply)
		}
		err := record(tctx)
		if err != nil && ctx.Err() == nil && context.Cause(tctx) == errNoReply && !errors.Is(err, errNoReply) {
			err = fmt.Errorf("%w (%w)", err, errNoReply)
		}
		cancel()
		if err == nil || errors.Is(err, ErrClaimLost) || errors.Is(err, ErrInvalidArgument) {
			return err
		}
		if ctx.Err() != nil {
			return errors.Join(err, ctx.Err())
		}
		t := time.NewTimer(wait/2 + rand.N(wait/2))
		select {
		case <-ctx.Done():
			t.Stop()
			return errors.Join(err, ctx.Err())
		case <-t.C:
		}
	}
}

// persistTryFloor is the least time Persist gives a try: the functions' default lock timeout
// (their SET clause; idem_complete and idem_yield take no other) and ClaimReplyMargin. A try
// that waits on the key's row lock is never cut while the wait may still end in its favour.
const persistTryFloor = 2*time.Second + ClaimReplyMargin

// PersistYield gives up the lease claim with this attempt (Yield) through Persist: tried
// again until it gets an answer, or ctx ends. It reports whether the claim was given up
// (false: it was no longer in progress, or the last try failed).
func PersistYield(ctx context.Context, q Querier, principal, key string, attempt int64) (bool, error) {
	var yielded bool
	err := Persist(ctx, func(ctx context.Context) error {
		var err error
		yielded, err = Yield(ctx, q, principal, key, attempt)
		return err
	})
	return yielded && err == nil, err
}

// GiveUpUnknown gives up the lease claim c with this attempt whose COMMIT's outcome is unknown
// (its reply lost, or abandoned on its way when its context ended), so that a claim that did
// land does not keep the key in progress under a lease no work holds. A yield alone would
// miss a fresh claim whose COMMIT is still on its way: its row is an uncommitted INSERT, which
// the yield's UPDATE does not see, and the COMMIT would land after it (D168). So it first
// asks for the key in a transaction that it rolls back: that claim waits for an uncommitted
// holder of the key (its lock timeout at most, tried again through Persist), then answers from
// the row as committed. Only a claim in progress with this attempt is given up (idem_yield,
// fenced by the token). It reports whether the claim was given up; run it until ctx ends.
func GiveUpUnknown(ctx context.Context, db Pool, c Claim, attempt int64) (bool, error) {
	stands := false
	err := Persist(ctx, func(ctx context.Context) error {
		conn, err := db.Acquire(ctx)
		if err != nil {
			return err
		}
		defer conn.Release()
		tx, err := conn.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.ReadCommitted})
		if err != nil {
			return err
		}
		defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
		d, err := Begin(ctx, tx, c)
		if err != nil {
			return err
		}
		stands = d.Outcome == InProgress && d.Attempt == attempt
		return nil
	})
	if err != nil || !stands {
		return false, err
	}
	return PersistYield(ctx, db, c.Principal, c.Key, attempt)
}

// PersistAnswer records r as the answer of the lease claim c with this attempt (Complete on q)
// through Persist, and tells an answer that landed from one that did not when a reply was
// lost. A Complete whose reply never came (the connection broke after the statement was sent)
// may have committed: the next try then finds the claim completed and fails with ErrClaimLost,
// although the answer stored is this one. The same holds after an earlier Complete of the
// caller's that returned ErrCommitUnknown. So whenever a try says the claim is lost,
// PersistAnswer reads the key's row on db (idem_key, which writes nothing): completed with this
// attempt means the answer is stored, and PersistAnswer returns nil; any other finding keeps
// ErrClaimLost. When a try's reply was lost, the read is tried again until one answers, until
// ctx ends and a moment past it, and no answer is an error of its own (the outcome is
// unknown). When every try was answered, the read gets a second of its own, and no answer
// keeps ErrClaimLost.
func PersistAnswer(ctx context.Context, q Querier, db Querier, c Claim, attempt int64, r Response) error {
	unknown := false
	err := Persist(ctx, func(ctx context.Context) error {
		err := Complete(ctx, q, c.Principal, c.Key, attempt, r)
		var pgErr *pgconn.PgError
		if err != nil && !errors.As(err, &pgErr) && (!pgconn.SafeToRetry(err) || lostReply(err)) {
			unknown = true
		}
		return err
	})
	if errors.Is(err, ErrClaimLost) && !unknown {
		// Every try was answered, the last saying that the claim is not in progress with this
		// attempt: taken over or released, or completed with it by an earlier Complete of the
		// caller's whose outcome was unknown (ErrCommitUnknown, a process that died waiting).
		// One read tells, bounded on its own (ctx may have ended): a moment, as past the
		// deadline below. A read that gets no answer leaves the try's ErrClaimLost.
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), answerReadGrace)
		defer cancel()
		if landed, _ := answered(rctx, db, c, attempt); landed {
			return nil
		}
		return err
	}
	if errors.Is(err, ErrClaimLost) {
		landed, rerr := answered(ctx, db, c, attempt)
		if landed {
			return nil
		}
		if rerr == nil {
			return err // a read answered: not completed with this attempt, and nothing can land now
		}
		if ctx.Err() == nil {
			// Nothing is known: not ErrClaimLost, which says another attempt holds the key
			// (the work would run again, under a new provider key once the key expired).
			return fmt.Errorf("idem: an answer's recording lost its reply, and whether it landed could not be read: %w (before: %v)", rerr, err)
		}
		// The deadline came first: the read below, allowed a moment past it, tells.
	}
	if err != nil && unknown && ctx.Err() != nil {
		// The deadline came while a try's outcome was unknown (abandoned, or its reply lost):
		// it may have landed since. A read, which stores nothing, is allowed a moment past
		// the deadline; an answer found is this one (D168).
		actx, cancel := context.WithTimeout(context.WithoutCancel(ctx), answerReadGrace)
		defer cancel()
		landed, rerr := answered(actx, db, c, attempt)
		if landed {
			return nil
		}
		if rerr != nil && errors.Is(err, ErrClaimLost) {
			return fmt.Errorf("idem: an answer's recording lost its reply, and whether it landed could not be read by the deadline: %w (before: %v)", rerr, err)
		}
	}
	return err
}

// answerReadGrace bounds PersistAnswer's read of the key's row where ctx may have ended.
const answerReadGrace = time.Second

// answered tells whether the answer of the claim c with this attempt is stored: the key's row
// is completed with this attempt (idem_key). A token is drawn for one claim only, and only that
// claim's completion completes a row with it. Read from the row, not from a replay: a completed
// key replays only until its answer's TTL has passed (D200), and a reply lost for longer than
// a short TTL made an answer that landed look lost (the work then ran again, under a new
// provider key). The read is tried again (Persist) until one gets an answer or ctx ends: a
// backend killed under it, or a lock on the key table past idem_key's lock timeout, made it
// "not stored" at its first failure. The error is the last try's when none got an answer.
func answered(ctx context.Context, db Querier, c Claim, attempt int64) (bool, error) {
	landed := false
	var denied error
	err := Persist(ctx, func(ctx context.Context) error {
		k, ok, err := ReadKey(ctx, db, c.Principal, c.Key)
		if errors.Is(err, ErrPermissionDenied) {
			denied = err // no try mends a missing grant
			return nil
		}
		if err != nil {
			return err
		}
		landed = ok && k.State == "completed" && k.Attempt == attempt
		return nil
	})
	if err == nil {
		err = denied
	}
	return landed && err == nil, err
}

// callOnExtend calls LeaseOptions.OnExtend, if set, and drops its panic: it runs on the
// heartbeat's goroutine, where a panic would end the process and with it every request in
// flight (their leases held until they run out), for a count.
func callOnExtend(f func()) {
	if f == nil {
		return
	}
	defer func() { _ = recover() }()
	f()
}

// extendSafely is Extend on the heartbeat's goroutine, with a panic of the code it runs (the
// application's pool: a pgx tracer, a hook, a Querier of its own) taken as a failed extension,
// which the next beat tries again: a panic there would end the process, every request in
// flight with it (D225).
func extendSafely(ctx context.Context, q Querier, principal, key string, attempt int64, lease time.Duration) (err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("idem: the lease's extension panicked: %v", p)
		}
	}()
	_, err = Extend(ctx, q, principal, key, attempt, lease)
	return err
}

package dbidem

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// TxOptions configure RunTx. The zero value is READ COMMITTED, 3 attempts, 10ms backoff.
type TxOptions struct {
	// TxOptions are pgx's: isolation level, access mode. Default READ COMMITTED, the level
	// the SQL API is designed for (it never raises 40001 there), whatever the role's or the
	// database's default_transaction_isolation.
	pgx.TxOptions
	// MaxAttempts is how many times the unit of work runs when it keeps failing with a
	// serialization failure (40001) or a deadlock (40P01). 0: 3 (DefaultMaxAttempts); 1
	// disables retries.
	MaxAttempts int
	// Backoff is the base wait before a retry; the n-th retry waits a random duration in
	// [0, Backoff·2^n). 0: 10ms (DefaultBackoff).
	Backoff time.Duration
}

// The defaults of TxOptions.
const (
	DefaultMaxAttempts = 3
	DefaultBackoff     = 10 * time.Millisecond
)

// Acquirer hands out connections: *pgxpool.Pool.
type Acquirer interface {
	Acquire(ctx context.Context) (*pgxpool.Conn, error)
}

// RunTx runs fn in a transaction and commits it when fn returns nil (with a pending
// completion or final answer, in the same round trip as COMMIT), or rolls it back when fn
// returns an error, which RunTx returns. When a statement of fn or the commit fails with
// 40001 or 40P01, or a statement of fn with a lock timeout (55P03), even one that fn handled,
// fn runs again in a new transaction, up to opts.MaxAttempts times; fn must therefore not
// keep state from a failed run (re-read a request body from its start, reset a response
// buffer). A fn that sends no statement costs no round trip.
func RunTx(ctx context.Context, db Acquirer, opts TxOptions, fn func(tx *Tx) error) error {
	return runTx(ctx, db, opts, 0, false, fn)
}

// runTx is RunTx; commitBound, when set, bounds the wait for COMMIT's reply (a step's): past
// it the COMMIT is abandoned, not canceled, and runTx returns ErrCommitUnknown (D168).
//
// lazy (a step's): the connection is acquired when fn first needs it (a statement, Conn),
// not before fn runs, so that a step whose fn calls outside the database first (a provider)
// holds no connection meanwhile; with a pool shared with that outside call, as many such
// steps as connections would otherwise each hold one and wait for another.
func runTx(ctx context.Context, db Acquirer, opts TxOptions, commitBound time.Duration, lazy bool, fn func(tx *Tx) error) error {
	attempts := opts.MaxAttempts
	if attempts <= 0 {
		attempts = DefaultMaxAttempts
	}
	backoff := opts.Backoff
	if backoff <= 0 {
		backoff = DefaultBackoff
	}
	var err error
	for n := 0; n < attempts; n++ {
		if n > 0 {
			wait := retryWait(backoff, n)
			select {
			case <-ctx.Done():
				return errors.Join(err, ctx.Err())
			case <-time.After(wait):
			}
		}
		var again bool
		again, err = runOnce(ctx, db, opts.TxOptions, commitBound, lazy, fn)
		if !again {
			return err
		}
	}
	return err
}

// retryWait is the wait before the n-th retry: a random duration in [0, backoff·2^n), n capped
// at 10, and the span at the longest a Duration holds (a Backoff of months would overflow the
// shift and panic in rand.Int64N).
func retryWait(backoff time.Duration, n int) time.Duration {
	k := min(n, 10)
	span := int64(backoff)
	if span > math.MaxInt64>>k {
		span = math.MaxInt64
	} else {
		span <<= k
	}
	return time.Duration(rand.Int64N(span))
}

// runOnce runs fn in one transaction; again tells whether the unit of work may run again (a
// statement of the work or the commit failed in a way a new transaction may not).
func runOnce(ctx context.Context, db Acquirer, txOpts pgx.TxOptions, commitBound time.Duration, lazy bool, fn func(tx *Tx) error) (again bool, err error) {
	if txOpts.IsoLevel == "" {
		// Said, not left to the role's or the database's default_transaction_isolation.
		txOpts.IsoLevel = pgx.ReadCommitted
	}
	t := &Tx{opts: txOpts, pool: db, poolCtx: ctx}
	if !lazy {
		if err := t.acquire(); err != nil {
			return false, err
		}
	} else if ctx.Err() != nil {
		// As an Acquire up front would: fn (and its outside call) does not run for a context
		// that ended already.
		return false, context.Cause(ctx)
	}
	// A connection whose rollback failed is closed by pgx, not reused: the pool checks the
	// transaction status when the connection comes back. A COMMIT still running when ctx
	// ends keeps it (commit) and releases it when the COMMIT returns.
	handedOff := false // the connection goes back with a COMMIT still running (below)
	defer func() {
		t.over.Store(true) // before the connection goes back: a kept Tx sends nothing on it
		if !handedOff && t.pooled != nil {
			t.pooled.Release()
		}
	}()
	defer func() {
		if r := recover(); r != nil {
			t.rollback(ctx)
			panic(r)
		}
	}()
	ferr := fn(t)
	if t.retry != nil {
		// A statement hit a serialization failure, a deadlock or a lock timeout; whatever fn
		// made of it (a 500, an error of its own), the transaction is lost: run fn again.
		ferr = t.retry
		if isLockTimeout(ferr) {
			ferr = fmt.Errorf("%w: %w", errWorkLockTimeout, ferr)
		}
	}
	if ferr == nil {
		ferr = t.ended() // the work ended the transaction itself: nothing to commit or answer
	}
	if ferr == nil {
		ferr = t.misuse // an answer to a claim this transaction does not hold: the work is a duplicate's
	}
	switch {
	case t.tx == nil:
		return false, ferr // nothing was sent
	case ferr != nil:
		t.rollback(ctx)
		return t.retry != nil, ferr
	}
	if t.decidedOnly() {
		// Nothing to commit: the decision read committed rows and wrote none. The COMMIT ends
		// the transaction; its failure, or a context that ended before it (a lease claim's
		// bound, passed while a large answer arrived), changes no outcome (D226).
		defer func() {
			if err != nil {
				again, err = false, nil
			}
		}()
	}
	if err := ctx.Err(); err != nil {
		// Nothing asks for the work any more: it is not committed.
		t.rollback(ctx)
		return false, context.Cause(ctx)
	}
	if commitBound > 0 {
		// A COMMIT whose connection stopped answering is given up after the bound; the
		// goroutine below abandons it without a cancel request (D168).
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeoutCause(ctx, commitBound, errNoReply)
		defer cancel()
		t.noStandbyWait = false
	}
	if ctx.Done() == nil || t.noStandbyWait {
		// Nothing can cancel it, or it cannot wait for a standby: a cancel request then
		// either stops it before it commits or finds it committed everywhere it will ever be
		// (D108, D136). Sent from this goroutine, as any statement.
		err = t.commit(ctx)
		return IsRetryable(err) || IsWorkLockTimeout(err), err
	}
	// A COMMIT that may wait for a synchronous standby (or whose claim did not say) runs in a
	// goroutine of its own, on a context that never ends, so that pgx never sends PostgreSQL a
	// cancel request for it. A COMMIT waiting for a synchronous standby that a cancel request
	// reaches stays committed on the primary alone and becomes visible there: a replay answers
	// it, and a failover before the standby has it loses an answered key (docs/DECISIONS.md,
	// D108). Closing the connection instead is no better: pgx sends a cancel request whenever
	// it closes a connection in the middle of a statement. So when ctx ends first, RunTx
	// returns ErrCommitUnknown at once, and the COMMIT goes on holding its connection, its
	// transaction invisible to every other session, until PostgreSQL answers it; then the
	// connection goes back to the pool. The goroutine's hand-offs cost about as much CPU as
	// the whole keyed part of a transaction (D136), hence the path above where it can.
	committed := make(chan error, 1)
	go func() {
		defer func() {
			if p := recover(); p != nil {
				// The application's pool code panicked on this goroutine of ours (D225): the
				// COMMIT may have gone out, so its outcome is unknown.
				committed <- fmt.Errorf("%w: the COMMIT's code panicked: %v", ErrCommitUnknown, p)
			}
		}()
		committed <- t.commit(context.WithoutCancel(ctx))
	}()
	select {
	case err = <-committed:
		return IsRetryable(err) || IsWorkLockTimeout(err), err
	case <-ctx.Done():
		handedOff = true
		go func() {
			defer func() { _ = recover() }() // the pool's release hook, on a goroutine of ours (D225)
			<-committed
			t.pooled.Release()
		}()
		return false, fmt.Errorf("%w: the context ended while COMMIT ran; it goes on, unseen, until PostgreSQL answers it: %w",
			ErrCommitUnknown, context.Cause(ctx))
	}
}

func (t *Tx) rollback(ctx context.Context) {
	if t.tx != nil {
		_ = t.tx.Rollback(context.WithoutCancel(ctx))
	}
}

// commit sends COMMIT, with the pending completion or final answer in the same round trip.
func (t *Tx) commit(ctx context.Context) error {
	// Whether the connection was whole before COMMIT went out: a "conn closed" afterwards is a
	// connection lost during the exchange (commitError).
	open := !t.tx.Conn().IsClosed()
	if t.end == nil {
		err := uncompletedCommitError(t.tx.Commit(ctx), open, t.attempt != 0 && t.claim.Lease == 0)
		if t.leaseUnit && IsWorkLockTimeout(err) {
			// A lease claim's own transaction, the claim and its COMMIT: no work ran in it, so
			// its deferred checks (an application's deferrable key on the key table, waiting on
			// a principal's row another transaction holds) are the claim's. Not a key in
			// progress (claiming again would meet them again): read as a claim's INSERT that
			// meets such a lock is, a busy store (D151).
			var pgErr *pgconn.PgError
			errors.As(err, &pgErr)
			return fmt.Errorf("%w: %w", ErrStoreBusy, pgErr)
		}
		return err
	}
	b := &pgx.Batch{}
	if !t.final && t.tx.Conn().PgConn().TxStatus() == 'E' {
		// A statement of the work failed and the work returned nil all the same: the
		// transaction is aborted, and its COMMIT would roll back. Not sent with the completion,
		// whose preparation the aborted transaction would refuse (25P02, a raw error): nothing
		// is committed, as a COMMIT that rolls back says.
		t.rollback(ctx)
		return pgx.ErrTxCommitRollback
	}
	if t.final {
		if t.tx.Conn().PgConn().TxStatus() == 'E' {
			// A statement of the work failed (a unique violation answered 409, say): the
			// transaction is aborted until the rollback to the claim's savepoint. In pgx's
			// default mode a batch prepares its new statements before it runs any, and a
			// preparation inside the aborted transaction is refused (25P02). So the rollback
			// goes first, on its own round trip, on this path only.
			if _, err := t.tx.Exec(ctx, rollbackToClaimSQL); err != nil {
				var pgErr *pgconn.PgError
				if errors.As(err, &pgErr) && !fatal(pgErr) {
					t.rollback(ctx)
					if gone := savepointGone(err); gone != nil {
						return gone
					}
					return classify(err)
				}
				return commitError(err, false) // no COMMIT was sent: the transaction is gone
			}
		} else {
			b.Queue(rollbackToClaimSQL)
		}
		b.Queue(saveFinalSQL, t.end...)
	} else {
		b.Queue(CompleteSQL, t.end...)
	}
	var tag pgconn.CommandTag
	b.Queue("COMMIT").Exec(func(ct pgconn.CommandTag) error { tag = ct; return nil })
	if err := t.tx.SendBatch(ctx, b).Close(); err != nil {
		var pgErr *pgconn.PgError
		if isLockTimeout(err) {
			// The COMMIT's deferred checks of the work (the completion waits on nothing: the
			// key's row is this transaction's own).
			t.rollback(ctx)
			return fmt.Errorf("%w: %w", errWorkLockTimeout, err)
		}
		if errors.As(err, &pgErr) && !fatal(pgErr) && !isCitusCommitFailure(pgErr) {
			// A statement before COMMIT failed; the server skipped the COMMIT.
			t.rollback(ctx)
			if gone := savepointGone(err); t.final && gone != nil {
				return gone
			}
			cerr := classify(err)
			if t.claim != nil && t.claim.Lease == 0 && errors.Is(cerr, ErrClaimLost) {
				// A transactional claim is this transaction's own row, which nothing else can
				// change: the work ended the transaction and went on in a new one (ROLLBACK AND
				// CHAIN as SQL), and the claim rolled back with the first.
				return fmt.Errorf("%w: the claim's transaction ended before its answer (the work sent ROLLBACK AND CHAIN?): %w", ErrTxOwned, err)
			}
			return cerr
		}
		return commitError(err, open)
	}
	if tag.String() == "ROLLBACK" {
		return pgx.ErrTxCommitRollback
	}
	return nil
}

// savepointGone is ErrTxOwned for the claim's savepoint found missing (3B001) when a final
// answer rolls back to it: the work ended the claim's transaction and began another (ROLLBACK;
// BEGIN as SQL in one statement), or released the savepoint, and the claim went with the first.
// Not the store failing: nothing of the work or the claim was committed. Nil for another error.
func savepointGone(err error) error {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "3B001" {
		return fmt.Errorf("%w: the claim's savepoint is gone (the work ended its transaction, or released or rolled back past "+
			"the savepoint, as SQL): %w", ErrTxOwned, err)
	}
	return nil
}

// uncompletedCommitError classifies the failure of a COMMIT that carried no completion. When
// the transaction holds a transactional claim (uncompleted), Citus' report that a worker could
// not commit its shard is the commit guard's refusal: on one worker the coordinator commits
// with one phase, and the worker's 23503 arrives only as a WARNING before the error. Such a
// worker transaction can never commit (the guard refuses it whatever else happens), so the
// outcome is known. Otherwise the error goes to commitError.
func uncompletedCommitError(err error, open, uncompleted bool) error {
	var pgErr *pgconn.PgError
	if uncompleted && errors.As(err, &pgErr) && isCitusCommitFailure(pgErr) {
		return fmt.Errorf("%w: %w", ErrClaimNotCompleted, err)
	}
	return commitError(err, open)
}

// commitError tells a refused commit (an ERROR from PostgreSQL: nothing committed, or a
// failure before anything was sent) from a connection lost after COMMIT was sent, or ended
// by a FATAL error, whose outcome the client cannot know (ErrCommitUnknown). open tells that
// the connection was whole when COMMIT was sent.
//
// pgx's SafeToRetry ("nothing was sent") is not trusted for "conn closed" on a connection that
// was open: pgx v5 drops the read error of a reply lost after the statements went out (a
// network cut, a proxy's restart) and reports the closed connection instead, as
// pgconn.ErrConnClosed with SafeToRetry true, although the COMMIT may have run (D163).
func commitError(err error, open bool) error {
	if err == nil {
		return nil
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && isCitusCommitFailure(pgErr) {
		// Citus sent the COMMIT of a transaction on one worker to that worker (one-phase) and
		// did not hear that it committed: the worker refused it (a deferred constraint of the
		// work), or the connection to the worker failed while it committed, after which the
		// worker's transaction may well have committed (D175). The error is the same.
		return fmt.Errorf("%w: %w", ErrCommitUnknown, err)
	}
	if isLockTimeout(err) {
		// A lock timeout at COMMIT is the work's: a deferred constraint or trigger waited on a
		// row another transaction holds (the key's row is this transaction's own). Not a key in
		// progress, nor a locked key table; run again as a statement's lock timeout is.
		return fmt.Errorf("%w: %w", errWorkLockTimeout, err)
	}
	if errors.As(err, &pgErr) && !fatal(pgErr) {
		return classify(err)
	}
	if errors.Is(err, pgx.ErrTxCommitRollback) {
		// PostgreSQL answered the COMMIT with ROLLBACK: the work left its transaction failed
		// (an error it did not act on). Nothing committed; the outcome is known.
		return err
	}
	if pgconn.SafeToRetry(err) && !(open && lostReply(err)) {
		return classify(err)
	}
	return fmt.Errorf("%w: %w", ErrCommitUnknown, err)
}

// errWorkLockTimeout marks a unit of work that failed on a lock timeout of its own: a statement
// of the work (after its runs again), or its COMMIT's deferred constraints or triggers.
var errWorkLockTimeout = errors.New("idem: the work waited too long for a lock (its statements, or its COMMIT's deferred checks)")

// IsWorkLockTimeout tells whether err is a unit of work's own lock timeout, in its statements
// or its COMMIT's deferred checks: the work's failure, not the store's, run again up to the
// unit's attempts.
func IsWorkLockTimeout(err error) bool { return errors.Is(err, errWorkLockTimeout) }

// lostReply tells whether err may be a reply lost after a statement was sent: pgx reports the
// connection it closed on a failed read as pgconn.ErrConnClosed, marked safe to retry (commitError).
func lostReply(err error) bool { return errors.Is(err, pgconn.ErrConnClosed) }

// fatal tells whether a PostgreSQL error ended the session (FATAL, PANIC).
func fatal(e *pgconn.PgError) bool {
	s := e.SeverityUnlocalized
	if s == "" {
		s = e.Severity
	}
	return s == "FATAL" || s == "PANIC"
}

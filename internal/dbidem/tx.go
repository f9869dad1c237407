package dbidem

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// claimSavepoint is taken right after idem_begin, in the same round trip: a final error rolls
// the work back to it and keeps the claim, so the answer is stored in the same transaction.
// Its name ends in 64 random bits drawn when the process starts, so no savepoint of a
// handler can share it: ROLLBACK TO SAVEPOINT goes to the newest savepoint of a name, and a
// handler's own "idem_claim" would otherwise have kept the work before it under a stored
// final answer.
var (
	claimSavepoint     = "idem_claim_" + randomHex(8)
	savepointSQL       = "SAVEPOINT " + claimSavepoint
	rollbackToClaimSQL = "ROLLBACK TO SAVEPOINT " + claimSavepoint
)

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// ErrTxOwned is returned by Tx.Commit and Tx.Rollback: RunTx ends the transaction when the
// function returns (nil commits, an error rolls back). Nested transactions (Tx.Begin) are
// committed and rolled back as usual.
var ErrTxOwned = errors.New("idem: the transaction is RunTx's: return from the function to end it")

// Tx is the transaction of a unit of work run by RunTx. It is a pgx.Tx: write the work
// through it. BEGIN is sent with the first statement that needs it: with the claim (Claim),
// or before the first statement of the work. Every statement is watched for serialization
// failures and deadlocks, which make RunTx run the unit again.
type Tx struct {
	conn    *pgx.Conn // nil until acquired (a step's transaction acquires it when first needed)
	pooled  *pgxpool.Conn
	pool    Acquirer
	poolCtx context.Context // the context the connection is acquired on: RunTx's
	opts    pgx.TxOptions
	tx      pgx.Tx // nil until BEGIN has been sent
	claim   *Claim
	attempt int64
	end     []any // the arguments of idem_complete (complete) or idem_save_final (final)
	final   bool
	// outcome is the outcome of Claim's decision; misuse, an answer given to a
	// claim whose outcome was not Claimed, or with no Claim before it (unclaimed), which RunTx
	// returns, rolled back.
	outcome Outcome
	misuse  error
	// claimErr: the error of a Claim that failed (none is held), which an answer given after
	// it names
	claimErr error
	retry    error // the first serialization failure or deadlock a statement hit
	// dropped: a statement of the work failed because the database dropped the connection
	// (IsUnavailable: a FATAL of the server, a network error; not a context that ended)
	dropped atomic.Bool
	// noStandbyWait: the claim's statement found that this transaction's COMMIT cannot wait
	// for a synchronous standby (standbyWaitColumn), so RunTx may send it on its caller's
	// context.
	noStandbyWait bool
	// leaseUnit: the transaction is a lease claim's own, the claim and its COMMIT with nothing
	// between (the Gate's units for a lease route and DoLease), so the server may end it once
	// idle (leaseClaimIdleSQL). A lease claim in a caller's transaction (Tx.Claim in RunTx,
	// with the caller's statements around it) is not: its idle time is the caller's.
	leaseUnit bool
	// bounded, in a lease claim's unit (the Gate's), bounds one statement fn sends (Bounded):
	// the unit's bound, deferring to the statement's own. nil elsewhere.
	bounded func(wait time.Duration) (context.Context, context.CancelFunc)
	// claimOnly: the claim's round trip began the transaction, and nothing was sent through
	// the Tx since (a statement, a savepoint, Conn handed out): a claim whose outcome was not
	// Claimed leaves such a transaction nothing to commit (decidedOnly).
	claimOnly bool
	// claimBegan: the claim's round trip began the transaction (Redecided restores claimOnly
	// from it).
	claimBegan bool
	// over: the unit of work has ended (committed or rolled back, its connection given back);
	// a Tx kept past it (a goroutine of the handler's) refuses every statement, and Conn is nil.
	over atomic.Bool
}

var _ pgx.Tx = (*Tx)(nil)

// Bounded returns the context for one statement that a Gate unit's fn sends on tx before it
// returns, and the function to call once the statement has returned. wait is the longest the
// statement may wait on a lock (a claim's lock timeout; 0 for one that waits on none). In a
// lease claim's unit, which is bounded as a whole (Gate.RunDetached), it is the unit's context
// with a bound of the statement's own, wait plus ClaimReplyMargin from now (longer while its
// reply is arriving), which the unit's bound waits for; a statement given up there closes its
// connection and ends the unit, whose error IsNoReply reports. Elsewhere it is ctx: a
// transactional unit's work has its caller's deadline.
func (t *Tx) Bounded(ctx context.Context, wait time.Duration) (context.Context, context.CancelFunc) {
	if t.bounded != nil {
		return t.bounded(wait)
	}
	return context.WithCancel(ctx)
}

// acquire takes the transaction's connection from the pool unless it has one, until the unit
// of work is over (pgx.ErrTxClosed).
func (t *Tx) acquire() error {
	if t.over.Load() {
		return pgx.ErrTxClosed
	}
	if t.conn != nil {
		return nil
	}
	c, err := t.pool.Acquire(t.poolCtx)
	if err != nil {
		return err
	}
	t.pooled, t.conn = c, c.Conn()
	return nil
}

// begin sends BEGIN unless it was sent. Once sent, it refuses every further statement of a
// transaction that a statement sent through it ended (ended).
func (t *Tx) begin(ctx context.Context) error {
	t.claimOnly = false
	if t.tx != nil {
		return t.ended()
	}
	if err := t.acquire(); err != nil {
		return err
	}
	tx, err := t.conn.BeginTx(ctx, t.opts)
	if err != nil {
		return err
	}
	t.tx = tx
	return nil
}

// ended is ErrTxOwned when the connection has left the transaction: a COMMIT, ROLLBACK, END or
// ABORT sent through it as SQL (pgx's Tx does not see it; its own Commit and Rollback are
// refused, ErrTxOwned). A statement after it would run outside the claim's transaction, each
// one committed at once, and the claim gone with its transaction (a COMMIT of a transactional
// claim without its answer is refused and rolls back): RunTx's retry would do the work again
// beside the first's committed statements.
func (t *Tx) ended() error {
	if t.over.Load() {
		return pgx.ErrTxClosed // the unit of work is over: its connection may be another's now
	}
	if t.tx != nil && t.conn.PgConn().TxStatus() == 'I' {
		return fmt.Errorf("%w: a statement sent through it ended the transaction (COMMIT, ROLLBACK, END or ABORT as SQL); "+
			"nothing more is sent in it", ErrTxOwned)
	}
	return nil
}

// ConnLost tells whether the database dropped the transaction's connection under the work: a
// statement of it failed with a FATAL error of the server (a backend terminated, the server
// shutting down) or a network error, and the connection is closed. A statement that a context
// ended (the work's, or one of the handler's own, which pgx answers by closing the connection
// too) does not count, nor a connection the work closed itself: those are the work's doing,
// not the database's. The middleware counts a 5xx after it as the store's failure.
func (t *Tx) ConnLost() bool { return t.dropped.Load() && t.conn != nil && t.conn.IsClosed() }

// note remembers an error of the work after which the unit of work runs again: a
// serialization failure or a deadlock (IsRetryable), or a lock timeout (55P03) of one of the
// work's own statements. The work's code usually answers it with a failure of its own (a
// 500), but the transaction is lost and a new one may well succeed.
func (t *Tx) note(err error) {
	if err != nil && t.retry == nil && (IsRetryable(err) || isLockTimeout(err)) {
		t.retry = err
	}
	// Not pgx's "conn closed": a statement sent on a connection closed already (by a
	// statement before it, whose own error told why; or by the work itself).
	if err != nil && IsUnavailable(err) && !errors.Is(err, pgconn.ErrConnClosed) {
		t.dropped.Store(true)
	}
}

func isLockTimeout(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "55P03"
}

// readStepsKey marks a context whose transactional claims read their generation's steps too
// (withReadSteps).
type readStepsKey struct{}

// withReadSteps returns ctx marked so that Tx.Claim of a transactional claim reads the steps its
// generation recorded (idem_begin_steps), as a lease claim always does: Do, which must not run
// again the steps of a lease it takes over.
func withReadSteps(ctx context.Context) context.Context {
	return context.WithValue(ctx, readStepsKey{}, true)
}

// Claim calls idem_begin for c in this transaction, sending BEGIN (if not sent yet),
// idem_begin and a savepoint in one round trip. One claim per transaction. With a
// transactional claim (Lease 0) that is Claimed, end the work with CompleteOnCommit or
// FinalOnCommit; a claim returned without either makes the COMMIT fail (ErrClaimNotCompleted).
func (t *Tx) Claim(ctx context.Context, c Claim) (Decision, error) {
	d, err := t.claimOnce(ctx, c)
	if err != nil && t.claim == nil && t.claimErr == nil {
		t.claimErr = err // an answer given next names it (the first: a later one is its echo, 25P02)
	}
	return d, err
}

// claimOnce is Claim.
func (t *Tx) claimOnce(ctx context.Context, c Claim) (Decision, error) {
	if t.claim != nil {
		return Decision{}, errors.New("idem: Tx.Claim called twice in one transaction")
	}
	if err := t.acquire(); err != nil {
		return Decision{}, err
	}
	if t.tx != nil {
		// A statement sent through the Tx may have ended its transaction (COMMIT as SQL): the
		// claim would run outside it (ErrTxOwned, as every other statement is refused).
		if err := t.ended(); err != nil {
			return Decision{}, err
		}
	}
	b := &pgx.Batch{}
	if t.tx == nil {
		b.BeginTx(t.opts)
	}
	if c.Lease != 0 && t.leaseUnit && t.tx == nil {
		// A lease claim's own transaction (the claim, then COMMIT): the server ends it if it
		// stays idle, so that a connection lost between the two does not hold the key's row
		// until the server's TCP stack notices (D168).
		b.Queue(leaseClaimIdleSQL)
	}
	var row decisionRow
	row.d.Sent = time.Now()
	var standbyWait bool
	c.queueTxBegin(b, t.conn, ctx.Value(readStepsKey{}) != nil, &row, &standbyWait)
	b.Queue(savepointSQL)
	var br pgx.BatchResults
	began := t.tx == nil
	if began {
		br = t.conn.SendBatch(ctx, b)
		t.tx = br.Tx()
	} else {
		br = t.tx.SendBatch(ctx, b)
	}
	if err := br.Close(); err != nil {
		if IsRetryable(err) { // not its lock timeout: that is ErrInProgress, the Gate's to answer
			t.note(err)
		}
		return Decision{}, claimError(ctx, err)
	}
	d, err := row.decision()
	if err != nil {
		return Decision{}, err
	}
	t.claim = &c
	t.outcome = d.Outcome
	t.claimOnly, t.claimBegan = began, began
	t.noStandbyWait = !standbyWait
	if d.Outcome == Claimed {
		t.attempt = d.Attempt
	}
	return d, nil
}

// Redecided makes d, the decision for claim c, this transaction's in place of Claim's: after
// Claim, the caller asked the key again through the Tx under a savepoint (idem_begin with
// another fingerprint: the middleware's claim under an earlier release's, D178), and rolled
// back to that savepoint whatever it did not keep. Those statements then count as the
// claim's, not as the work's: a decision that is not Claimed leaves the transaction nothing to
// commit, as Claim's would (decidedOnly), and an answer given on commit is c's. Only for
// statements that wrote nothing else.
func (t *Tx) Redecided(c Claim, d Decision) {
	t.claim, t.outcome = &c, d.Outcome
	if d.Outcome == Claimed {
		t.attempt = d.Attempt
	}
	t.claimOnly = t.claimBegan
}

// decidedOnly tells that the transaction holds nothing but a claim that decided without
// writing (a replay, a mismatch, a lease in progress: idem_begin writes only when it claims):
// the decision was read from committed rows, and the transaction's COMMIT changes nothing.
// Whatever becomes of that COMMIT (the server ended the connection as idle in transaction
// while a large replay was still on its way to the client; a COMMIT black-holed), the decision
// stands (D226).
func (t *Tx) decidedOnly() bool {
	return t.claimOnly && t.claim != nil && t.outcome != Claimed && t.end == nil && t.misuse == nil && t.retry == nil
}

// unclaimed is the error of an answer given to a claim whose outcome was not Claimed (a
// replay, a mismatch, a lease in progress): this transaction holds no claim to answer, and its
// work is a duplicate's; or given with no Claim before it. RunTx rolls back and returns it.
func (t *Tx) unclaimed(method string) error {
	if t.claim == nil && t.claimErr != nil {
		// The claim's failure is the story (ErrInProgress, a store that failed), and what a
		// caller's retry decides on; the answer could not be stored either way.
		return fmt.Errorf("idem: %s after a Tx.Claim that failed, so there is no claim to answer: %w", method, t.claimErr)
	}
	if t.claim == nil {
		// No Tx.Claim in this transaction (yet): the answer would be stored nowhere, and a retry
		// would run the work again.
		return fmt.Errorf("%w: %s without a Tx.Claim before it in this transaction: there is no claim to answer "+
			"(claim the key first)", ErrInvalidArgument, method)
	}
	return fmt.Errorf("%w: %s after Tx.Claim's outcome %s: this transaction holds no claim to answer "+
		"(answer with the Decision's stored response instead, and return without the work)", ErrClaimLost, method, t.outcome)
}

// CompleteOnCommit stores r as the response of this transaction's claim when it commits, in
// the same round trip as COMMIT. If the claim was lost (ErrClaimLost), RunTx rolls back and
// returns the error. After a Claim whose outcome was not Claimed (a replay, a mismatch, a lease
// in progress) the transaction holds no claim to answer: RunTx rolls back and returns an error
// wrapping ErrClaimLost. Without a Claim before it in the transaction, RunTx rolls back and
// returns an error wrapping ErrInvalidArgument (the answer would be stored nowhere), or, after
// a Claim that failed, that Claim's error.
func (t *Tx) CompleteOnCommit(r Response) {
	if t.claim == nil {
		t.misuse = t.unclaimed("CompleteOnCommit")
		return
	}
	if t.outcome != Claimed {
		t.misuse = t.unclaimed("CompleteOnCommit")
		return
	}
	t.end, t.final = completeArgs(t.claim.Principal, t.claim.Key, t.attempt, r), false
}

// FinalOnCommit stores r as the final answer to this transaction's claim (a 404, a 422):
// when the function returns, RunTx rolls the work back to the savepoint taken right after
// the claim, stores r with idem_save_final and commits, in one round trip. The claim is held
// throughout, so a duplicate waiting on the key sees only the stored answer. After a Claim
// whose outcome was not Claimed, RunTx rolls back and returns an error wrapping ErrClaimLost,
// as CompleteOnCommit does, and without a Claim before it an error wrapping ErrInvalidArgument
// (after a Claim that failed, that Claim's error).
func (t *Tx) FinalOnCommit(r Response) {
	if t.claim == nil {
		t.misuse = t.unclaimed("FinalOnCommit")
		return
	}
	if t.outcome != Claimed {
		t.misuse = t.unclaimed("FinalOnCommit")
		return
	}
	t.end, t.final = saveFinalArgs(*t.claim, r), true
}

// Begin starts a nested transaction (a savepoint), as pgx.Tx does.
func (t *Tx) Begin(ctx context.Context) (pgx.Tx, error) {
	if err := t.begin(ctx); err != nil {
		return nil, err
	}
	nested, err := t.tx.Begin(ctx)
	t.note(err)
	if err != nil {
		return nil, err
	}
	return &nestedTx{Tx: nested, owner: t}, nil
}

// Commit returns ErrTxOwned: RunTx commits when the function returns nil.
func (t *Tx) Commit(context.Context) error { return ErrTxOwned }

// Rollback returns ErrTxOwned: RunTx rolls back when the function returns an error.
func (t *Tx) Rollback(context.Context) error { return ErrTxOwned }

// Exec runs a statement in the transaction.
func (t *Tx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	if err := t.begin(ctx); err != nil {
		return pgconn.CommandTag{}, err
	}
	return execNoted(ctx, t.tx, t, sql, args)
}

// Query runs a query in the transaction.
func (t *Tx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	if err := t.begin(ctx); err != nil {
		return nil, err
	}
	return queryNoted(ctx, t.tx, t, sql, args)
}

// QueryRow runs a query that returns at most one row in the transaction.
func (t *Tx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	rows, err := t.Query(ctx, sql, args...)
	return &notedRow{rows: rows, err: err}
}

// SendBatch sends a batch in the transaction.
func (t *Tx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	if err := t.begin(ctx); err != nil {
		return pgx.FailedBatchResults(b, err)
	}
	return &notedBatch{BatchResults: t.tx.SendBatch(ctx, b), owner: t}
}

// CopyFrom copies rows into a table in the transaction.
func (t *Tx) CopyFrom(ctx context.Context, table pgx.Identifier, columns []string, src pgx.CopyFromSource) (int64, error) {
	if err := t.begin(ctx); err != nil {
		return 0, err
	}
	n, err := t.tx.CopyFrom(ctx, table, columns, src)
	t.note(err)
	return n, err
}

// Prepare prepares a statement on the transaction's connection (pgx.ErrTxClosed once the unit
// of work is over).
func (t *Tx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	if err := t.acquire(); err != nil {
		return nil, err
	}
	return t.conn.Prepare(ctx, name, sql)
}

// LargeObjects returns the large objects of the transaction (BEGIN is sent first, if it
// was not).
func (t *Tx) LargeObjects() pgx.LargeObjects {
	if err := t.begin(context.Background()); err != nil {
		b := &pgx.Batch{}
		b.BeginTx(pgx.TxOptions{})
		return pgx.FailedBatchResults(b, err).Tx().LargeObjects() // every call fails with ErrTxClosed
	}
	return t.tx.LargeObjects()
}

// Conn returns the transaction's connection. A step's transaction acquires it here if no
// statement did yet, on the step's context as its statements do: nil when none could be had
// (the step's context ended, the pool closed), and once the unit of work is over. Statements
// sent through it before the transaction's first statement (BEGIN goes with that) run outside
// the transaction.
func (t *Tx) Conn() *pgx.Conn {
	t.claimOnly = false // what is sent through it is not seen
	if t.acquire() != nil {
		return nil
	}
	return t.conn
}

package dbidem

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// claimSavepoint is taken right after idem_begin, in the same round trip: a final error rolls
// the work back to it and keeps the claim, so the answer is stored in the same transaction.
const claimSavepoint = "idem_claim"

// ErrTxOwned is returned by Tx.Commit and Tx.Rollback: RunTx ends the transaction when the
// function returns (nil commits, an error rolls back). Nested transactions (Tx.Begin) are
// committed and rolled back as usual.
var ErrTxOwned = errors.New("dbidem: the transaction is RunTx's: return from the function to end it")

// Tx is the transaction of a unit of work run by RunTx. It is a pgx.Tx: write the work
// through it. BEGIN is sent with the first statement that needs it: with the claim (Claim),
// or before the first statement of the work. Every statement is watched for serialization
// failures and deadlocks, which make RunTx run the unit again.
type Tx struct {
	conn    *pgx.Conn
	opts    pgx.TxOptions
	tx      pgx.Tx // nil until BEGIN has been sent
	claim   *Claim
	attempt int64
	end     []any // the arguments of idem_complete (complete) or idem_save_final (final)
	final   bool
	retry   error // the first serialization failure or deadlock a statement hit
}

var _ pgx.Tx = (*Tx)(nil)

// begin sends BEGIN unless it was sent.
func (t *Tx) begin(ctx context.Context) error {
	if t.tx != nil {
		return nil
	}
	tx, err := t.conn.BeginTx(ctx, t.opts)
	if err != nil {
		return err
	}
	t.tx = tx
	return nil
}

// note remembers a retryable error: the work's code usually answers it with a failure of
// its own, but the unit of work should run again instead.
func (t *Tx) note(err error) {
	if err != nil && t.retry == nil && IsRetryable(err) {
		t.retry = err
	}
}

// Claim calls idem_begin for c in this transaction, sending BEGIN (if not sent yet),
// idem_begin and a savepoint in one round trip. One claim per transaction. With a
// transactional claim (Lease 0) that is Claimed, end the work with CompleteOnCommit or
// FinalOnCommit; a claim returned without either makes the COMMIT fail (ErrClaimNotCompleted).
func (t *Tx) Claim(ctx context.Context, c Claim) (Decision, error) {
	if t.claim != nil {
		return Decision{}, errors.New("dbidem: Tx.Claim called twice in one transaction")
	}
	b := &pgx.Batch{}
	if t.tx == nil {
		b.BeginTx(t.opts)
	}
	var row decisionRow
	b.Queue(beginSQL, c.beginArgs()...).QueryRow(func(r pgx.Row) error { return r.Scan(row.dest()...) })
	b.Queue("SAVEPOINT " + claimSavepoint)
	var br pgx.BatchResults
	if t.tx == nil {
		br = t.conn.SendBatch(ctx, b)
		t.tx = br.Tx()
	} else {
		br = t.tx.SendBatch(ctx, b)
	}
	if err := br.Close(); err != nil {
		t.note(err)
		return Decision{}, classify(err)
	}
	d, err := row.decision()
	if err != nil {
		return Decision{}, err
	}
	t.claim = &c
	if d.Outcome == Claimed {
		t.attempt = d.Attempt
	}
	return d, nil
}

// CompleteOnCommit stores r as the response of this transaction's claim when it commits, in
// the same round trip as COMMIT. If the claim was lost (ErrClaimLost), RunTx rolls back and
// returns the error.
func (t *Tx) CompleteOnCommit(r Response) {
	if t.claim == nil {
		return
	}
	t.end, t.final = completeArgs(t.claim.Principal, t.claim.Key, t.attempt, r), false
}

// FinalOnCommit stores r as the final answer to this transaction's claim (a 404, a 422):
// when the function returns, RunTx rolls the work back to the savepoint taken right after
// the claim, stores r with idem_save_final and commits, in one round trip. The claim is held
// throughout, so a duplicate waiting on the key sees only the stored answer.
func (t *Tx) FinalOnCommit(r Response) {
	if t.claim == nil {
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

// Prepare prepares a statement on the transaction's connection.
func (t *Tx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
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

// Conn returns the transaction's connection.
func (t *Tx) Conn() *pgx.Conn { return t.conn }

// nestedTx is a savepoint of a Tx: its statements are watched too.
type nestedTx struct {
	pgx.Tx
	owner *Tx
}

func (n *nestedTx) Begin(ctx context.Context) (pgx.Tx, error) {
	nested, err := n.Tx.Begin(ctx)
	n.owner.note(err)
	if err != nil {
		return nil, err
	}
	return &nestedTx{Tx: nested, owner: n.owner}, nil
}

func (n *nestedTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	return execNoted(ctx, n.Tx, n.owner, sql, args)
}

func (n *nestedTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	return queryNoted(ctx, n.Tx, n.owner, sql, args)
}

func (n *nestedTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	rows, err := n.Query(ctx, sql, args...)
	return &notedRow{rows: rows, err: err}
}

func (n *nestedTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	return &notedBatch{BatchResults: n.Tx.SendBatch(ctx, b), owner: n.owner}
}

func (n *nestedTx) CopyFrom(ctx context.Context, table pgx.Identifier, columns []string, src pgx.CopyFromSource) (int64, error) {
	c, err := n.Tx.CopyFrom(ctx, table, columns, src)
	n.owner.note(err)
	return c, err
}

func execNoted(ctx context.Context, q pgx.Tx, owner *Tx, sql string, args []any) (pgconn.CommandTag, error) {
	tag, err := q.Exec(ctx, sql, args...)
	owner.note(err)
	return tag, err
}

func queryNoted(ctx context.Context, q pgx.Tx, owner *Tx, sql string, args []any) (pgx.Rows, error) {
	rows, err := q.Query(ctx, sql, args...)
	owner.note(err)
	if err != nil {
		return rows, err
	}
	return &notedRows{Rows: rows, owner: owner}, nil
}

// notedRows notes the error that ends the rows.
type notedRows struct {
	pgx.Rows
	owner *Tx
}

func (r *notedRows) Err() error {
	err := r.Rows.Err()
	r.owner.note(err)
	return err
}

// notedRow behaves as pgx's Row: the first row, pgx.ErrNoRows when there is none.
type notedRow struct {
	rows pgx.Rows
	err  error
}

func (r *notedRow) Scan(dest ...any) error {
	if r.err != nil {
		return r.err
	}
	defer r.rows.Close()
	if !r.rows.Next() {
		if err := r.rows.Err(); err != nil {
			return err
		}
		return pgx.ErrNoRows
	}
	if err := r.rows.Scan(dest...); err != nil {
		return err
	}
	r.rows.Close()
	return r.rows.Err()
}

// notedBatch notes retryable errors from a batch's results.
type notedBatch struct {
	pgx.BatchResults
	owner *Tx
}

func (b *notedBatch) Exec() (pgconn.CommandTag, error) {
	tag, err := b.BatchResults.Exec()
	b.owner.note(err)
	return tag, err
}

func (b *notedBatch) Query() (pgx.Rows, error) {
	rows, err := b.BatchResults.Query()
	b.owner.note(err)
	if err != nil {
		return rows, err
	}
	return &notedRows{Rows: rows, owner: b.owner}, nil
}

func (b *notedBatch) QueryRow() pgx.Row {
	return &notedBatchRow{Row: b.BatchResults.QueryRow(), owner: b.owner}
}

func (b *notedBatch) Close() error {
	err := b.BatchResults.Close()
	b.owner.note(err)
	return err
}

type notedBatchRow struct {
	pgx.Row
	owner *Tx
}

func (r *notedBatchRow) Scan(dest ...any) error {
	err := r.Row.Scan(dest...)
	r.owner.note(err)
	return err
}

// TxOptions configure RunTx. The zero value is READ COMMITTED, 3 attempts, 10ms backoff.
type TxOptions struct {
	// TxOptions are pgx's: isolation level, access mode. Default READ COMMITTED, the level
	// the SQL API is designed for (it never raises 40001 there).
	pgx.TxOptions
	// MaxAttempts is how many times the unit of work runs when it keeps failing with a
	// serialization failure (40001) or a deadlock (40P01). 0: DefaultMaxAttempts; 1
	// disables retries.
	MaxAttempts int
	// Backoff is the base wait before a retry; the n-th retry waits a random duration in
	// [0, Backoff·2^n). 0: DefaultBackoff.
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
// 40001 or 40P01 (even one that fn handled), fn runs again in a new transaction, up to
// opts.MaxAttempts times; fn must therefore not keep state from a failed run (re-read a
// request body from its start, reset a response buffer). A fn that sends no statement costs
// no round trip.
func RunTx(ctx context.Context, db Acquirer, opts TxOptions, fn func(tx *Tx) error) error {
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
			wait := time.Duration(rand.Int64N(int64(backoff) << min(n, 10)))
			select {
			case <-ctx.Done():
				return errors.Join(err, ctx.Err())
			case <-time.After(wait):
			}
		}
		err = runOnce(ctx, db, opts.TxOptions, fn)
		if !IsRetryable(err) {
			return err
		}
	}
	return err
}

func runOnce(ctx context.Context, db Acquirer, txOpts pgx.TxOptions, fn func(tx *Tx) error) error {
	conn, err := db.Acquire(ctx)
	if err != nil {
		return err
	}
	// A connection whose rollback failed is closed by pgx, not reused: the pool checks the
	// transaction status when the connection comes back.
	defer conn.Release()
	t := &Tx{conn: conn.Conn(), opts: txOpts}
	defer func() {
		if r := recover(); r != nil {
			t.rollback(ctx)
			panic(r)
		}
	}()
	ferr := fn(t)
	if t.retry != nil {
		// A statement hit a serialization failure or a deadlock; whatever fn made of it (a
		// 500, an error of its own), the transaction is lost: run fn again instead.
		ferr = t.retry
	}
	switch {
	case t.tx == nil:
		return ferr // nothing was sent
	case ferr != nil:
		t.rollback(ctx)
		return ferr
	}
	return t.commit(ctx)
}

func (t *Tx) rollback(ctx context.Context) {
	if t.tx != nil {
		_ = t.tx.Rollback(context.WithoutCancel(ctx))
	}
}

// commit sends COMMIT, with the pending completion or final answer in the same round trip.
func (t *Tx) commit(ctx context.Context) error {
	if t.end == nil {
		return commitError(t.tx.Commit(ctx))
	}
	b := &pgx.Batch{}
	if t.final {
		b.Queue("ROLLBACK TO SAVEPOINT " + claimSavepoint)
		b.Queue(saveFinalSQL, t.end...)
	} else {
		b.Queue(completeSQL, t.end...)
	}
	var tag pgconn.CommandTag
	b.Queue("COMMIT").Exec(func(ct pgconn.CommandTag) error { tag = ct; return nil })
	if err := t.tx.SendBatch(ctx, b).Close(); err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && !fatal(pgErr) {
			// A statement before COMMIT failed; the server skipped the COMMIT.
			t.rollback(ctx)
			return classify(err)
		}
		return commitError(err)
	}
	if tag.String() == "ROLLBACK" {
		return pgx.ErrTxCommitRollback
	}
	return nil
}

// commitError tells a refused commit (an ERROR from PostgreSQL: nothing committed, or a
// failure before anything was sent) from a connection lost after COMMIT was sent, or ended
// by a FATAL error, whose outcome the client cannot know (ErrCommitUnknown).
func commitError(err error) error {
	if err == nil {
		return nil
	}
	var pgErr *pgconn.PgError
	if (errors.As(err, &pgErr) && !fatal(pgErr)) || pgconn.SafeToRetry(err) {
		return classify(err)
	}
	return fmt.Errorf("%w: %w", ErrCommitUnknown, err)
}

// fatal tells whether a PostgreSQL error ended the session (FATAL, PANIC).
func fatal(e *pgconn.PgError) bool {
	s := e.SeverityUnlocalized
	if s == "" {
		s = e.Severity
	}
	return s == "FATAL" || s == "PANIC"
}

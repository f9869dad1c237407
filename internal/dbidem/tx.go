package dbidem

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/internal/canon"
)

// TxOptions configure RunTx.
type TxOptions struct {
	// TxOptions are pgx's: isolation level, access mode. Default READ COMMITTED, the level
	// the SQL API is designed for (it never raises 40001 there).
	pgx.TxOptions
	// MaxAttempts is how many times the unit of work runs when it keeps failing with a
	// serialization failure (40001) or a deadlock (40P01). Default 3; 1 disables retries.
	MaxAttempts int
	// Backoff is the base wait before a retry; the n-th retry waits a random duration in
	// [0, Backoff·2^n). Default 10ms.
	Backoff time.Duration
}

// Tx is the transaction of a unit of work run by RunTx: a pgx.Tx (use it for the work)
// with the idem calls attached.
type Tx struct {
	pgx.Tx
	pending []any // arguments of an idem_complete to send with COMMIT
}

// Begin calls the package's Begin in this transaction.
func (t *Tx) Begin(ctx context.Context, c Claim) (Decision, error) { return Begin(ctx, t.Tx, c) }

// CompleteOnCommit stores r as the response of the claim when the transaction commits, in
// the same round trip as COMMIT. If the claim was lost (ErrClaimLost), RunTx rolls back
// and returns the error.
func (t *Tx) CompleteOnCommit(principal, key string, attempt int, r Response) {
	t.pending = completeArgs(principal, key, attempt, r)
}

// Acquirer hands out connections: *pgxpool.Pool.
type Acquirer interface {
	Acquire(ctx context.Context) (*pgxpool.Conn, error)
}

// RunTx runs fn in a transaction and commits it (with a pending completion, in one round
// trip). When fn returns an error the transaction rolls back and RunTx returns that error.
// When fn or the commit fails with 40001 or 40P01, fn runs again in a new transaction, up to
// opts.MaxAttempts times; fn must therefore not keep state from a failed run (re-read a
// request body from its start, reset a response buffer).
func RunTx(ctx context.Context, db Acquirer, opts TxOptions, fn func(tx *Tx) error) error {
	attempts := opts.MaxAttempts
	if attempts <= 0 {
		attempts = 3
	}
	backoff := opts.Backoff
	if backoff <= 0 {
		backoff = 10 * time.Millisecond
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

func runOnce(ctx context.Context, db Acquirer, txOpts pgx.TxOptions, fn func(tx *Tx) error) (err error) {
	conn, err := db.Acquire(ctx)
	if err != nil {
		return err
	}
	// Should a rollback fail, the connection is closed rather than reused: the pool checks
	// the transaction status when the connection comes back.
	defer conn.Release()
	ptx, err := conn.BeginTx(ctx, txOpts)
	if err != nil {
		return err
	}
	tx := &Tx{Tx: ptx}
	defer func() {
		if r := recover(); r != nil {
			_ = ptx.Rollback(context.WithoutCancel(ctx))
			panic(r)
		}
		if err != nil {
			_ = ptx.Rollback(context.WithoutCancel(ctx))
		}
	}()
	if err := fn(tx); err != nil {
		return err
	}
	if tx.pending == nil {
		return classify(ptx.Commit(ctx))
	}
	// idem_complete and COMMIT in one pipeline. If the completion fails, the server skips
	// the COMMIT and the deferred Rollback ends the transaction.
	b := &pgx.Batch{}
	b.Queue(completeSQL, tx.pending...)
	b.Queue("COMMIT")
	br := conn.SendBatch(ctx, b)
	_, cerr := br.Exec()
	tag, merr := br.Exec()
	if err := errors.Join(cerr, br.Close()); err != nil {
		return classify(err)
	}
	if merr != nil {
		return classify(merr)
	}
	if tag.String() == "ROLLBACK" {
		return pgx.ErrTxCommitRollback
	}
	return nil
}

// Job describes work that must run at most once per key, outside HTTP: a queue consumer
// handling a message id, a cron command.
type Job struct {
	// Principal, Key and Action are as in Claim: who, which key, what.
	Principal, Key, Action string
	// Input is what the work is about; it is JSON-encoded and fingerprinted (canonical
	// JSON), so the same key with another input is ErrMismatch. Nil: no input.
	Input any
	// TTL and LockTimeout are as in Claim.
	TTL, LockTimeout time.Duration
}

// Do runs fn at most once for job.Key: it claims the key, runs fn in the same transaction,
// stores fn's result as JSON and commits all together. A repeat returns the stored result
// (decoded into T) with replayed true, without running fn. When fn fails the transaction
// rolls back, nothing is stored, and a later Do runs fn again. A different Input under the
// same key returns ErrMismatch; a concurrent run past the lock timeout, ErrInProgress.
func Do[T any](ctx context.Context, db Acquirer, job Job, opts TxOptions, fn func(ctx context.Context, tx pgx.Tx) (T, error)) (result T, replayed bool, err error) {
	var input []byte
	if job.Input != nil {
		if input, err = json.Marshal(job.Input); err != nil {
			return result, false, fmt.Errorf("dbidem: encode input: %w", err)
		}
	}
	fp := canon.Compute("DO", job.Action, input)
	claim := Claim{Principal: job.Principal, Key: job.Key, Action: job.Action, Fingerprint: fp.Sum,
		Fields: fp.Fields, TTL: job.TTL, LockTimeout: job.LockTimeout}
	err = RunTx(ctx, db, opts, func(tx *Tx) error {
		var zero T
		result, replayed = zero, false
		d, err := tx.Begin(ctx, claim)
		if err != nil {
			return err
		}
		switch d.Outcome {
		case Replay:
			replayed = true
			return json.Unmarshal(d.Response.Body, &result)
		case Mismatch:
			return fmt.Errorf("%w (changed fields %v)", ErrMismatch, d.ChangedFields)
		case Claimed:
		default:
			return fmt.Errorf("%w: %s", ErrInProgress, d.Outcome)
		}
		if result, err = fn(ctx, tx.Tx); err != nil {
			return err
		}
		body, err := json.Marshal(result)
		if err != nil {
			return fmt.Errorf("dbidem: encode result: %w", err)
		}
		tx.CompleteOnCommit(job.Principal, job.Key, d.Attempt, Response{
			Status: http.StatusOK, Header: http.Header{"Content-Type": {"application/json"}}, Body: body})
		return nil
	})
	return result, replayed, err
}

package dbidem

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/internal/canon"
)

// doGate coalesces the Do calls of this process that carry the same key.
var doGate = NewGate(GateOptions{})

// Job describes work that must run at most once per key, outside HTTP: a queue consumer
// handling a message id, a cron command.
type Job struct {
	// Principal, Key and Action are as in Claim: who, which key, what.
	Principal, Key, Action string
	// Input is what the work is about; it is JSON-encoded and fingerprinted (canonical
	// JSON), so the same key with another input is ErrMismatch. Nil: no input.
	Input any
	// TTL and LockTimeout are as in Claim (0: the SQL API's defaults).
	TTL, LockTimeout time.Duration
	// Gate coalesces concurrent Do calls of this process with the same key. Nil: one Gate
	// shared by every Do of the process.
	Gate *Gate
}

// Do runs fn at most once for job.Key: it claims the key, runs fn in the same transaction,
// stores fn's result as JSON and commits all together. A repeat returns the stored result
// (decoded into T) with replayed true, without running fn. When fn fails the transaction
// rolls back, nothing is stored, and a later Do runs fn again. A different Input under the
// same key returns ErrMismatch; a concurrent run past the lock timeout, ErrInProgress.
// Concurrent calls of this process with the same key wait for each other without holding a
// connection (see Gate).
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
	gate := job.Gate
	if gate == nil {
		gate = doGate
	}
	err = gate.RunHolding(ctx, db, opts, claim, int64(len(input)), func(tx *Tx, d Decision) error {
		var zero T
		result, replayed = zero, false
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
		var err error
		if result, err = fn(ctx, tx); err != nil {
			return err
		}
		body, err := json.Marshal(result)
		if err != nil {
			return fmt.Errorf("dbidem: encode result: %w", err)
		}
		tx.CompleteOnCommit(Response{Status: http.StatusOK, Header: http.Header{"Content-Type": {"application/json"}}, Body: body})
		return nil
	})
	return result, replayed, err
}

package dbidem_test

// Tests from a mutation review of the driver (D235): each failed with a single-point change of
// internal/dbidem that the rest of the suite let pass; its comment names the promise it keeps.

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/internal/dbidem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestIsUnavailableShutdownCodes: IsUnavailable's doc names "shutdown (57P01, 57P02, 57P03)": every
// one of them, not only 57P01 (admin_shutdown), is a database that may be back soon (503 with
// Retry-After), 57P03 being a server still starting up or in recovery.
func TestIsUnavailableShutdownCodes(t *testing.T) {
	t.Parallel()
	for _, code := range []string{"57P01", "57P02", "57P03", "53300", "08006"} {
		if !dbidem.IsUnavailable(&pgconn.PgError{Code: code}) {
			t.Errorf("IsUnavailable(SQLSTATE %s) = false, want true", code)
		}
	}
}

// TestDefaultMaxAttempts: TxOptions' zero value is "3 attempts": a unit of work that keeps failing
// with a serialization failure runs exactly 3 times, then its error is returned.
func TestDefaultMaxAttempts(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 2)
	var runs atomic.Int32
	err := dbidem.RunTx(ctx, pool, dbidem.TxOptions{Backoff: time.Millisecond}, func(tx *dbidem.Tx) error {
		runs.Add(1)
		_, err := tx.Exec(ctx, `DO $$ BEGIN RAISE EXCEPTION 'conflict' USING ERRCODE = '40001'; END $$`)
		return err
	})
	if !dbidem.IsRetryable(err) || runs.Load() != 3 {
		t.Fatalf("default attempts: %v after %d runs, want a retryable error after 3 (DefaultMaxAttempts)", err, runs.Load())
	}
	if dbidem.DefaultMaxAttempts != 3 {
		t.Fatalf("DefaultMaxAttempts = %d, documented as 3", dbidem.DefaultMaxAttempts)
	}
}

// TestNoSchemaIsNotMigrated: ErrNotMigrated is "the database has no (or an older) idem schema": a
// claim on a database without the schema (3F000, invalid_schema_name) is that, not a raw error.
func TestNoSchemaIsNotMigrated(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, pgtest.NewEmptyDB(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	err = dbidem.RunTx(ctx, pool, dbidem.TxOptions{}, func(tx *dbidem.Tx) error {
		_, err := tx.Claim(ctx, claim("k", `{}`))
		return err
	})
	var pgErr *pgconn.PgError
	if !errors.Is(err, dbidem.ErrNotMigrated) || !errors.As(err, &pgErr) || pgErr.Code != "3F000" {
		t.Fatalf("a claim on a database without the idem schema: %v, want ErrNotMigrated wrapping 3F000", err)
	}
}

// TestUntranslatableFieldIsInvalidArgument: ErrInvalidArgument covers "PostgreSQL a text argument
// it cannot hold (22021: bytes that are not UTF-8, U+0000; 22P05)": a field hash holding U+0000
// reaches jsonb as \u0000, which PostgreSQL refuses with 22P05.
func TestUntranslatableFieldIsInvalidArgument(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 2)
	c := claim("nul-field", `{"a":1}`)
	c.Fields = map[string]string{"a": "ab\x00cd"}
	err := dbidem.RunTx(ctx, pool, dbidem.TxOptions{}, func(tx *dbidem.Tx) error {
		_, err := tx.Claim(ctx, c)
		return err
	})
	var pgErr *pgconn.PgError
	if !errors.Is(err, dbidem.ErrInvalidArgument) || !errors.As(err, &pgErr) || pgErr.Code != "22P05" {
		t.Fatalf("a claim whose field hash holds U+0000: %v, want ErrInvalidArgument wrapping 22P05", err)
	}
}

// TestKeepAliveLateAndRunOutIsLostAtOnce: KeepAlive "When the first extension is due already (the
// claim came back late), KeepAlive makes it before it returns; if that fails because the claim was
// taken over, or the lease has run out meanwhile, the returned Lease is lost at once (Lost is
// true): do not start the work." Here the lease ran out long ago and the extension fails for
// another reason (the pool is closed): Lost must be true as KeepAlive returns, not a moment later
// from the heartbeat's goroutine.
func TestKeepAliveLateAndRunOutIsLostAtOnce(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 2)
	pool.Close() // the extension fails, and not with ErrClaimLost
	for i := 0; i < 20; i++ {
		l := dbidem.KeepAlive(context.Background(), pool, "p", "k", 1,
			dbidem.LeaseOptions{Lease: time.Second, Start: time.Now().Add(-time.Hour)})
		lost := l.Lost()
		l.Stop()
		if !lost {
			t.Fatalf("try %d: a lease that ran out an hour ago, whose late extension failed: Lost() false as KeepAlive returned; want true at once", i)
		}
	}
}

// TestClaimSerializationFailureRunsAgain: "When a statement of fn ... fails with 40001 or 40P01 ...
// fn runs again in a new transaction" (RunTx), and "Every statement is watched for serialization
// failures and deadlocks" (Tx). The claim is such a statement: under REPEATABLE READ, a claim of a
// key that another transaction answered after this one's snapshot fails with 40001, and the unit
// runs again, where it finds the answer (Replay).
func TestClaimSerializationFailureRunsAgain(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	c := claim("rr-claim", `{"a":1}`)
	var runs atomic.Int32
	var last dbidem.Outcome
	var firstErr error
	err := dbidem.RunTx(ctx, pool, dbidem.TxOptions{TxOptions: pgx.TxOptions{IsoLevel: pgx.RepeatableRead}, Backoff: time.Millisecond},
		func(tx *dbidem.Tx) error {
			n := runs.Add(1)
			if n == 1 {
				if _, err := tx.Exec(ctx, `SELECT 1`); err != nil { // the snapshot
					return err
				}
				if err := dbidem.RunTx(ctx, pool, dbidem.TxOptions{}, func(other *dbidem.Tx) error {
					d, err := other.Claim(ctx, c)
					if err != nil || d.Outcome != dbidem.Claimed {
						return fmt.Errorf("the other claim: %v %v", d.Outcome, err)
					}
					other.CompleteOnCommit(dbidem.Response{Status: 201})
					return nil
				}); err != nil {
					return err
				}
			}
			d, err := tx.Claim(ctx, c)
			if n == 1 {
				firstErr = err
			}
			last = d.Outcome
			return err
		})
	var pgErr *pgconn.PgError
	if !errors.As(firstErr, &pgErr) || pgErr.Code != "40001" {
		t.Fatalf("the first run's claim after the snapshot: %v, want 40001 (the scenario did not happen)", firstErr)
	}
	if err != nil || runs.Load() != 2 || last != dbidem.Replay {
		t.Fatalf("RunTx whose claim failed with 40001: %v after %d runs, last outcome %q; want success after 2 runs, replay", err, runs.Load(), last)
	}
}

// TestTableBusyProbesRunFourTimes: D68, "When a claim's probes (5 ms each, four within about 50 ms)
// time out on a lock that is not a key's row ..., the Gate answers ErrStoreBusy": four probes, not
// fewer. The table is locked through the first two and free before the third (the pauses lengthened
// so that the lock is gone well before it): the claim succeeds, where a Gate that gave up after two
// probes answered ErrStoreBusy. Not parallel (SetTableBusyPauses).
func TestTableBusyProbesRunFourTimes(t *testing.T) {
	defer dbidem.SetTableBusyPauses([]time.Duration{300 * time.Millisecond, 300 * time.Millisecond, 300 * time.Millisecond})()
	ctx := context.Background()
	tracer := lockTimeoutTracer{seen: make(chan struct{}, 16)}
	pool, ltx := lockedKeyTable(t, tracer)
	done := make(chan error, 1)
	var got dbidem.Decision
	go func() {
		done <- dbidem.NewGate(dbidem.GateOptions{}).Run(ctx, pool, dbidem.TxOptions{}, claim("busy4", `{}`),
			func(tx *dbidem.Tx, d dbidem.Decision) error {
				got = d
				if d.Outcome == dbidem.Claimed {
					tx.CompleteOnCommit(dbidem.Response{Status: 201})
				}
				return nil
			})
	}()
	for i := 0; i < 2; i++ {
		select {
		case <-tracer.seen:
		case err := <-done:
			t.Fatalf("the claim ended after %d probes met the locked table: %v", i, err)
		case <-time.After(30 * time.Second):
			t.Fatalf("%d probes met the locked table in 30 s, want 2", i)
		}
	}
	if err := ltx.Rollback(ctx); err != nil { // free before the third probe, 300 ms on
		t.Fatal(err)
	}
	if err := <-done; err != nil || got.Outcome != dbidem.Claimed {
		t.Fatalf("a fresh key whose first two probes met a locked table, free before the third: %v (%q); want claimed "+
			"(four probes before ErrStoreBusy, D68)", err, got.Outcome)
	}
}

// TestGateLockTimeoutDefaultIsStable: Gate.LockTimeout "is c.LockTimeout, or the SQL API's default
// (read once from db) when it is 0": the default read once is the same on every later call (it
// bounds every duplicate's wait), and a claim's own LockTimeout wins.
func TestGateLockTimeoutDefaultIsStable(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 2)
	d, err := dbidem.ReadDefaults(ctx, pool)
	if err != nil {
		t.Fatal(err)
	}
	g := dbidem.NewGate(dbidem.GateOptions{})
	for i := 0; i < 3; i++ {
		got, err := g.LockTimeout(ctx, pool, dbidem.Claim{})
		if err != nil || got != d.LockTimeout || got != 2*time.Second {
			t.Fatalf("call %d: Gate.LockTimeout of a claim without one: %v %v; want the SQL default %v (2 s)", i, got, err, d.LockTimeout)
		}
	}
	if got, err := g.LockTimeout(ctx, pool, dbidem.Claim{LockTimeout: 300 * time.Millisecond}); err != nil || got != 300*time.Millisecond {
		t.Fatalf("Gate.LockTimeout of a claim with 300ms: %v %v", got, err)
	}
}

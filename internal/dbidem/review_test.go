package dbidem_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgidem/pgidem/internal/dbidem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestLeaseThatRanOutBeforeItStartedRunsNoWork (review finding, the rest of issue 28's
// "a lease can start already run out"): on the fresh-insert path idem_begin counts the lease
// from statement_timestamp(), before its wait on an uncommitted holder of the key. D64 made the
// local deadline count from before the send too, so the local side is never later than the
// database's; but when the wait outlasts the lease, the claim commits a lease that has
// already run out, and DoLease (the middleware's lease routes alike) still calls the work: the
// heartbeat's expiry fires asynchronously, after fn has started. Meanwhile any duplicate takes
// the key over at once, so two attempts run the work at the same time: the very thing
// "leases that never start late" was to prevent. (Lock timeout 5 s, lease 1 s, the documented
// minimum: a holder that keeps its transactional claim for more than a second, then rolls back.)
//
// The gap is held by a real row lock: another request's uncommitted claim of the key.
func TestLeaseThatRanOutBeforeItStartedRunsNoWork(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 8)
	ctx := context.Background()
	job := dbidem.Job{Principal: "p", Key: "doa", Action: "payout", Input: map[string]int{"amount": 1},
		Lease: time.Second, LockTimeout: 5 * time.Second, Gate: dbidem.NewGate(dbidem.GateOptions{})}

	holder, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = holder.Rollback(ctx) }()
	if _, err := holder.Exec(ctx, `SELECT idem.idem_begin('p', 'doa', 'another request', sha256('x'))`); err != nil {
		t.Fatal(err)
	}

	var running, concurrent, deadAtStart atomic.Int32
	fn := func(ctx context.Context, c dbidem.LeaseClaim) (int, error) {
		if running.Add(1) > 1 {
			concurrent.Add(1)
		}
		defer running.Add(-1)
		var over bool
		if err := pool.QueryRow(context.Background(), `SELECT lease_expires_at <= clock_timestamp() FROM idem.idempotency_keys
			WHERE key = 'doa'`).Scan(&over); err != nil {
			return 0, err
		}
		if over {
			deadAtStart.Add(1)
			// Another process's attempt of the same job, now.
			other := job
			other.Gate = dbidem.NewGate(dbidem.GateOptions{})
			_, _, err := dbidem.DoLease(context.Background(), pool, other, func(context.Context, dbidem.LeaseClaim) (int, error) {
				if running.Add(1) > 1 {
					concurrent.Add(1)
				}
				defer running.Add(-1)
				return 2, nil
			})
			t.Logf("another attempt while the first one's work runs: %v", err)
		}
		return 1, nil
	}
	done := make(chan error, 1)
	go func() {
		_, _, err := dbidem.DoLease(ctx, pool, job, fn)
		done <- err
	}()
	pgtest.WaitFor(t, pool, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%idem_begin%'`)
	time.Sleep(1200 * time.Millisecond) // the claim waits on the holder longer than its lease
	_ = holder.Rollback(ctx)
	err = <-done
	t.Logf("the first DoLease: %v", err)
	if deadAtStart.Load() > 0 {
		t.Errorf("DoLease ran the work on a lease that had already run out in the database (%d attempts ran it at once): "+
			"a duplicate could take the key over before the work began", 1+concurrent.Load())
	}
}

package dbidem_test

import (
	"context"
	"testing"
	"time"

	"github.com/pgidem/pgidem/internal/dbidem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestWaitingCleanerIgnoresTheSessionLockTimeout: a waiting cleaner (Wait) on a session whose
// lock_timeout is 100 ms waits a second for a holder of the cleanup lock (D187), and the
// connection's lock_timeout is 100 ms again afterwards: set_config(..., true) lasted only the
// batch statement's implicit transaction.
func TestWaitingCleanerIgnoresTheSessionLockTimeout(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.NewDB(t)
	pool := pgtest.PoolWith(t, url, 1, map[string]string{"lock_timeout": "100ms"})
	pgtest.InsertExpired(t, pool, "p", 30)
	holder := pgtest.Connect(t, url)
	pgtest.Exec(t, holder, `BEGIN`)
	pgtest.Exec(t, holder, `SELECT pg_advisory_xact_lock($1)`, dbidem.CleanupLock)
	released := make(chan struct{})
	go func() {
		defer close(released)
		time.Sleep(time.Second)
		_, _ = holder.Exec(context.Background(), `COMMIT`)
	}()
	defer func() { <-released }()
	c, err := dbidem.NewCleaner(pool, dbidem.CleanerOptions{Wait: true, SkipVacuum: true, BatchSize: 10, Duty: 1})
	if err != nil {
		t.Fatal(err)
	}
	began := time.Now()
	n, ran, err := c.Pass(ctx)
	took := time.Since(began)
	if err != nil || !ran || n != 30 || took < 800*time.Millisecond {
		t.Fatalf("waiting pass behind a 1 s holder with lock_timeout 100ms: %d %v %v after %v", n, ran, err, took)
	}
	var lt string
	if err := pool.QueryRow(ctx, `SHOW lock_timeout`).Scan(&lt); err != nil {
		t.Fatal(err)
	}
	if lt != "100ms" {
		t.Fatalf("the connection's lock_timeout after the pass: %q, want 100ms", lt)
	}
}

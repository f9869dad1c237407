package dbidem_test

import (
	"context"
	"testing"
	"time"

	"github.com/pgidem/pgidem/internal/dbidem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestOnePassAtATimeAcrossProcesses (D282): two cleaners on one database, as two replicas run
// them. A paced pass sits in its pause between batches, where the cleanup lock is free; the
// other replica's pass, started in that pause, is skipped (it used to run, and the two passes
// took turns batch by batch). The gap is held open with a real row lock: the paced pass's first
// batch waits 300 ms on the lease's row, so at duty 0.1 its pause lasts about 2.7 s. A pass
// that meets another's lease at a later batch stops there; a pass with Wait (`server cleanup`)
// takes the lease over and runs to its end; the pass that came back short frees the lease, and
// the next pass runs at once; a lease whose pass died runs out.
func TestOnePassAtATimeAcrossProcesses(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, url := pgtest.NewPool(t, 4)
	pgtest.InsertExpired(t, pool, "p", 450)
	watch := pgtest.Connect(t, url)
	newCleaner := func(duty float64, wait bool) *dbidem.Cleaner {
		c, err := dbidem.NewCleaner(pool, dbidem.CleanerOptions{BatchSize: 100, Duty: duty, Wait: wait, SkipVacuum: true})
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	paced, other, byHand := newCleaner(0.1, false), newCleaner(1, false), newCleaner(1, true)
	left := func() int { return pgtest.Count(t, watch, `SELECT count(*) FROM idem.idempotency_keys`) }

	done := inItsPause(t, url, paced)
	// The paced pass's first batch committed: 100 keys gone, the lease its own.
	if n := left(); n != 350 {
		t.Fatalf("%d keys left after the paced pass's first batch, want 350", n)
	}

	// In its pause, the lock is free, and the other replica's pass is skipped.
	if n, ran, err := other.Pass(ctx); err != nil || ran || n != 0 {
		t.Fatalf("a pass in another pass's pause: %d, ran %v, %v; want skipped", n, ran, err)
	}
	if n := left(); n != 350 {
		t.Fatalf("%d keys left after a pass in another's pause, want 350", n)
	}

	// Another pass takes the lease (as a `server cleanup` would): the paced pass stops at its
	// next batch, having deleted what it deleted, and counts as done.
	pgtest.Exec(t, watch, `UPDATE idem.cleanup_lease SET pass = gen_random_uuid(), until = now() + interval '1 minute'`)
	select {
	case r := <-done:
		if r.err != nil || !r.ran || r.n != 100 {
			t.Fatalf("the paced pass after another took its lease: %d, ran %v, %v; want 100, ran", r.n, r.ran, r.err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("the paced pass did not stop at its next batch after another pass took its lease")
	}
	if n := left(); n != 350 {
		t.Fatalf("%d keys left after the paced pass stopped, want 350", n)
	}
	if n, ran, err := other.Pass(ctx); err != nil || ran || n != 0 {
		t.Fatalf("a pass while another pass holds the lease: %d, ran %v, %v; want skipped", n, ran, err)
	}

	// A pass by hand takes the lease over, runs to its end, and frees the lease.
	if n, ran, err := byHand.Pass(ctx); err != nil || !ran || n != 350 {
		t.Fatalf("a pass with Wait while another pass holds the lease: %d, ran %v, %v; want 350, ran", n, ran, err)
	}
	if free := pgtest.Count(t, watch, `SELECT count(*) FROM idem.cleanup_lease WHERE until = '-infinity'`); free != 1 {
		t.Fatal("the lease is still held after a pass that came back short")
	}
	pgtest.InsertExpired(t, pool, "q", 30)
	if n, ran, err := other.Pass(ctx); err != nil || !ran || n != 30 {
		t.Fatalf("a pass after another pass ended: %d, ran %v, %v; want 30, ran", n, ran, err)
	}

	// A pass whose process died holds the lease until it runs out; then the next pass runs.
	pgtest.InsertExpired(t, pool, "r", 30)
	pgtest.Exec(t, watch, `UPDATE idem.cleanup_lease SET pass = gen_random_uuid(), until = now() + interval '1 minute'`)
	if n, ran, err := other.Pass(ctx); err != nil || ran || n != 0 {
		t.Fatalf("a pass while a dead pass's lease runs: %d, ran %v, %v; want skipped", n, ran, err)
	}
	pgtest.Exec(t, watch, `UPDATE idem.cleanup_lease SET until = now() - interval '1 millisecond'`)
	if n, ran, err := other.Pass(ctx); err != nil || !ran || n != 30 {
		t.Fatalf("a pass after a dead pass's lease ran out: %d, ran %v, %v; want 30, ran", n, ran, err)
	}
}

// TestLeasePollUnderAShortStatementTimeout (D282): a maintenance window that begins in a paced
// pass's pause makes the pass's next batch wait for the lock, up to 2 seconds, and then stop
// there. Under a statement_timeout of 1 s (a role's ALTER ROLE ... SET statement_timeout) the
// wait was cut with 57014, and the pass counted as failed; the wait is now half the timeout,
// and the pass ends done with what it deleted. (A review's reproducer.)
func TestLeasePollUnderAShortStatementTimeout(t *testing.T) {
	t.Parallel()
	url := pgtest.NewDB(t)
	pool := pgtest.PoolWith(t, url, 2, map[string]string{"statement_timeout": "1s"})
	pgtest.InsertExpired(t, pool, "p", 450)
	window := pgtest.Connect(t, url)
	c, err := dbidem.NewCleaner(pool, dbidem.CleanerOptions{BatchSize: 100, Duty: 0.1, SkipVacuum: true})
	if err != nil {
		t.Fatal(err)
	}
	done := inItsPause(t, url, c)
	// The maintenance window begins in the pause, and lasts until the pass has ended.
	pgtest.Exec(t, window, `BEGIN`)
	pgtest.Exec(t, window, `SELECT pg_advisory_xact_lock($1)`, dbidem.CleanupLock)
	var r passResult
	select {
	case r = <-done:
	case <-time.After(20 * time.Second):
		t.Fatal("the pass did not end during the maintenance window")
	}
	pgtest.Exec(t, window, `COMMIT`)
	if r.err != nil || !r.ran || r.n != 100 {
		t.Fatalf("a maintenance window in a pass's pause, under a 1 s statement_timeout: %d, ran %v, %v; want 100, ran, no error",
			r.n, r.ran, r.err)
	}
}

// passResult is what a cleanup pass returned.
type passResult struct {
	n   int
	ran bool
	err error
}

// inItsPause starts a pass of c, a paced cleaner (duty 0.1, batches of 100) on the database of
// url that holds more than 100 expired keys, and returns once the pass sits in the pause after
// its first batch, with the lease its own for more than 12 seconds: a real row lock on the
// lease's row holds that batch 300 ms, so the pause lasts about 2.7 s. The pass's result comes
// on the channel.
func inItsPause(t *testing.T, url string, c *dbidem.Cleaner) <-chan passResult {
	t.Helper()
	holder, watch := pgtest.Connect(t, url), pgtest.Connect(t, url)
	pgtest.Exec(t, holder, `BEGIN`)
	pgtest.Exec(t, holder, `SELECT FROM idem.cleanup_lease FOR UPDATE`)
	done := make(chan passResult, 1)
	go func() {
		n, ran, err := c.Pass(context.Background())
		done <- passResult{n, ran, err}
	}()
	pgtest.WaitFor(t, watch, `SELECT count(*) FROM pg_stat_activity
		WHERE query LIKE '%idem_cleanup_leased%' AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()`)
	time.Sleep(300 * time.Millisecond)
	pgtest.Exec(t, holder, `COMMIT`)
	pgtest.WaitFor(t, watch, `SELECT count(*) FROM idem.cleanup_lease WHERE until > now() + interval '12 seconds'`)
	return done
}

package tests

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestCleanupLeaseAsTheAppRole: idem_cleanup_leased as docs/sql-api.md describes it, called by
// the application role, which cannot read the lease's table: a batch of a pass that holds the
// lease, or whose lease ran out, deletes; a batch of another pass meets the lease and returns
// NULL (nothing deleted) unless it takes the lease over; the batch that comes back short frees
// the lease; idem_cleanup_all takes the lease over and frees it at its end.
func TestCleanupLeaseAsTheAppRole(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	app, admin, _, appURL := appSession(t, false)
	pgtest.InsertExpired(t, admin, "p", 35)
	const p, q = "00000000-0000-4000-8000-000000000001", "00000000-0000-4000-8000-000000000002"
	batch := func(pass string, takeOver bool) *int {
		t.Helper()
		var n *int
		if err := app.QueryRow(ctx, `SELECT idem.idem_cleanup_leased($1, 10, 0.5, $2)`, pass, takeOver).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	want := func(what string, got *int, n int) {
		t.Helper()
		if n < 0 && got != nil || n >= 0 && (got == nil || *got != n) {
			g := "NULL"
			if got != nil {
				g = fmt.Sprint(*got)
			}
			t.Fatalf("%s: %s deleted, want %d (-1: NULL)", what, g, n)
		}
	}
	live := `UPDATE idem.cleanup_lease SET pass = gen_random_uuid(), until = now() + interval '1 minute'`

	pgtest.Exec(t, admin, live)
	want("a batch while another pass holds the lease", batch(p, false), -1)
	if left := pgtest.Count(t, admin, `SELECT count(*) FROM idem.idempotency_keys`); left != 35 {
		t.Fatalf("%d keys left after a batch that met another's lease, want 35", left)
	}
	want("a batch that takes the lease over", batch(p, true), 10)
	if n := pgtest.Count(t, admin, `SELECT count(*) FROM idem.cleanup_lease
		WHERE pass = $1 AND until > now() + interval '9 seconds'`, p); n != 1 {
		t.Fatal("a full batch did not keep the lease for its pass")
	}
	want("the next batch of the pass that holds the lease", batch(p, false), 10)

	// A moment's holder of the lock (another cleaner's first statement, a caller of
	// idem_cleanup): the pass that holds the lease waits for it; another pass does not.
	pgtest.Exec(t, admin, `BEGIN`)
	pgtest.Exec(t, admin, `SELECT pg_advisory_xact_lock(29665259344325742)`)
	want("another pass's batch while a transaction holds the lock", batch(q, false), -1)
	waiter := pgtest.Connect(t, appURL)
	var pid uint32
	if err := waiter.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
		t.Fatal(err)
	}
	waited := make(chan *int, 1)
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	t.Cleanup(func() { cancel(); <-waited; waited <- nil }) // before the connections close
	go func() {
		var n *int
		err := waiter.QueryRow(wctx, `SELECT idem.idem_cleanup_leased($1, 10, 0.5)`, p).Scan(&n)
		if err != nil {
			t.Error(err)
		}
		waited <- n
	}()
	pgtest.WaitFor(t, admin, `SELECT count(*) FROM pg_stat_activity WHERE pid = $1 AND wait_event = 'PgSleep'`, pid)
	pgtest.Exec(t, admin, `COMMIT`)
	n := <-waited
	waited <- n
	want("the lease's pass's batch after a moment's holder of the lock", n, 10)
	// A maintenance window: the wait ends after 2 seconds, and the pass stops there.
	pgtest.Exec(t, admin, `BEGIN`)
	pgtest.Exec(t, admin, `SELECT pg_advisory_xact_lock(29665259344325742)`)
	began := time.Now()
	want("the lease's pass's batch during a maintenance window", batch(p, false), -1)
	if took := time.Since(began); took < 1500*time.Millisecond || took > 10*time.Second {
		t.Errorf("a batch during a maintenance window returned after %v, want 2 s", took)
	}
	pgtest.Exec(t, admin, `COMMIT`)
	want("a batch of another pass", batch(q, false), -1)
	want("the pass's last batch", batch(p, false), 5)
	if n := pgtest.Count(t, admin, `SELECT count(*) FROM idem.cleanup_lease WHERE until = '-infinity'`); n != 1 {
		t.Fatal("the lease is held after its pass's batch came back short")
	}
	want("a batch of another pass once the lease is free", batch(q, false), 0)

	pgtest.InsertExpired(t, admin, "q", 25)
	pgtest.Exec(t, admin, live)
	var deleted int64
	if err := app.QueryRow(ctx, `CALL idem.idem_cleanup_all(10)`).Scan(&deleted); err != nil || deleted != 25 {
		t.Fatalf("idem_cleanup_all while another pass holds the lease: %d, %v; want 25", deleted, err)
	}
	if n := pgtest.Count(t, admin, `SELECT count(*) FROM idem.cleanup_lease WHERE until = '-infinity'`); n != 1 {
		t.Fatal("the lease is held after idem_cleanup_all ended")
	}

	// docs/operations.md ("Cleanup"), as the schema's owner: who holds the lease, and freeing
	// the lease of a pass that died.
	pgtest.InsertExpired(t, admin, "r", 5)
	pgtest.Exec(t, admin, live)
	var holder *string
	var left time.Duration
	if err := admin.QueryRow(ctx, `SELECT pass, until, until - now() AS time_left FROM idem.cleanup_lease`).
		Scan(&holder, new(time.Time), &left); err != nil || holder == nil || left < 50*time.Second {
		t.Fatalf("the owner's read of the lease: %v, %v left, %v", holder, left, err)
	}
	want("a batch while a dead pass's lease runs", batch(q, false), -1)
	pgtest.Exec(t, admin, `UPDATE idem.cleanup_lease SET until = '-infinity'`)
	want("a batch after the owner freed a dead pass's lease", batch(q, false), 5)

	for _, c := range []struct{ sql, code string }{
		{`SELECT idem.idem_cleanup_leased(NULL)`, "22004"},
		{`SELECT idem.idem_cleanup_leased(gen_random_uuid(), NULL)`, "22004"},
		{`SELECT idem.idem_cleanup_leased(gen_random_uuid(), 0)`, "22023"},
		{`SELECT idem.idem_cleanup_leased(gen_random_uuid(), 10, 0)`, "22023"},
		{`SELECT idem.idem_cleanup_leased(gen_random_uuid(), 10, 1.5)`, "22023"},
		{`SELECT idem.idem_cleanup_leased(gen_random_uuid(), 10, 'NaN')`, "22023"},
		{`SELECT idem.idem_cleanup_leased(gen_random_uuid(), 10, 1, NULL)`, "22004"},
		{`SELECT * FROM idem.cleanup_lease`, "42501"},
		{`UPDATE idem.cleanup_lease SET until = 'infinity'`, "42501"},
	} {
		_, err := app.Exec(ctx, c.sql)
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != c.code {
			t.Errorf("%s as the app role: %v, want SQLSTATE %s", c.sql, err, c.code)
		}
	}
}

// TestLeaseThatRanOutStillNamesItsPass (D282): a pass's lease that ran out while no other pass
// took it is still the pass's: its next batch waits for a moment's holder of the lock (here a
// transaction of 300 ms) instead of returning NULL at once and ending the pass with keys left
// and no other pass going on.
func TestLeaseThatRanOutStillNamesItsPass(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	app, admin, _, _ := appSession(t, false)
	pgtest.InsertExpired(t, admin, "p", 25)
	const p = "00000000-0000-4000-8000-000000000003"
	var n *int
	if err := app.QueryRow(ctx, `SELECT idem.idem_cleanup_leased($1, 10, 0.5)`, p).Scan(&n); err != nil || n == nil || *n != 10 {
		t.Fatalf("the pass's first batch: %v, %v; want 10", n, err)
	}
	pgtest.Exec(t, admin, `UPDATE idem.cleanup_lease SET until = now() - interval '1 millisecond'`)
	pgtest.Exec(t, admin, `BEGIN`)
	pgtest.Exec(t, admin, `SELECT pg_advisory_xact_lock(29665259344325742)`)
	released := make(chan struct{})
	go func() {
		defer close(released)
		time.Sleep(300 * time.Millisecond)
		_, _ = admin.Exec(context.Background(), `COMMIT`)
	}()
	began := time.Now()
	err := app.QueryRow(ctx, `SELECT idem.idem_cleanup_leased($1, 10, 0.5)`, p).Scan(&n)
	took := time.Since(began)
	<-released
	if err != nil || n == nil || *n != 10 || took < 250*time.Millisecond {
		t.Fatalf("the pass's batch behind a 300 ms holder of the lock, its lease run out: %v, %v after %v; want 10 after the holder",
			n, err, took)
	}
}

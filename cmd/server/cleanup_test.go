package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/idem/idemprom"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// cleaner is the library's cleaner (idem.Cleaner) with its Prometheus metrics, as the server
// builds it.
type cleaner struct {
	*idem.Cleaner
	reg *prometheus.Registry
}

// newCleaner returns a cleaner on pool with this batch size, vacuum and duty (1: no pauses,
// as `server cleanup` runs).
func newCleaner(pool *pgxpool.Pool, batchSize int, vacuum bool, duty float64, log *slog.Logger) *cleaner {
	reg := prometheus.NewRegistry()
	c, err := idem.NewCleaner(pool, idem.CleanerOptions{BatchSize: batchSize, SkipVacuum: !vacuum, Duty: duty, Logger: log,
		Metrics: idemprom.NewCleanupObserver(reg)})
	if err != nil {
		panic(err)
	}
	return &cleaner{c, reg}
}

func (c *cleaner) pass(ctx context.Context) (int, bool, error) { return c.Pass(ctx) }

// metric is the value of the cleaner's metric name (with the result label, when given), and
// how many series the family has.
func (c *cleaner) metric(name, result string) (float64, int) {
	mfs, err := c.reg.Gather()
	if err != nil {
		panic(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			if result == "" || (len(m.GetLabel()) == 1 && m.GetLabel()[0].GetValue() == result) {
				return m.GetCounter().GetValue(), len(mf.GetMetric())
			}
		}
	}
	return 0, 0
}

func (c *cleaner) vacuums() float64 {
	v, _ := c.metric("idem_cleanup_vacuums_total", "")
	return v
}

func expire(t *testing.T, s *testServer, principal string, n int) {
	t.Helper()
	pgtest.InsertExpired(t, s.pool, principal, n)
}

// TestCleanupWhileRequestsRun: a pass runs while requests are in flight, one of them in
// the middle of re-claiming an expired key (its row locked, its handler held on a row
// lock): the pass skips that row and deletes every other expired key, the request then
// completes with its key, and the other requests never fail.
func TestCleanupWhileRequestsRun(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	id, token := s.principal("c")
	expire(t, s, id, 2500)
	acct := int(s.call("POST", "/v1/accounts", token, "", `{"name":"a","currency":"EUR"}`).json(t)["id"].(float64))
	ctx := context.Background()
	holder, err := s.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = holder.Rollback(ctx) }()
	pgtest.Exec(t, holder, `SELECT 1 FROM ledger.accounts WHERE id = $1 FOR UPDATE`, acct)
	reclaim := make(chan resp, 1)
	go func() {
		reclaim <- s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", acct), token, "old-7", `{"amount":5}`)
	}()
	pgtest.WaitFor(t, s.pool, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'`)

	var wg sync.WaitGroup
	var statuses []int
	stop := make(chan struct{})
	wg.Add(1)
	go func() {
		defer wg.Done()
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			r := s.call("POST", "/v1/accounts", token, fmt.Sprintf("live-%d", i), `{"name":"a","currency":"EUR"}`)
			statuses = append(statuses, r.status)
		}
	}()
	c := newCleaner(s.pool, 100, true, 1, slog.New(slog.NewTextHandler(io.Discard, nil)))
	n, ran, err := c.pass(ctx)
	close(stop)
	wg.Wait()
	if err != nil || !ran || n != 2499 {
		t.Fatalf("pass: %d deleted, ran %v, %v; want 2499 (every expired key but the one being re-claimed)", n, ran, err)
	}
	_ = holder.Rollback(ctx)
	if r := <-reclaim; r.status != 201 {
		t.Fatalf("the re-claiming deposit: %+v", r)
	}
	if k := s.count(`SELECT count(*) FROM idem.idempotency_keys WHERE key = 'old-7' AND state = 'c' AND expires_at > now()`); k != 1 {
		t.Fatal("the re-claimed key was not stored")
	}
	for i, st := range statuses {
		if st != 201 {
			t.Fatalf("request %d: %d", i, st)
		}
	}
	if k := s.count(`SELECT count(*) FROM idem.idempotency_keys WHERE key LIKE 'live-%'`); k != len(statuses) {
		t.Fatalf("%d live keys, want %d", k, len(statuses))
	}
	if k := s.count(`SELECT count(*) FROM idem.idempotency_keys WHERE expires_at <= now()`); k != 0 {
		t.Fatalf("%d expired keys left", k)
	}
}

// TestTwoInstancesOneCleaner: while one process holds the cleanup lock another skips its
// pass; two processes at once never delete a row twice.
func TestTwoInstancesOneCleaner(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	id, _ := s.principal("c")
	expire(t, s, id, 3000)
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	a, b := newCleaner(s.pool, 100, true, 1, log), newCleaner(s.pool, 100, true, 1, log)

	ctx := context.Background()
	holder, err := s.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := holder.Exec(ctx, `SELECT pg_advisory_xact_lock($1)`, idem.CleanupLock); err != nil {
		t.Fatal(err)
	}
	if n, ran, err := b.pass(ctx); err != nil || ran || n != 0 {
		t.Fatalf("a pass while another holds the lock: %d, ran %v, %v", n, ran, err)
	}
	_ = holder.Rollback(ctx)

	var wg sync.WaitGroup
	start := make(chan struct{})
	results := make([]int, 2)
	ranBoth := make([]bool, 2)
	for i, c := range []*cleaner{a, b} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			n, ran, err := c.pass(ctx)
			if err != nil {
				t.Error(err)
			}
			results[i], ranBoth[i] = n, ran
		}()
	}
	close(start)
	wg.Wait()
	if results[0]+results[1] != 3000 {
		t.Fatalf("deleted %v, want 3000 in all", results)
	}
	if !ranBoth[0] && !ranBoth[1] {
		t.Fatal("no pass ran")
	}
	if k := s.count(`SELECT count(*) FROM idem.idempotency_keys`); k != 0 {
		t.Fatalf("%d keys left", k)
	}
}

// TestCleanerHoldsOneConnection: a pass holds at most one connection, and only while a
// statement runs. With a pool of two, one of them held by a request for the whole pass, the
// pass deletes every expired key and vacuums; it used to need two at once (its lock
// transaction and its batches), and waited for the held one.
func TestCleanerHoldsOneConnection(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	id, _ := s.principal("c")
	expire(t, s, id, 3000)
	cfg, err := pgxpool.ParseConfig(s.db)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 2
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	request, err := pool.Acquire(ctx) // a request holds one connection throughout
	if err != nil {
		t.Fatal(err)
	}
	defer request.Release()
	c := newCleaner(pool, 100, true, 1, slog.New(slog.NewTextHandler(io.Discard, nil)))
	n, ran, err := c.pass(ctx)
	if err != nil || !ran || n != 3000 {
		t.Fatalf("a pass with one connection free: deleted %d, ran %v, %v; want 3000", n, ran, err)
	}
	if v := c.vacuums(); v != 1 {
		t.Fatalf("%v vacuums after deleting 3000 keys, want 1", v)
	}
}

// TestCleanerCleansACoordinator: the server's cleaner empties the workers of a Citus
// coordinator (a stand-in with two workers, pgtest.CitusStandIn) through
// idem_cleanup_workers, each worker cleaning its own keys, never through idem_cleanup's
// rounds (here made to fail); a pass is skipped while another process holds the cleanup
// lock, and then asks no worker.
func TestCleanerCleansACoordinator(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	ctx := context.Background()
	pgtest.CitusStandIn(t, s.pool)
	pgtest.Exec(t, s.pool, `CREATE OR REPLACE FUNCTION idem.cleanup_on_workers(p_shares jsonb) RETURNS SETOF text LANGUAGE plpgsql
		AS $$ BEGIN RAISE EXCEPTION 'a round of idem_cleanup on a coordinator'; END $$`)
	pgtest.InsertKeys(t, s.pool, "idem.keys_w1", "a", "old", 1700, true)
	pgtest.InsertKeys(t, s.pool, "idem.keys_w2", "b", "old", 450, true)
	pgtest.InsertKeys(t, s.pool, "idem.keys_w2", "b", "live", 30, false)
	c := newCleaner(s.pool, 0, true, 1, slog.New(slog.NewTextHandler(io.Discard, nil)))

	holder, err := s.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := holder.Exec(ctx, `SELECT pg_advisory_xact_lock($1)`, idem.CleanupLock); err != nil {
		t.Fatal(err)
	}
	if n, ran, err := c.pass(ctx); err != nil || ran || n != 0 {
		t.Fatalf("a pass while another holds the lock: %d, ran %v, %v; want skipped", n, ran, err)
	}
	_ = holder.Rollback(ctx)
	if n := s.count(`SELECT (SELECT count(*) FROM idem.keys_w1) + (SELECT count(*) FROM idem.keys_w2)`); n != 2180 {
		t.Fatalf("%d keys left on the workers after a skipped pass, want all 2180", n)
	}

	if n, ran, err := c.pass(ctx); err != nil || !ran || n != 2150 {
		t.Fatalf("a pass on the coordinator: deleted %d, ran %v, %v; want 2150", n, ran, err)
	}
	if n := s.count(`SELECT (SELECT count(*) FROM idem.keys_w1) + (SELECT count(*) FROM idem.keys_w2)`); n != 30 {
		t.Fatalf("%d keys left on the workers, want the 30 live ones", n)
	}
	if v, _ := c.metric("idem_cleanup_passes_total", "done"); v != 1 {
		t.Fatalf("%v passes counted done, want 1", v)
	}

	// The vacuum's threshold is the workers' rows (50 + 2% of them), not the coordinator's own
	// empty table's: 100 deletions among 20,000 keys wait for more.
	if v := c.vacuums(); v != 1 {
		t.Fatalf("%v vacuums after deleting 2150 keys, want 1", v)
	}
	pgtest.InsertKeys(t, s.pool, "idem.keys_w1", "a", "more", 20_000, false)
	pgtest.InsertKeys(t, s.pool, "idem.keys_w2", "b", "again", 100, true)
	pgtest.Exec(t, s.pool, `ANALYZE idem.keys_w1, idem.keys_w2`)
	if n, _, err := c.pass(ctx); err != nil || n != 100 {
		t.Fatalf("a second pass: deleted %d, %v; want 100", n, err)
	}
	if v := c.vacuums(); v != 1 {
		t.Fatalf("%v vacuums after 100 more deletions among 20,000 keys on the workers, want still 1", v)
	}
}

// TestScheduledCleanupStopsWithTheServer: the gocron job runs passes on its interval, and
// once stop has returned no pass runs any more. A batch statement the last pass had sent may
// still end on the server (pgx's default answer to a canceled context closes the connection
// without a cancel request, and idem_cleanup's DELETE takes its snapshot when it starts): the
// test waits for the database's other backends to be idle before it inserts new expired keys
// (one CI run saw such a batch delete them).
func TestScheduledCleanupStopsWithTheServer(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	id, _ := s.principal("c")
	expire(t, s, id, 500)
	c, err := idem.StartCleaner(context.Background(), s.pool, idem.CleanerOptions{Interval: 50 * time.Millisecond, BatchSize: 100,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	stop := c.Stop
	for i := 0; i < 200 && s.count(`SELECT count(*) FROM idem.idempotency_keys`) > 0; i++ {
		sleepBriefly()
	}
	if k := s.count(`SELECT count(*) FROM idem.idempotency_keys`); k != 0 {
		t.Fatalf("%d expired keys left after the scheduled passes", k)
	}
	stop()
	stop() // idempotent
	pgtest.WaitFor(t, s.pool, `SELECT (count(*) = 0)::int FROM pg_stat_activity
		WHERE datname = current_database() AND pid <> pg_backend_pid() AND state = 'active'`)
	pgtest.InsertExpired(t, s.pool, id, 10)
	time.Sleep(300 * time.Millisecond) // six intervals
	if k := s.count(`SELECT count(*) FROM idem.idempotency_keys`); k != 10 {
		t.Fatalf("a pass ran after stop: %d of 10 expired keys left", k)
	}
}

// TestCleanupVacuumsTheKeyTable: once passes have deleted more keys than autovacuum's
// threshold for the table (50 + 2% of its rows), the cleaner vacuums it, when the server's
// role owns it; fewer deletions wait for the next passes; a role that does not own the table
// (here idem_app) still deletes, does not try to vacuum, and says so once in the log.
func TestCleanupVacuumsTheKeyTable(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	id, _ := s.principal("c")
	ctx := context.Background()
	vacuumCount := func() int {
		return s.count(`SELECT vacuum_count FROM pg_stat_user_tables WHERE relid = 'idem.idempotency_keys'::regclass`)
	}

	expire(t, s, id, 300)
	before := vacuumCount()
	c := newCleaner(s.pool, 100, true, 1, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if n, _, err := c.pass(ctx); err != nil || n != 300 {
		t.Fatalf("owner pass: deleted %d, %v", n, err)
	}
	if got := c.vacuums(); got != 1 || vacuumCount() != before+1 {
		t.Fatalf("owner pass: %v vacuums counted, vacuum_count %d -> %d", got, before, vacuumCount())
	}
	if n, _, err := c.pass(ctx); err != nil || n != 0 || c.vacuums() != 1 {
		t.Fatalf("a pass that deleted nothing: deleted %d, %v, %v vacuums", n, err, c.vacuums())
	}

	// 20,000 live keys: the threshold becomes 50 + 400 rows.
	pgtest.Exec(t, s.pool, `INSERT INTO idem.idempotency_keys (expires_at, attempt, action_hash, state, principal_id, key,
		request_sha256, response_status, response_headers)
		SELECT now() + interval '1 day', nextval('idem.token_seq'), 0, 'c', $1, 'live-' || i, sha256(i::text::bytea), 200, '{}'
		  FROM generate_series(1, 20000) AS i`, id)
	pgtest.Exec(t, s.pool, `ANALYZE idem.idempotency_keys`)
	before = vacuumCount()
	for i, step := range []struct{ deleted, vacuums int }{{300, 1}, {200, 2}} {
		expire(t, s, id, step.deleted)
		if n, _, err := c.pass(ctx); err != nil || n != step.deleted {
			t.Fatalf("pass %d: deleted %d, %v", i, n, err)
		}
		if got := c.vacuums(); got != float64(step.vacuums) {
			t.Fatalf("after deleting %d of 20,000 rows: %v vacuums counted, want %d", step.deleted, got, step.vacuums)
		}
	}
	if vacuumCount() != before+1 {
		t.Fatalf("vacuum_count %d -> %d, want one vacuum for 500 deletions", before, vacuumCount())
	}

	cfg := s.pool.Config()
	cfg.AfterConnect = func(ctx context.Context, c *pgx.Conn) error {
		_, err := c.Exec(ctx, `SET ROLE idem_app`)
		return err
	}
	app, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer app.Close()
	var log strings.Builder
	c = newCleaner(app, 100, true, 1, slog.New(slog.NewTextHandler(&log, nil)))
	for i := 0; i < 2; i++ {
		expire(t, s, id, 50)
		if n, _, err := c.pass(ctx); err != nil || n != 50 {
			t.Fatalf("idem_app pass %d: deleted %d, %v", i, n, err)
		}
	}
	if got := c.vacuums(); got != 0 || vacuumCount() != before+1 {
		t.Fatalf("idem_app passes: %v vacuums counted, vacuum_count %d -> %d", got, before, vacuumCount())
	}
	if k := strings.Count(log.String(), "does not vacuum"); k != 1 {
		t.Fatalf("want the refusal logged once, got %d times:\n%s", k, log.String())
	}
}

// TestPacedPassStopsAtShutdown: a paced pass pauses between batches (at a small duty the
// pauses are most of it), and a shutdown that lands in a pause ends the pass at once and
// counts it as stopped, not failed (the alert on failed passes must not fire on a deploy).
func TestPacedPassStopsAtShutdown(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	id, _ := s.principal("c")
	expire(t, s, id, 3000)
	c := newCleaner(s.pool, 100, false, 0.01, slog.New(slog.NewTextHandler(io.Discard, nil)))
	// A fresh cleaner exports every result at 0, so that the first failure is an increase.
	if _, n := c.metric("idem_cleanup_passes_total", "done"); n != 4 {
		t.Fatalf("a fresh cleaner exports %d series of idem_cleanup_passes_total, want 4 (done, skipped, failed, stopped)", n)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	start := time.Now()
	n, ran, err := c.pass(ctx)
	if !errors.Is(err, context.DeadlineExceeded) || !ran || n <= 0 || n >= 3000 {
		t.Fatalf("a pass cut short in a pause: %d deleted, ran %v, %v; want some of the 3000 and the context's error", n, ran, err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("the pass took %v to notice its context ended", d)
	}
	stopped, _ := c.metric("idem_cleanup_passes_total", "stopped")
	failed, _ := c.metric("idem_cleanup_passes_total", "failed")
	if stopped != 1 || failed != 0 {
		t.Fatalf("passes stopped %v, failed %v; want 1 and 0", stopped, failed)
	}
	if d, _ := c.metric("idem_cleanup_deleted_total", ""); int(d) != n {
		t.Fatalf("idem_cleanup_deleted_total %v, want the %d the pass deleted", d, n)
	}
	// The deadline lands in a pause nearly always (a pause is 99 times its batch); should it
	// land in a batch, that batch may commit on the server while the pass sees only the
	// cancellation, uncounted.
	if left := s.count(`SELECT count(*) FROM idem.idempotency_keys WHERE expires_at <= now()`); left != 3000-n && left != 3000-n-100 {
		t.Fatalf("%d expired keys left, want %d (or one uncounted batch fewer)", left, 3000-n)
	}
}

package idemprom_test

// Adversarial review (operations, round 2): reproducers of what operators see in the metrics.

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/idem/idemprom"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// labelValues lists the distinct values of label in the series of metric name.
func labelValues(t *testing.T, reg *prometheus.Registry, name, label string) []string {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == label && !slices.Contains(out, l.GetValue()) {
					out = append(out, l.GetValue())
				}
			}
		}
	}
	slices.Sort(out)
	return out
}

// value sums the counters of metric name whose label has this value.
func value(t *testing.T, reg *prometheus.Registry, name, label, want string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var v float64
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == label && l.GetValue() == want {
					v += m.GetCounter().GetValue()
				}
			}
		}
	}
	return v
}

// observed is a middleware for principal alice on a fresh database, its metrics in reg through
// an idemprom.Observer, its log discarded.
func observed(t *testing.T) (*pgxpool.Pool, *prometheus.Registry, *idem.Middleware) {
	t.Helper()
	pool, _ := pgtest.NewPool(t, 4)
	reg := prometheus.NewRegistry()
	m, err := idem.New(context.Background(), idem.Options{DB: pool, Principal: func(*http.Request) (string, bool) { return "alice", true },
		Metrics: idemprom.NewObserver(reg), Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	return pool, reg, m
}

// TestReviewOpsActionLabelIsBoundedByRoutes: docs/operations.md says
// idempotency_requests_total{action,state} counts "keyed requests by route and state", and
// Route.Action defaults to "the method and the route template". On net/http's ServeMux a
// pattern without a method ("/things", the pre-1.22 style) takes every method, and the
// client chooses the method: every new method a client sent with a key made a new action
// label value (and a new series per state, and an entry of the middleware's per-action
// statistics). A method outside RFC 9110's nine is now OTHER in the default action.
func TestReviewOpsActionLabelIsBoundedByRoutes(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, reg, m := observed(t)
	mux := http.NewServeMux()
	mux.Handle("/things", m.Route(idem.Route{})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(201)
	})))
	srv := httptest.NewServer(mux)
	defer srv.Close()
	for i := range 20 {
		st, _, body := pgtest.Send(t, ctx, fmt.Sprintf("X%d", i), srv.URL+"/things", "", "Idempotency-Key", fmt.Sprintf("k%d", i))
		if st != 201 {
			t.Fatalf("request %d: %d %s", i, st, body)
		}
	}
	actions := labelValues(t, reg, "idempotency_requests_total", "action")
	if len(actions) != 1 || actions[0] != "OTHER /things" {
		t.Fatalf("one route, %d action label values chosen by the client's method: %v", len(actions), actions[:min(5, len(actions))])
	}
}

// TestReviewOpsLeaseOutcomeUnknownIsCounted: a lease route whose answer cannot be recorded
// (the database fails under idem_complete) answers 503 outcome_unknown. The dashboard's
// "Store errors" panel says it shows "Keyed requests the database failed (503
// store_unavailable, outcome_unknown) per second" from state="store_error", the alert
// IdemStoreErrors reads the same series, and idem.StateStoreError says "the database failed;
// the client got a 5xx". The request is counted acquired only: no store_error, no lost lease,
// nothing in any metric tells the operator that clients got 503s.
func TestReviewOpsLeaseOutcomeUnknownIsCounted(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, reg, m := observed(t)
	var once sync.Once
	srv := httptest.NewServer(m.Route(idem.Route{Action: "POST /pay", Lease: time.Second})(http.HandlerFunc(
		func(w http.ResponseWriter, r *http.Request) {
			// The store fails under the work, as a database can.
			once.Do(func() { pgtest.Exec(t, pool, `ALTER FUNCTION idem.idem_complete RENAME TO idem_complete_gone`) })
			w.WriteHeader(201)
		})))
	defer srv.Close()
	st, _, body := pgtest.Send(t, ctx, "POST", srv.URL, `{}`, "Idempotency-Key", "p1")
	pgtest.Exec(t, pool, `ALTER FUNCTION idem.idem_complete_gone RENAME TO idem_complete`)
	if st != 503 || !strings.Contains(body, idem.CodeOutcomeUnknown) {
		t.Fatalf("want 503 outcome_unknown, got %d %s", st, body)
	}
	storeErr := value(t, reg, "idempotency_requests_total", "state", "store_error")
	lost := value(t, reg, "idempotency_leases_lost_total", "action", "POST /pay")
	if storeErr != 1 {
		t.Fatalf("a 503 outcome_unknown of a lease route: idempotency_requests_total{state=\"store_error\"} = %v, "+
			"idempotency_leases_lost_total = %v; the dashboard's Store errors panel and the IdemStoreErrors alert never see it", storeErr, lost)
	}
}

// TestReviewOpsActionWithInvalidUTF8DoesNotPanic: with no route template (a router that sets
// no Request.Pattern and no Options.RouteTemplate, or m.Route's handler served as is) the
// default action is the method and the URL path (documented), and the path is the client's,
// percent-decoded: "/x/%ff" makes the byte 0xff. PostgreSQL refused the action (22021), so
// the request was answered 503 store_unavailable with Retry-After (retried forever by a
// client), logged at error level as "unit of work failed" and counted store_error: a client
// fired IdemStoreErrors ("the database failing under the API") at will. With idemprom it was
// worse: the Prometheus client panicked on a label value that is not valid UTF-8
// (WithLabelValues), in Count(store_error), and net/http cut the connection after logging
// the panic, on every attempt. The default action now replaces such bytes.
func TestReviewOpsActionWithInvalidUTF8DoesNotPanic(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _, m := observed(t)
	srv := httptest.NewUnstartedServer(m.Route(idem.Route{})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(201)
	})))
	srv.Config.ErrorLog = nil
	srv.Start()
	defer srv.Close()
	for i := range 2 {
		st, _, body := pgtest.Send(t, ctx, "POST", srv.URL+"/x/%ff", `{}`, "Idempotency-Key", "u1")
		if st != 201 {
			n := pgtest.Count(t, pool, `SELECT count(*) FROM idem.idempotency_keys WHERE key = 'u1' AND state = 'c'`)
			t.Fatalf("attempt %d: %d %s (completed keys in the table: %d)", i+1, st, body, n)
		}
	}
}

// TestReviewOpsSkippedVacuumIsNotCounted: idem_cleanup_vacuums_total counts "VACUUMs of the
// key table this process ran after a pass" (docs/operations.md). The cleaner runs
// `VACUUM (SKIP_LOCKED) idem.idempotency_keys`, which, when another session holds a lock
// that conflicts with it (another process's vacuum, as the docs say, an ANALYZE, a CREATE
// INDEX CONCURRENTLY...), skips the table with a WARNING and succeeds: the cleaner counted
// that as a vacuum, and forgot the deletions it owed a vacuum for (unvacuumed was reset), so
// the next pass did not vacuum either. Now the table's vacuum count tells, and the next pass
// vacuums.
func TestReviewOpsSkippedVacuumIsNotCounted(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, url := pgtest.NewPool(t, 4)
	reg := prometheus.NewRegistry()
	c, err := idem.NewCleaner(pool, idem.CleanerOptions{Metrics: idemprom.NewCleanupObserver(reg), Duty: 1,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	pgtest.InsertExpired(t, pool, "alice", 2000)
	holder := pgtest.Connect(t, url)
	tx, err := holder.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// What a vacuum of another session holds (autovacuum, another process's cleaner).
	if _, err := tx.Exec(ctx, `LOCK TABLE idem.idempotency_keys IN SHARE UPDATE EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	var before int64
	if err := pool.QueryRow(ctx, `SELECT pg_stat_get_vacuum_count('idem.idempotency_keys'::regclass)`).Scan(&before); err != nil {
		t.Fatal(err)
	}
	n, ran, err := c.Pass(ctx)
	_ = tx.Rollback(ctx)
	if err != nil || !ran || n != 2000 {
		t.Fatalf("pass: %d %v %v", n, ran, err)
	}
	if v := testutilCounter(t, reg, "idem_cleanup_vacuums_total"); v != 0 {
		t.Fatalf("idem_cleanup_vacuums_total = %v after a pass whose VACUUM (SKIP_LOCKED) skipped the locked table: "+
			"it counts a vacuum that did not run", v)
	}
	// The lock is gone: the next pass that deletes vacuums for both.
	pgtest.InsertExpired(t, pool, "bob", 1)
	if n, ran, err := c.Pass(ctx); err != nil || !ran || n != 1 {
		t.Fatalf("second pass: %d %v %v", n, ran, err)
	}
	var after int64
	if err := pool.QueryRow(ctx, `SELECT pg_stat_get_vacuum_count('idem.idempotency_keys'::regclass)`).Scan(&after); err != nil {
		t.Fatal(err)
	}
	if v := testutilCounter(t, reg, "idem_cleanup_vacuums_total"); v != 1 || after != before+1 {
		t.Fatalf("after the lock: idem_cleanup_vacuums_total = %v, the table's vacuums %d -> %d; want 1 and one more", v, before, after)
	}
}

func testutilCounter(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name {
			return mf.GetMetric()[0].GetCounter().GetValue()
		}
	}
	t.Fatalf("no %s", name)
	return 0
}

// TestActionLabelsAreCapped: past MaxActions distinct actions (a route whose action is the URL
// path makes one per path), the others are counted under "other"; an action that is not
// valid UTF-8 is counted with its bytes replaced, not a panic of the Prometheus client.
func TestActionLabelsAreCapped(t *testing.T) {
	reg := prometheus.NewRegistry()
	o := idemprom.NewObserver(reg)
	o.Count("POST /x/\xff", idem.StateAcquired)
	for i := range idemprom.MaxActions + 100 {
		o.Count(fmt.Sprintf("POST /orders/%d", i), idem.StateAcquired)
		o.LeaseEnded(fmt.Sprintf("POST /orders/%d", i), false, time.Millisecond)
	}
	actions := labelValues(t, reg, "idempotency_requests_total", "action")
	if len(actions) != idemprom.MaxActions+1 || !slices.Contains(actions, "other") || !slices.Contains(actions, "POST /x/\uFFFD") {
		t.Fatalf("%d action labels (other: %v, the replaced one: %v), want %d with both", len(actions),
			slices.Contains(actions, "other"), slices.Contains(actions, "POST /x/\uFFFD"), idemprom.MaxActions+1)
	}
	if v := value(t, reg, "idempotency_requests_total", "action", "other"); v != 101 {
		t.Fatalf("other counted %v, want 101", v)
	}
}

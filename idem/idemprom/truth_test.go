package idemprom_test

// What the metrics and logs tell an operator, from a review of them (D186).

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/idem/idemprom"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// jsonLog is a JSON log destination safe for the heartbeat's goroutines.
type jsonLog struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *jsonLog) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *jsonLog) lines(t *testing.T) []map[string]any {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []map[string]any
	for _, s := range strings.Split(strings.TrimSpace(l.b.String()), "\n") {
		if s == "" {
			continue
		}
		var m map[string]any
		if err := json.Unmarshal([]byte(s), &m); err != nil {
			t.Fatalf("log line %q: %v", s, err)
		}
		out = append(out, m)
	}
	return out
}

// observedWith is a middleware for principal alice on a fresh database, its metrics in reg,
// its log in JSON to log (or discarded when nil).
func observedWith(t *testing.T, log io.Writer) (*pgxpool.Pool, *prometheus.Registry, *idem.Middleware) {
	t.Helper()
	if log == nil {
		log = io.Discard
	}
	pool, _ := pgtest.NewPool(t, 4)
	reg := prometheus.NewRegistry()
	m, err := idem.New(context.Background(), idem.Options{DB: pool, Principal: func(*http.Request) (string, bool) { return "alice", true },
		Metrics: idemprom.NewObserver(reg), Logger: slog.New(slog.NewJSONHandler(log, nil))})
	if err != nil {
		t.Fatal(err)
	}
	return pool, reg, m
}

// lostLeaseRoute is a lease route (lease 1 s) whose handler waits until its lease is lost, then
// answers with answer (0: nothing). The database stops taking extensions meanwhile (idem_extend
// renamed away, as a failover or a dropped grant would): the lease runs out by this process's
// clock, and no other attempt takes the key over.
func lostLeaseRoute(t *testing.T, answer int) (*prometheus.Registry, *jsonLog, string) {
	t.Helper()
	logs := &jsonLog{}
	pool, reg, m := observedWith(t, logs)
	var once sync.Once
	srv := httptest.NewServer(m.Route(idem.Route{Action: "POST /pay", Lease: time.Second})(http.HandlerFunc(
		func(w http.ResponseWriter, r *http.Request) {
			once.Do(func() { pgtest.Exec(t, pool, `ALTER FUNCTION idem.idem_extend RENAME TO idem_extend_gone`) })
			<-r.Context().Done()
			// Back before the answer is recorded or the claim given up.
			pgtest.Exec(t, pool, `ALTER FUNCTION idem.idem_extend_gone RENAME TO idem_extend`)
			if answer != 0 {
				w.WriteHeader(answer)
			}
		})))
	t.Cleanup(srv.Close)
	return reg, logs, srv.URL
}

// TestFirstLostLeaseIsSeenByTheAlert: idempotency_leases_lost_total{action} is created at 0 by
// the route's first lease claim (LeaseClaimed), but a lease lost before any scrape saw that 0
// makes a series born at 1 for Prometheus, and increase() over any window is 0 (it needs two
// samples): the documented IdemLeaseLost alert, `sum(increase(...[15m])) > 0` alone, stayed
// silent for a process's first lost lease (after a deploy or a failover, when one is most
// likely). The alert also fires on a series with no sample in the day before its window and a
// value above 0.
func TestFirstLostLeaseIsSeenByTheAlert(t *testing.T) {
	t.Parallel()
	reg, _, url := lostLeaseRoute(t, 0)
	if got := labelValues(t, reg, "idempotency_leases_lost_total", "action"); len(got) != 0 {
		t.Fatalf("a lost-lease series before any lease: %v", got)
	}
	st, _, body := pgtest.Send(t, context.Background(), "POST", url, `{}`, "Idempotency-Key", "lost-1")
	if st != http.StatusConflict {
		t.Fatalf("a lease that ran out by this process's clock: %d %s, want 409", st, body)
	}
	if v := value(t, reg, "idempotency_leases_lost_total", "action", "POST /pay"); v != 1 {
		t.Fatalf("idempotency_leases_lost_total{action=\"POST /pay\"} = %v after the first lost lease, want 1", v)
	}
	// Lost before a scrape: the alert must see a series that is new in its window.
	ops, err := os.ReadFile("../../docs/operations.md")
	if err != nil {
		t.Fatal(err)
	}
	_, rule, _ := strings.Cut(string(ops), "- alert: IdemLeaseLost")
	_, expr, _ := strings.Cut(rule, "expr: ")
	expr, _, _ = strings.Cut(expr, "\n")
	if !strings.Contains(expr, "increase(idempotency_leases_lost_total[15m])") ||
		!strings.Contains(expr, "unless present_over_time(idempotency_leases_lost_total[1d] offset 15m)") {
		t.Fatalf("IdemLeaseLost's expression %q does not fire on a series born at 1 within its window", expr)
	}
}

// TestLeaseLogLinesCarryTheRequestID: docs/http.md says logs carry the request id. A lease
// that ran out by this process's clock while no other attempt took the key over, whose
// handler still answered, was recorded and logged at WARN without the request id (as were the
// lease's other warnings): the line could not be joined to the request's or to a client's
// report.
func TestLeaseLogLinesCarryTheRequestID(t *testing.T) {
	t.Parallel()
	_, logs, url := lostLeaseRoute(t, http.StatusCreated)
	st, _, body := pgtest.Send(t, context.Background(), "POST", url, `{}`, "Idempotency-Key", "late-1", "X-Request-Id", "req-late-1")
	if st != http.StatusCreated {
		t.Fatalf("a late 2xx that no other attempt took over: %d %s, want 201 (recorded)", st, body)
	}
	found := 0
	for _, l := range logs.lines(t) {
		if msg, _ := l["msg"].(string); !strings.Contains(msg, "lease") {
			continue
		}
		found++
		if l["request_id"] != "req-late-1" || l["key_hash"] == nil {
			t.Errorf("a lease's log line without the request id or the key's hash: %v", l)
		}
	}
	if found == 0 {
		t.Fatalf("no lease log line; the log: %v", logs.lines(t))
	}
}

// TestDuplicatePastAnOuterDeadlineIsBusy: a duplicate that waited in this process for the
// first request with its key, and whose request context ended by a deadline (an outer
// middleware's timeout), was answered 503 store_unavailable and counted store_error: one
// client with a short deadline retrying a slow key fired IdemStoreErrors, the database fine.
// Only a disconnect (context.Canceled) was told 409. docs/http.md: 409 request_in_progress
// with Retry-After, "and so when the request's context ends first"; counted busy.
func TestDuplicatePastAnOuterDeadlineIsBusy(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, reg, m := observedWith(t, nil)
	release := make(chan struct{})
	started := make(chan struct{}, 1)
	inner := m.Route(idem.Route{Action: "POST /slow"})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case started <- struct{}{}:
		default:
		}
		<-release
		w.WriteHeader(http.StatusCreated)
	}))
	outer := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		c, cancel := context.WithTimeout(r.Context(), 300*time.Millisecond)
		defer cancel()
		inner.ServeHTTP(w, r.WithContext(c))
	})
	srv := httptest.NewServer(outer)
	defer srv.Close()
	first := make(chan int, 1)
	go func() {
		st, _, _ := pgtest.Send(t, ctx, "POST", srv.URL, `{}`, "Idempotency-Key", "deadline-1")
		first <- st
	}()
	<-started // the first holds the key until released
	st, hdr, body := pgtest.Send(t, ctx, "POST", srv.URL, `{}`, "Idempotency-Key", "deadline-1")
	close(release)
	<-first
	storeErr := value(t, reg, "idempotency_requests_total", "state", "store_error")
	busy := value(t, reg, "idempotency_requests_total", "state", "busy")
	if st != http.StatusConflict || hdr.Get("Retry-After") == "" || storeErr != 0 || busy != 1 {
		t.Fatalf("a duplicate past its outer deadline: %d (Retry-After %q) %s, counted store_error %v busy %v; "+
			"want 409 with Retry-After, counted busy", st, hdr.Get("Retry-After"), body, storeErr, busy)
	}
}

// TestRerunAfterDeadlockCountsOneAcquired: acquired is counted once per fresh claim. Process A
// claimed a key; its handler met a deadlock (40P01), and the unit of work rolled back, claim
// and all, and ran again. Meanwhile process B, waiting on the key's row, claimed it, answered
// and committed; A's second run replayed B's answer. A counted acquired (from its first run)
// and replayed, B acquired: two fresh claims for the one that stuck.
func TestRerunAfterDeadlockCountsOneAcquired(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 8)
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	principal := func(*http.Request) (string, bool) { return "alice", true }
	regA, regB := prometheus.NewRegistry(), prometheus.NewRegistry()
	a, err := idem.New(ctx, idem.Options{DB: pool, Principal: principal, Metrics: idemprom.NewObserver(regA), Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	b, err := idem.New(ctx, idem.Options{DB: pool, Principal: principal, Metrics: idemprom.NewObserver(regB), Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	var runsA atomic.Int32
	aClaimed, bWaits := make(chan struct{}), make(chan struct{})
	srvA := httptest.NewServer(a.Route(idem.Route{Action: "POST /t"})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if runsA.Add(1) == 1 {
			close(aClaimed)
			<-bWaits // B's claim waits on the key's row, which A's first run holds
			failByDeadlock(t, w, r)
			return
		}
		w.WriteHeader(http.StatusCreated)
	})))
	defer srvA.Close()
	srvB := httptest.NewServer(b.Route(idem.Route{Action: "POST /t"})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusCreated)
	})))
	defer srvB.Close()

	stA := make(chan int, 1)
	go func() {
		st, _, _ := pgtest.Send(t, ctx, "POST", srvA.URL+"/t", `{"n":1}`, "Idempotency-Key", "rerun-1")
		stA <- st
	}()
	<-aClaimed
	stB := make(chan int, 1)
	go func() {
		st, _, _ := pgtest.Send(t, ctx, "POST", srvB.URL+"/t", `{"n":1}`, "Idempotency-Key", "rerun-1")
		stB <- st
	}()
	// B's claim waits on the row: not its first try, which gives up after 5 ms (a Probe), then
	// claims again with a wait. Seen in that first try, A's rerun could claim the key between
	// B's two tries, and B replayed A's (a CI run under load).
	pgtest.WaitFor(t, pool, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'
		AND clock_timestamp() - query_start > interval '100 milliseconds'`)
	close(bWaits)
	sa, sb := <-stA, <-stB
	acqA, repA := value(t, regA, "idempotency_requests_total", "state", "acquired"), value(t, regA, "idempotency_requests_total", "state", "replayed")
	acqB, repB := value(t, regB, "idempotency_requests_total", "state", "acquired"), value(t, regB, "idempotency_requests_total", "state", "replayed")
	if sa != http.StatusCreated || sb != http.StatusCreated || runsA.Load() != 1 || repA != 1 || repB != 0 {
		t.Fatalf("A %d after %d runs of its handler (replayed %v), B %d (replayed %v): want B's claim to stick and A's rerun to replay it",
			sa, runsA.Load(), repA, sb, repB)
	}
	if acqA+acqB != 1 {
		t.Fatalf("one fresh claim stuck, counted acquired %v times (A %v, B %v): A's rolled-back claim counted", acqA+acqB, acqA, acqB)
	}
}

// TestDurationLeavesOutTheUpload: idempotency_request_duration_seconds started when the
// request entered the middleware, before its body arrived: a client that uploaded slowly (or
// a hostile one dribbling bytes) made the idempotency layer look slow. It runs from the body
// read now; here a body that took a second to arrive, and a claim and handler of milliseconds.
func TestDurationLeavesOutTheUpload(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, reg, m := observedWith(t, nil)
	srv := httptest.NewServer(m.Route(idem.Route{Action: "POST /t"})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusCreated)
	})))
	defer srv.Close()
	pr, pw := io.Pipe()
	go func() {
		_, _ = pw.Write([]byte(`{"amount":`))
		time.Sleep(time.Second)
		_, _ = pw.Write([]byte(`1}`))
		_ = pw.Close()
	}()
	req, _ := http.NewRequestWithContext(ctx, "POST", srv.URL, pr)
	req.Header.Set("Idempotency-Key", "slow-body")
	req.Header.Set("Content-Type", "application/json")
	began := time.Now()
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	took := time.Since(began)
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusCreated || took < time.Second {
		t.Fatalf("status %d after %v", resp.StatusCode, took)
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var sum float64
	var n uint64
	for _, mf := range mfs {
		if mf.GetName() == "idempotency_request_duration_seconds" {
			for _, mm := range mf.GetMetric() {
				sum += mm.GetHistogram().GetSampleSum()
				n += mm.GetHistogram().GetSampleCount()
			}
		}
	}
	if n != 1 || sum >= 0.5 {
		t.Fatalf("%d observations summing %.2fs for a request whose upload took a second and the rest milliseconds", n, sum)
	}
}

// failByDeadlock ends a handler's run as a deadlock would: a statement of the request's
// transaction fails with 40P01 (the unit of work runs again), and the handler answers 500.
func failByDeadlock(t *testing.T, w http.ResponseWriter, r *http.Request) {
	t.Helper()
	if _, err := idem.TxFrom(r.Context()).Exec(r.Context(), `DO $$ BEGIN RAISE EXCEPTION 'deadlock detected' USING ERRCODE = '40P01'; END $$`); err == nil {
		t.Error("the deadlock was not raised")
	}
	w.WriteHeader(http.StatusInternalServerError)
}

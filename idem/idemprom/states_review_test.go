package idemprom_test

// Second round of metrics and logs against docs/operations.md ("Metrics") and docs/http.md
// ("Metrics, traces and logs"): each documented counter moves exactly as documented.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
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

// srStates is every state's count of idempotency_requests_total (all actions).
func srStates(t *testing.T, reg *prometheus.Registry) map[string]float64 {
	t.Helper()
	out := map[string]float64{}
	for _, s := range []string{"acquired", "replayed", "busy", "key_reused", "store_error", "oversize"} {
		out[s] = value(t, reg, "idempotency_requests_total", "state", s)
	}
	return out
}

// srDurations is the sample count of idempotency_request_duration_seconds, all states.
func srDurations(t *testing.T, reg *prometheus.Registry) uint64 {
	t.Helper()
	var n uint64
	if mf := familiesOf(t, reg)["idempotency_request_duration_seconds"]; mf != nil {
		for _, m := range mf.GetMetric() {
			n += m.GetHistogram().GetSampleCount()
		}
	}
	return n
}

// srGauge is the value of an unlabelled gauge or counter of reg (-1 when absent).
func srGauge(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	mf := familiesOf(t, reg)[name]
	if mf == nil || len(mf.GetMetric()) == 0 {
		return -1
	}
	m := mf.GetMetric()[0]
	if m.GetGauge() != nil {
		return m.GetGauge().GetValue()
	}
	return m.GetCounter().GetValue()
}

// srMiddleware is a middleware for alice on a fresh database with its metrics and Gate in reg,
// its log in JSON to logs when not nil.
func srMiddleware(t *testing.T, logs io.Writer, set func(*idem.Options)) (*pgxpool.Pool, *prometheus.Registry, *idem.Middleware) {
	t.Helper()
	if logs == nil {
		logs = io.Discard
	}
	pool, _ := pgtest.NewPool(t, 6)
	reg := prometheus.NewRegistry()
	o := idem.Options{DB: pool, Principal: func(*http.Request) (string, bool) { return "alice", true },
		Metrics: idemprom.NewObserver(reg), Logger: slog.New(slog.NewJSONHandler(logs, nil))}
	if set != nil {
		set(&o)
	}
	m, err := idem.New(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	idemprom.RegisterGate(reg, m)
	return pool, reg, m
}

// srWantDelta checks that the states moved by exactly want since before.
func srWantDelta(t *testing.T, what string, before, after map[string]float64, want map[string]float64) {
	t.Helper()
	for s, a := range after {
		if d := a - before[s]; d != want[s] {
			t.Errorf("%s: state %s moved by %v, want %v (before %v, after %v)", what, s, d, want[s], before, after)
		}
	}
}

func srGaugesAtZero(t *testing.T, reg *prometheus.Registry) {
	t.Helper()
	for _, name := range []string{"idempotency_waiting_duplicates", "idempotency_waiting_duplicate_bytes"} {
		if v := srGauge(t, reg, name); v != 0 {
			t.Errorf("%s = %v after every request ended, want 0", name, v)
		}
	}
}

// TestStatesTransactionalOutcomes: on a transactional route, every outcome moves the
// documented states by exactly one each (oversize on top of acquired), and times the request
// once: a fresh key, its replay, a key reused, an oversize answer, a final error stored and
// replayed, a 5xx not stored (and its retry, a fresh claim again), a panic, a one-time secret
// (not oversize) and its replay.
func TestStatesTransactionalOutcomes(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, reg, m := srMiddleware(t, nil, func(o *idem.Options) { o.MaxStoredBodyBytes = 64 })
	srv := httptest.NewServer(m.Route(idem.Route{Action: "POST /t"})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var in struct{ Mode string }
		b, _ := io.ReadAll(r.Body)
		_ = json.Unmarshal(b, &in)
		switch in.Mode {
		case "big":
			w.WriteHeader(http.StatusCreated)
			_, _ = w.Write([]byte(strings.Repeat("x", 1000)))
		case "final":
			w.WriteHeader(http.StatusBadRequest)
		case "fail":
			w.WriteHeader(http.StatusInternalServerError)
		case "panic":
			panic("boom")
		case "secret":
			idem.MarkOneTimeSecret(r.Context())
			w.WriteHeader(http.StatusCreated)
			_, _ = w.Write([]byte(strings.Repeat("s", 1000)))
		default:
			w.WriteHeader(http.StatusCreated)
		}
	})))
	defer srv.Close()
	steps := []struct {
		what, key, body string
		status          int
		want            map[string]float64
	}{
		{"fresh", "k1", `{"mode":"ok"}`, 201, map[string]float64{"acquired": 1}},
		{"replay", "k1", `{"mode":"ok"}`, 201, map[string]float64{"replayed": 1}},
		{"key reused", "k1", `{"mode":"ok","x":1}`, 422, map[string]float64{"key_reused": 1}},
		{"oversize", "k2", `{"mode":"big"}`, 201, map[string]float64{"acquired": 1, "oversize": 1}},
		{"oversize replay", "k2", `{"mode":"big"}`, 0, map[string]float64{"replayed": 1}},
		{"final error", "k3", `{"mode":"final"}`, 400, map[string]float64{"acquired": 1}},
		{"final replay", "k3", `{"mode":"final"}`, 400, map[string]float64{"replayed": 1}},
		{"5xx not stored", "k4", `{"mode":"fail"}`, 500, map[string]float64{"acquired": 1}},
		{"5xx retried", "k4", `{"mode":"fail"}`, 500, map[string]float64{"acquired": 1}},
		{"panic", "k5", `{"mode":"panic"}`, 500, map[string]float64{"acquired": 1}},
		{"secret", "k6", `{"mode":"secret"}`, 201, map[string]float64{"acquired": 1}},
		{"secret replay", "k6", `{"mode":"secret"}`, 0, map[string]float64{"replayed": 1}},
	}
	for _, s := range steps {
		before, d0 := srStates(t, reg), srDurations(t, reg)
		st, _, body := pgtest.Send(t, ctx, "POST", srv.URL, s.body, "Idempotency-Key", s.key, "Content-Type", "application/json")
		if s.status != 0 && st != s.status {
			t.Errorf("%s: status %d %s, want %d", s.what, st, body, s.status)
		}
		srWantDelta(t, s.what, before, srStates(t, reg), s.want)
		if d := srDurations(t, reg) - d0; d != 1 {
			t.Errorf("%s: timed %d times, want once", s.what, d)
		}
	}
	srGaugesAtZero(t, reg)
	if v := srGauge(t, reg, "idempotency_coalesced_total"); v != 0 {
		t.Errorf("coalesced %v with no duplicate in flight", v)
	}
	if v := srGauge(t, reg, "idempotency_refused_total"); v != 0 {
		t.Errorf("refused %v with no duplicate in flight", v)
	}
}

// TestStatesAbortHandlerCountsAcquired: a transactional handler that panics with
// http.ErrAbortHandler (net/http's way to drop the connection) made a fresh claim, rolled back
// with its work as a 5xx's is. operations.md: acquired is counted "once per fresh claim, when
// it is made"; a 5xx's rolled-back claim counts, and its retry counts again. The aborted one
// was counted in no state, and not timed.
func TestStatesAbortHandlerCountsAcquired(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, reg, m := srMiddleware(t, nil, nil)
	var runs sync.Map
	h := m.Route(idem.Route{Action: "POST /abort"})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Store(r.Header.Get("Idempotency-Key"), true)
		panic(http.ErrAbortHandler)
	}))
	srv := httptest.NewServer(h)
	defer srv.Close()
	srv.Config.ErrorLog = nil
	req, _ := http.NewRequestWithContext(ctx, "POST", srv.URL, strings.NewReader(`{}`))
	req.Header.Set("Idempotency-Key", "abort-1")
	if res, err := http.DefaultClient.Do(req); err == nil {
		res.Body.Close()
		t.Logf("answered %d (an aborted handler drops the connection)", res.StatusCode)
	}
	if _, ok := runs.Load("abort-1"); !ok {
		t.Fatal("the handler did not run")
	}
	got := srStates(t, reg)
	if got["acquired"] != 1 || srDurations(t, reg) != 1 {
		t.Errorf("an aborted handler's fresh claim: states %v, timed %d times; want acquired 1, timed once", got, srDurations(t, reg))
	}
	srGaugesAtZero(t, reg)
}

// TestStatesUnknownPrincipalIsNotAStoreError: operations.md counts store_error when "the
// database failed and the client got a 5xx", and IdemStoreErrors pages on its ratio ("the
// database failing under the API"). A principal the application's foreign key does not know
// is answered 401 principal_unknown (docs/http.md): the client's failure, not the store's. It
// was counted store_error; it is counted in no state now, and not timed.
func TestStatesUnknownPrincipalIsNotAStoreError(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, reg, m := srMiddleware(t, nil, nil)
	pgtest.Exec(t, pool, `CREATE TABLE sr_principals (id text PRIMARY KEY);
		ALTER TABLE idem.idempotency_keys ADD FOREIGN KEY (principal_id) REFERENCES sr_principals (id)`)
	srv := httptest.NewServer(m.Route(idem.Route{Action: "POST /t"})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusCreated)
	})))
	defer srv.Close()
	st, _, body := pgtest.Send(t, ctx, "POST", srv.URL, `{}`, "Idempotency-Key", "who-1")
	if st != http.StatusUnauthorized || !strings.Contains(body, "principal_unknown") {
		t.Fatalf("an unknown principal: %d %s, want 401 principal_unknown", st, body)
	}
	if got := srStates(t, reg); got["store_error"] != 0 {
		t.Errorf("a 401 principal_unknown counted store_error (states %v): the database did not fail and the client got no 5xx", got)
	}
}

// srHeld is a transactional route whose first request holds its key until release is closed.
func srHeld(t *testing.T, m *idem.Middleware) (url string, started <-chan struct{}, release chan struct{}) {
	t.Helper()
	s := make(chan struct{}, 1)
	release = make(chan struct{})
	srv := httptest.NewServer(m.Route(idem.Route{Action: "POST /held"})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case s <- struct{}{}:
		default:
		}
		<-release
		w.WriteHeader(http.StatusCreated)
	})))
	t.Cleanup(srv.Close)
	return srv.URL, s, release
}

func srWaitForWaiting(t *testing.T, m *idem.Middleware, n int64) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for m.GateStats().Waiting != n {
		if time.Now().After(deadline) {
			t.Fatalf("Waiting = %d, want %d", m.GateStats().Waiting, n)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestStatesDuplicatesOnATransactionalRoute: a duplicate that waited in this process and got
// the answer counts coalesced and replayed; one whose wait ran out counts coalesced, refused and
// busy; one refused because the waiting duplicates held MaxWaitingBytes counts refused and busy
// (not coalesced: it did not wait); a client that went away while it waited counts busy, not
// refused. The gauges go back to 0.
func TestStatesDuplicatesOnATransactionalRoute(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	body := `{"pad":"` + strings.Repeat("p", 900) + `"}`
	_, reg, m := srMiddleware(t, nil, func(o *idem.Options) {
		o.MaxBodyBytes = 1024
		o.MaxWaitingBytes = 1024 + 4096
		o.DuplicateWait = 5 * time.Second
	})
	url, started, release := srHeld(t, m)
	first := make(chan int, 1)
	go func() {
		st, _, _ := pgtest.Send(t, ctx, "POST", url, body, "Idempotency-Key", "d1")
		first <- st
	}()
	<-started
	second := make(chan int, 1)
	go func() {
		st, _, _ := pgtest.Send(t, ctx, "POST", url, body, "Idempotency-Key", "d1")
		second <- st
	}()
	srWaitForWaiting(t, m, 1)
	if v := srGauge(t, reg, "idempotency_waiting_duplicates"); v != 1 {
		t.Errorf("idempotency_waiting_duplicates = %v while one waits", v)
	}
	if v := srGauge(t, reg, "idempotency_waiting_duplicate_bytes"); v != float64(len(body)+4096) {
		t.Errorf("idempotency_waiting_duplicate_bytes = %v while one of %d bytes waits, want %d", v, len(body), len(body)+4096)
	}
	before := srStates(t, reg)
	// The third finds the waiting room full.
	st, hdr, b := pgtest.Send(t, ctx, "POST", url, body, "Idempotency-Key", "d1")
	if st != http.StatusConflict || hdr.Get("Retry-After") == "" {
		t.Errorf("a duplicate past MaxWaitingBytes: %d %s", st, b)
	}
	srWantDelta(t, "full waiting room", before, srStates(t, reg), map[string]float64{"busy": 1})
	if v := srGauge(t, reg, "idempotency_refused_total"); v != 1 {
		t.Errorf("refused_total = %v after a duplicate past MaxWaitingBytes, want 1", v)
	}
	close(release)
	if s1, s2 := <-first, <-second; s1 != 201 || s2 != 201 {
		t.Fatalf("first %d, second %d", s1, s2)
	}
	got := srStates(t, reg)
	if got["acquired"] != 1 || got["replayed"] != 1 || got["busy"] != 1 {
		t.Errorf("states %v: want acquired 1, replayed 1 (the coalesced duplicate), busy 1 (the refused one)", got)
	}
	if v := srGauge(t, reg, "idempotency_coalesced_total"); v != 1 {
		t.Errorf("coalesced_total = %v, want 1 (the second waited in this process)", v)
	}
	if v := srGauge(t, reg, "idempotency_refused_total"); v != 1 {
		t.Errorf("refused_total = %v, want 1", v)
	}
	srGaugesAtZero(t, reg)

	// A duplicate whose client goes away while it waits: busy, coalesced, not refused.
	_, reg2, m2 := srMiddleware(t, nil, func(o *idem.Options) { o.DuplicateWait = 5 * time.Second })
	url2, started2, release2 := srHeld(t, m2)
	go func() { pgtest.Send(t, ctx, "POST", url2, `{}`, "Idempotency-Key", "gone") }()
	<-started2
	cctx, cancel := context.WithCancel(ctx)
	gone := make(chan error, 1)
	go func() {
		req, _ := http.NewRequestWithContext(cctx, "POST", url2, strings.NewReader(`{}`))
		req.Header.Set("Idempotency-Key", "gone")
		res, err := http.DefaultClient.Do(req)
		if err == nil {
			res.Body.Close()
		}
		gone <- err
	}()
	srWaitForWaiting(t, m2, 1)
	cancel()
	<-gone
	srWaitForWaiting(t, m2, 0)
	deadline := time.Now().Add(5 * time.Second)
	for srStates(t, reg2)["busy"] != 1 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	// A duplicate whose wait runs out: coalesced, refused, busy.
	_, reg3, m3 := srMiddleware(t, nil, func(o *idem.Options) { o.DuplicateWait = 300 * time.Millisecond })
	url3, started3, release3 := srHeld(t, m3)
	go func() { pgtest.Send(t, ctx, "POST", url3, `{}`, "Idempotency-Key", "late") }()
	<-started3
	st, _, b = pgtest.Send(t, ctx, "POST", url3, `{}`, "Idempotency-Key", "late")
	close(release2)
	close(release3)
	if st != http.StatusConflict {
		t.Errorf("a duplicate past DuplicateWait: %d %s", st, b)
	}
	if got := srStates(t, reg2); got["busy"] != 1 {
		t.Errorf("a client gone while it waited: states %v, want busy 1", got)
	}
	if v := srGauge(t, reg2, "idempotency_refused_total"); v != 0 {
		t.Errorf("a client gone while it waited counted refused %v: it was not answered 409 by the Gate", v)
	}
	if v := srGauge(t, reg2, "idempotency_coalesced_total"); v != 1 {
		t.Errorf("a client gone while it waited: coalesced %v, want 1 (it waited in this process)", v)
	}
	if got := srStates(t, reg3); got["busy"] != 1 {
		t.Errorf("a duplicate past its wait: states %v, want busy 1", got)
	}
	if c, r := srGauge(t, reg3, "idempotency_coalesced_total"), srGauge(t, reg3, "idempotency_refused_total"); c != 1 || r != 1 {
		t.Errorf("a duplicate past its wait: coalesced %v, refused %v; want 1 and 1", c, r)
	}
	time.Sleep(100 * time.Millisecond)
	srGaugesAtZero(t, reg2)
	srGaugesAtZero(t, reg3)
}

// TestStatesSerializationRerunCountsOnce: a unit of work run again after a serialization
// failure (40001) is one request: acquired once, timed once.
func TestStatesSerializationRerunCountsOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, reg, m := srMiddleware(t, nil, nil)
	var runs atomic.Int32
	srv := httptest.NewServer(m.Route(idem.Route{Action: "POST /t"})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if runs.Add(1) == 1 {
			_, err := idem.TxFrom(r.Context()).Exec(r.Context(), `DO $$ BEGIN RAISE EXCEPTION 'could not serialize' USING ERRCODE = '40001'; END $$`)
			if err == nil {
				t.Error("40001 not raised")
			}
			w.WriteHeader(http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusCreated)
	})))
	defer srv.Close()
	st, _, body := pgtest.Send(t, ctx, "POST", srv.URL, `{}`, "Idempotency-Key", "ser-1")
	if st != 201 || runs.Load() != 2 {
		t.Fatalf("%d %s after %d runs", st, body, runs.Load())
	}
	if got := srStates(t, reg); got["acquired"] != 1 || got["store_error"] != 0 || srDurations(t, reg) != 1 {
		t.Errorf("states %v, timed %d: want acquired 1 once", got, srDurations(t, reg))
	}
}

// TestStatesLeaseRouteLifecycle: a lease route's claim, its heartbeat, its answer: acquired
// once, extensions counted, the lease not lost (its series at 0), the work timed once, the
// request timed once; the key gauges show the claim in progress while it runs, none after.
func TestStatesLeaseRouteLifecycle(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, reg, m := srMiddleware(t, nil, nil)
	reg.MustRegister(idemprom.NewHealthCollector(pool, time.Nanosecond, nil))
	working := make(chan struct{})
	release := make(chan struct{})
	srv := httptest.NewServer(m.Route(idem.Route{Action: "POST /pay", Lease: time.Second})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		close(working)
		<-release
		w.WriteHeader(http.StatusCreated)
	})))
	defer srv.Close()
	done := make(chan int, 1)
	go func() {
		st, _, _ := pgtest.Send(t, ctx, "POST", srv.URL, `{}`, "Idempotency-Key", "p1")
		done <- st
	}()
	<-working
	if v := srGauge(t, reg, "idempotency_keys_in_progress"); v != 1 {
		t.Errorf("idempotency_keys_in_progress = %v while a lease claim works, want 1", v)
	}
	time.Sleep(1200 * time.Millisecond) // three heartbeats at least
	close(release)
	if st := <-done; st != 201 {
		t.Fatalf("status %d", st)
	}
	if v := value(t, reg, "idempotency_lease_extensions_total", "action", "POST /pay"); v < 2 || v > 5 {
		t.Errorf("extensions %v over 1.2 s of a 1 s lease (one every third), want 3 or so", v)
	}
	if v := labelValues(t, reg, "idempotency_leases_lost_total", "action"); len(v) != 1 {
		t.Errorf("leases_lost series %v, want the action's, at 0", v)
	}
	if v := value(t, reg, "idempotency_leases_lost_total", "action", "POST /pay"); v != 0 {
		t.Errorf("leases lost %v", v)
	}
	if n := workSamples(t, reg, "POST /pay"); n != 1 {
		t.Errorf("work timed %d times, want 1", n)
	}
	if got := srStates(t, reg); got["acquired"] != 1 || srDurations(t, reg) != 1 {
		t.Errorf("states %v, timed %d", got, srDurations(t, reg))
	}
	if v := srGauge(t, reg, "idempotency_keys_in_progress"); v != 0 {
		t.Errorf("idempotency_keys_in_progress = %v after the answer, want 0", v)
	}
	if v := srGauge(t, reg, "idempotency_oldest_in_progress_seconds"); v != 0 {
		t.Errorf("idempotency_oldest_in_progress_seconds = %v with none in progress, want 0", v)
	}
	srGaugesAtZero(t, reg)
}

// TestStatesLeaseDuplicateIsNotCoalesced: a duplicate of a lease route's request working in
// this process waits for its answer (without a connection, counted in
// idempotency_waiting_duplicates while it waits) and gets it; idempotency_coalesced_total counts
// the waits in the Gate's line only, which docs/operations.md now says plainly (a review read
// "found their key in flight in this process and waited for it" as covering this wait too).
func TestStatesLeaseDuplicateIsNotCoalesced(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, reg, m := srMiddleware(t, nil, nil)
	working := make(chan struct{})
	release := make(chan struct{})
	srv := httptest.NewServer(m.Route(idem.Route{Action: "POST /pay", Lease: 5 * time.Second})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		close(working)
		<-release
		w.WriteHeader(http.StatusCreated)
	})))
	defer srv.Close()
	first := make(chan int, 1)
	go func() {
		st, _, _ := pgtest.Send(t, ctx, "POST", srv.URL, `{}`, "Idempotency-Key", "c1")
		first <- st
	}()
	<-working
	second := make(chan int, 1)
	go func() {
		st, _, _ := pgtest.Send(t, ctx, "POST", srv.URL, `{}`, "Idempotency-Key", "c1")
		second <- st
	}()
	srWaitForWaiting(t, m, 1)
	close(release)
	if s1, s2 := <-first, <-second; s1 != 201 || s2 != 201 {
		t.Fatalf("first %d, second %d", s1, s2)
	}
	got := srStates(t, reg)
	if got["acquired"] != 1 || got["replayed"] != 1 {
		t.Errorf("states %v", got)
	}
	if v := srGauge(t, reg, "idempotency_coalesced_total"); v != 0 {
		t.Errorf("idempotency_coalesced_total = %v after a duplicate waited on a lease's answer, want 0 (docs/operations.md)", v)
	}
	srGaugesAtZero(t, reg)
}

// TestStatesLostLeaseLoggedAtError: docs/http.md: "A lost lease, and a failure to record or
// release a lease's answer, are logged at error level with the claim's token and how many
// extensions it made." A lease that ran out by this process's clock (no extension landed) is
// counted in idempotency_leases_lost_total; its line was a WARN, and is at ERROR now, with the
// claim's token and the extensions.
func TestStatesLostLeaseLoggedAtError(t *testing.T) {
	t.Parallel()
	reg, logs, url := lostLeaseRoute(t, 0)
	st, _, body := pgtest.Send(t, context.Background(), "POST", url, `{}`, "Idempotency-Key", "lost-sr")
	if st != http.StatusConflict {
		t.Fatalf("%d %s, want 409", st, body)
	}
	if v := value(t, reg, "idempotency_leases_lost_total", "action", "POST /pay"); v != 1 {
		t.Fatalf("leases lost %v, want 1", v)
	}
	var lines []string
	ok := false
	for _, l := range logs.lines(t) {
		msg, _ := l["msg"].(string)
		if !strings.Contains(msg, "lease") {
			continue
		}
		lines = append(lines, fmt.Sprintf("%v %q extensions=%v attempt=%v", l["level"], msg, l["extensions"], l["attempt"]))
		if l["level"] == "ERROR" && l["extensions"] != nil && l["attempt"] != nil {
			ok = true
		}
	}
	if !ok {
		t.Errorf("a lost lease (counted in idempotency_leases_lost_total) logged no ERROR line with its token and extensions: %v", lines)
	}
}

// TestStatesShutdownDuringWork: Shutdown's deadline ends a transactional unit of work: the
// client gets 503 shutting_down, counted acquired (the claim was made) and nothing else, timed
// once; the gauges at 0.
func TestStatesShutdownDuringWork(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, reg, m := srMiddleware(t, nil, nil)
	working := make(chan struct{})
	srv := httptest.NewServer(m.Route(idem.Route{Action: "POST /t"})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		close(working)
		<-r.Context().Done() // returns without writing: the client is told 503 shutting_down
	})))
	defer srv.Close()
	done := make(chan int, 1)
	go func() {
		st, _, _ := pgtest.Send(t, ctx, "POST", srv.URL, `{}`, "Idempotency-Key", "sd1")
		done <- st
	}()
	<-working
	sctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	err := m.Shutdown(sctx)
	cancel()
	if err == nil || !errors.Is(err, context.DeadlineExceeded) {
		t.Logf("Shutdown: %v", err)
	}
	if st := <-done; st != http.StatusServiceUnavailable {
		t.Errorf("status %d, want 503 shutting_down", st)
	}
	if got := srStates(t, reg); got["acquired"] != 1 || got["store_error"] != 0 || got["busy"] != 0 || srDurations(t, reg) != 1 {
		t.Errorf("states %v, timed %d: want acquired 1 alone, timed once", got, srDurations(t, reg))
	}
	srGaugesAtZero(t, reg)
}

// TestStatesCleanerSeries: a pass that deletes counts done and its keys; a pass while
// another session holds the cleanup lock counts skipped, deletes nothing and is not timed; a
// pass whose context ended counts stopped and is timed; the backlog gauge follows.
func TestStatesCleanerSeries(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, url := pgtest.NewPool(t, 4)
	reg := prometheus.NewRegistry()
	c, err := idem.NewCleaner(pool, idem.CleanerOptions{Metrics: idemprom.NewCleanupObserver(reg),
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	reg.MustRegister(idemprom.NewHealthCollector(pool, time.Nanosecond, nil))
	pgtest.InsertExpired(t, pool, "alice", 7)
	if v := srGauge(t, reg, "idempotency_cleanup_backlog"); v != 7 {
		t.Errorf("backlog %v with 7 expired keys", v)
	}
	passes := func(result string) float64 { return value(t, reg, "idem_cleanup_passes_total", "result", result) }
	timed := func() uint64 {
		return familiesOf(t, reg)["idem_cleanup_pass_duration_seconds"].GetMetric()[0].GetHistogram().GetSampleCount()
	}
	// Held by another session: skipped.
	holder := pgtest.Connect(t, url)
	if _, err := holder.Exec(ctx, `BEGIN`); err != nil {
		t.Fatal(err)
	}
	if _, err := holder.Exec(ctx, `SELECT pg_advisory_xact_lock($1)`, idem.CleanupLock); err != nil {
		t.Fatal(err)
	}
	n, ran, err := c.Pass(ctx)
	if err != nil || ran || n != 0 {
		t.Errorf("a pass under another's lock: %d, ran %v, %v", n, ran, err)
	}
	if passes("skipped") != 1 || timed() != 0 || srGauge(t, reg, "idem_cleanup_deleted_total") != 0 {
		t.Errorf("skipped %v, timed %d, deleted %v: want 1, 0, 0", passes("skipped"), timed(), srGauge(t, reg, "idem_cleanup_deleted_total"))
	}
	if _, err := holder.Exec(ctx, `COMMIT`); err != nil {
		t.Fatal(err)
	}
	n, ran, err = c.Pass(ctx)
	if err != nil || !ran || n != 7 {
		t.Errorf("a pass: %d, ran %v, %v", n, ran, err)
	}
	if passes("done") != 1 || timed() != 1 || srGauge(t, reg, "idem_cleanup_deleted_total") != 7 {
		t.Errorf("done %v, timed %d, deleted %v: want 1, 1, 7", passes("done"), timed(), srGauge(t, reg, "idem_cleanup_deleted_total"))
	}
	if v := srGauge(t, reg, "idempotency_cleanup_backlog"); v != 0 {
		t.Errorf("backlog %v after the pass", v)
	}
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	_, _, err = c.Pass(cctx)
	if err == nil {
		t.Errorf("a pass on an ended context: no error")
	}
	if passes("stopped") != 1 || passes("failed") != 0 || timed() != 2 {
		t.Errorf("stopped %v failed %v timed %d: want 1, 0, 2", passes("stopped"), passes("failed"), timed())
	}
}

// TestStatesHealthGaugesOfADeadLease: a lease claim whose work died (nobody extends it):
// idempotency_keys_in_progress 1, idempotency_leases_run_out 1 once its lease ran out, the
// oldest claim's age above the lease.
func TestStatesHealthGaugesOfADeadLease(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	reg := prometheus.NewRegistry()
	reg.MustRegister(idemprom.NewHealthCollector(pool, time.Nanosecond, nil))
	fp := idem.ComputeFingerprint("POST", "/pay", []byte(`{}`))
	// a lease of 3 s: the first read comes within it even on a loaded machine
	claimed := time.Now()
	d, err := idem.Begin(ctx, pool, idem.Claim{Principal: "alice", Key: "dead-1", Action: "POST /pay", Fingerprint: fp.Sum, Lease: 3 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	// The claim's own time is between claimed and returned (a loaded machine may take its
	// connection late): the looks past the lease are timed from returned, the first look from
	// claimed.
	returned := time.Now()
	if d.Outcome != "claimed" {
		t.Logf("outcome %v", d.Outcome)
	}
	a, r := srGauge(t, reg, "idempotency_keys_in_progress"), srGauge(t, reg, "idempotency_leases_run_out")
	if took := time.Since(claimed); took > 3*time.Second {
		t.Fatalf("the first read came %s after the claim, past its lease: the test did not see the lease live", took)
	}
	if a != 1 || r != 0 {
		t.Errorf("a live lease: in progress %v, run out %v; want 1, 0", a, r)
	}
	time.Sleep(time.Until(returned.Add(3300 * time.Millisecond)))
	if a, r := srGauge(t, reg, "idempotency_keys_in_progress"), srGauge(t, reg, "idempotency_leases_run_out"); a != 1 || r != 1 {
		t.Errorf("a dead lease: in progress %v, run out %v; want 1, 1", a, r)
	}
	if v := srGauge(t, reg, "idempotency_oldest_in_progress_seconds"); v < 3.2 || v > 15 {
		t.Errorf("oldest in progress %v s, want about 3.3", v)
	}
}

// TestStatesRequestLogLine: docs/http.md: "Logs carry the state, the action, the request id
// and key_hash ...: never a raw key, never a body." A key reused and a refused duplicate each
// log one line with all four.
func TestStatesRequestLogLine(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	logs := &jsonLog{}
	_, _, m := srMiddleware(t, logs, nil)
	srv := httptest.NewServer(m.Route(idem.Route{Action: "POST /t"})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusCreated)
	})))
	defer srv.Close()
	const key = "secret-key-sr"
	pgtest.Send(t, ctx, "POST", srv.URL, `{"a":"body-one"}`, "Idempotency-Key", key, "X-Request-Id", "r1")
	st, _, _ := pgtest.Send(t, ctx, "POST", srv.URL, `{"a":"body-two"}`, "Idempotency-Key", key, "X-Request-Id", "r2")
	if st != http.StatusUnprocessableEntity {
		t.Fatalf("status %d", st)
	}
	found := 0
	for _, l := range logs.lines(t) {
		raw, _ := json.Marshal(l)
		if strings.Contains(string(raw), key) || strings.Contains(string(raw), "body-") {
			t.Errorf("a log line with the raw key or the body: %s", raw)
		}
		if l["state"] == "key_reused" {
			found++
			if l["action"] != "POST /t" || l["request_id"] != "r2" || l["key_hash"] == nil {
				t.Errorf("the key_reused line: %s", raw)
			}
		}
	}
	if found != 1 {
		t.Errorf("%d key_reused lines, want 1: %v", found, logs.lines(t))
	}
}

// TestStatesLostLeaseTold409IsBusy: operations.md counts busy for a request "in progress:
// told 409". A lease lost while its work ran (by this process's clock) answers 409
// request_in_progress; the request's states were acquired only, and are acquired and busy now,
// as for a lease that ran out before its work could start (a 409 there too).
func TestStatesLostLeaseTold409IsBusy(t *testing.T) {
	t.Parallel()
	reg, _, url := lostLeaseRoute(t, 0)
	st, _, body := pgtest.Send(t, context.Background(), "POST", url, `{}`, "Idempotency-Key", "lost-busy")
	if st != http.StatusConflict || !strings.Contains(body, "request_in_progress") {
		t.Fatalf("%d %s, want 409 request_in_progress", st, body)
	}
	if got := srStates(t, reg); got["acquired"] != 1 || got["busy"] != 1 {
		t.Errorf("a lost lease told 409 request_in_progress: states %v, want acquired 1 and busy 1", got)
	}
}

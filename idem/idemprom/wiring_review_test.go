package idemprom_test

// idemprom's wiring, from a review of it: registering twice, two middlewares on one registry,
// what becomes a label, metrics after Shutdown.

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/idem/idemprom"
	"github.com/pgidem/pgidem/idem/idemtest"
	"github.com/pgidem/pgidem/internal/pgtest"
)

func wiringQuiet() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

func wiringPanics(f func()) (v any) {
	defer func() { v = recover() }()
	f()
	return nil
}

// wiringLabelValues lists every label value of every metric reg gathers.
func wiringLabelValues(t *testing.T, reg *prometheus.Registry) map[string]bool {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]bool{}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				out[l.GetName()+"="+l.GetValue()] = true
			}
		}
	}
	return out
}

// TestWiringTwoMiddlewaresOneRegistry: a process with two middlewares (two databases) and one
// registry. One Observer serves both. RegisterGate for the second middleware panicked without
// its doc saying so; the doc now says so and names the way: a registerer wrapped with a
// constant label of its own, which this test follows for both middlewares.
func TestWiringTwoMiddlewaresOneRegistry(t *testing.T) {
	ctx := context.Background()
	reg := prometheus.NewRegistry()
	obs := idemprom.NewObserver(reg)
	if v := wiringPanics(func() { idemprom.NewObserver(reg) }); v == nil {
		t.Errorf("NewObserver twice on one registry did not panic (documented to)")
	}
	var ms []*idem.Middleware
	for range 2 {
		pool := idemtest.NewPool(t)
		m, err := idem.New(ctx, idem.Options{DB: pool, Principal: func(*http.Request) (string, bool) { return "alice", true },
			Metrics: obs, Logger: wiringQuiet()})
		if err != nil {
			t.Fatal(err)
		}
		ms = append(ms, m)
	}
	idemprom.RegisterGate(reg, ms[0])
	if v := wiringPanics(func() { idemprom.RegisterGate(reg, ms[1]) }); v == nil {
		t.Errorf("RegisterGate for a second middleware on one registry did not panic (documented to)")
	}
	both := prometheus.NewRegistry()
	if v := wiringPanics(func() {
		idemprom.RegisterGate(prometheus.WrapRegistererWith(prometheus.Labels{"db": "orders"}, both), ms[0])
		idemprom.RegisterGate(prometheus.WrapRegistererWith(prometheus.Labels{"db": "billing"}, both), ms[1])
	}); v != nil {
		t.Errorf("RegisterGate for each middleware on the registry wrapped with a label of its own, as documented: %v", v)
	}
	if families, err := both.Gather(); err != nil || len(families) == 0 || len(families[0].GetMetric()) != 2 {
		t.Errorf("the two middlewares' figures: %v %v; want each family with two series", families, err)
	}
	for i, m := range ms {
		srv := httptest.NewServer(m.Route(idem.Route{Action: "POST /x"})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.WriteHeader(201)
		})))
		pgtest.Send(t, ctx, "POST", srv.URL, `{}`, "Idempotency-Key", fmt.Sprintf("k%d", i))
		srv.Close()
	}
	if got := wiringLabelValues(t, reg); !got["action=POST /x"] {
		t.Errorf("shared observer: labels %v", got)
	}
}

// TestWiringNoPrincipalOrKeyBecomesALabel: principals and keys never become label values
// (only the action and the state/result), whatever the principal function and the keys are;
// with a router that gives no template the action is the URL path (documented, capped). And a
// scrape after Shutdown still works (the gate's figures at 0). Asserted: no label value holds
// a principal or a key; Gather after Shutdown succeeds and the waiting gauges are 0.
func TestWiringNoPrincipalOrKeyBecomesALabel(t *testing.T) {
	ctx := context.Background()
	pool := idemtest.NewPool(t)
	reg := prometheus.NewRegistry()
	m, err := idem.New(ctx, idem.Options{DB: pool, Metrics: idemprom.NewObserver(reg), Logger: wiringQuiet(),
		Principal: func(r *http.Request) (string, bool) { return "tenant-" + r.Header.Get("X-Tenant"), true }})
	if err != nil {
		t.Fatal(err)
	}
	idemprom.RegisterGate(reg, m)
	srv := httptest.NewServer(m.Route(idem.Route{Action: "POST /orders"})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("X-Fail") != "" {
			http.Error(w, "boom", 500)
			return
		}
		w.WriteHeader(201)
	})))
	defer srv.Close()
	for i := range 20 {
		key := fmt.Sprintf("secret-key-%d", i)
		tenant := fmt.Sprintf("t%d", i)
		pgtest.Send(t, ctx, "POST", srv.URL, `{"a":1}`, "Idempotency-Key", key, "X-Tenant", tenant)
		pgtest.Send(t, ctx, "POST", srv.URL, `{"a":2}`, "Idempotency-Key", key, "X-Tenant", tenant) // 422
		pgtest.Send(t, ctx, "POST", srv.URL, `{}`, "Idempotency-Key", key+"-f", "X-Tenant", tenant, "X-Fail", "1")
	}
	sctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	if err := m.Shutdown(sctx); err != nil {
		t.Fatal(err)
	}
	pgtest.Send(t, ctx, "POST", srv.URL, `{}`, "Idempotency-Key", "after-shutdown", "X-Tenant", "late")
	got := wiringLabelValues(t, reg)
	for lv := range got {
		if strings.Contains(lv, "secret-key") || strings.Contains(lv, "tenant-") || strings.Contains(lv, "after-shutdown") {
			t.Errorf("a key or principal became a label: %s", lv)
		}
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == "idempotency_waiting_duplicates" && mf.GetMetric()[0].GetGauge().GetValue() != 0 {
			t.Errorf("waiting duplicates after Shutdown: %v", mf.GetMetric()[0].GetGauge().GetValue())
		}
	}
}

// TestWiringCleanupObserverTwice: NewCleanupObserver on a registry that has its metrics panics,
// as its doc now says, and two, each on the registry wrapped with a label of its own, work.
func TestWiringCleanupObserverTwice(t *testing.T) {
	reg := prometheus.NewRegistry()
	idemprom.NewCleanupObserver(reg)
	if v := wiringPanics(func() { idemprom.NewCleanupObserver(reg) }); v == nil {
		t.Errorf("NewCleanupObserver twice on one registry did not panic (documented to)")
	}
	both := prometheus.NewRegistry()
	if v := wiringPanics(func() {
		idemprom.NewCleanupObserver(prometheus.WrapRegistererWith(prometheus.Labels{"db": "orders"}, both))
		idemprom.NewCleanupObserver(prometheus.WrapRegistererWith(prometheus.Labels{"db": "billing"}, both))
	}); v != nil {
		t.Errorf("two NewCleanupObserver, each on the registry wrapped with a label of its own, as documented: %v", v)
	}
}

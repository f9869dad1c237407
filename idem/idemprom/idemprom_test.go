package idemprom_test

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/idem/idemprom"
	"github.com/pgidem/pgidem/idem/idemtest"
)

func TestMain(m *testing.M) { os.Exit(idemtest.Main(m)) }

// TestEveryMetricIsExported: a keyed request, its replay, a cleanup pass and a scrape export
// every metric docs/operations.md lists, under its documented name, with the states and
// results as labels.
func TestEveryMetricIsExported(t *testing.T) {
	ctx := context.Background()
	pool := idemtest.NewPool(t)
	reg := prometheus.NewRegistry()
	m, err := idem.New(ctx, idem.Options{DB: pool, Principal: func(*http.Request) (string, bool) { return "alice", true },
		Metrics: idemprom.NewObserver(reg)})
	if err != nil {
		t.Fatal(err)
	}
	idemprom.RegisterGate(reg, m)
	c, err := idem.NewCleaner(pool, idem.CleanerOptions{Metrics: idemprom.NewCleanupObserver(reg),
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	reg.MustRegister(idemprom.NewHealthCollector(pool, time.Second, nil))

	srv := httptest.NewServer(m.Route(idem.Route{Action: "POST /x", Lease: time.Second})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(201)
	})))
	defer srv.Close()
	for range 2 {
		req, _ := http.NewRequest("POST", srv.URL, nil)
		req.Header.Set("Idempotency-Key", "k")
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		res.Body.Close()
	}
	if _, _, err := c.Pass(ctx); err != nil {
		t.Fatal(err)
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	labels := map[string][]string{}
	for _, mf := range mfs {
		names = append(names, mf.GetName())
		for _, metric := range mf.GetMetric() {
			for _, l := range metric.GetLabel() {
				if l.GetName() == "state" || l.GetName() == "result" {
					labels[mf.GetName()] = append(labels[mf.GetName()], l.GetValue())
				}
			}
		}
	}
	want := []string{"idem_cleanup_deleted_total", "idem_cleanup_pass_duration_seconds", "idem_cleanup_passes_total",
		"idem_cleanup_vacuums_total", "idempotency_cleanup_backlog", "idempotency_coalesced_total",
		"idempotency_key_table_bytes", "idempotency_keys_estimated", "idempotency_keys_in_progress",
		"idempotency_lease_extensions_total", "idempotency_lease_work_seconds", "idempotency_leases_lost_total", "idempotency_leases_run_out",
		"idempotency_oldest_in_progress_seconds", "idempotency_refused_total", "idempotency_request_duration_seconds",
		"idempotency_requests_total", "idempotency_waiting_duplicate_bytes", "idempotency_waiting_duplicates"}
	slices.Sort(names)
	if !slices.Equal(names, want) {
		t.Fatalf("metrics %v,\nwant %v", names, want)
	}
	states := labels["idempotency_requests_total"]
	slices.Sort(states)
	if !slices.Equal(states, []string{"acquired", "busy", "key_reused", "oversize", "replayed", "store_error"}) {
		t.Fatalf("states %v, want every state (exported at 0 from the action's first request)", states)
	}
	results := labels["idem_cleanup_passes_total"]
	slices.Sort(results)
	if !slices.Equal(results, []string{"done", "failed", "skipped", "stopped"}) {
		t.Fatalf("pass results %v, want all four from the start", results)
	}
}

// TestEveryStateStartsAtZero: an action's request series start together, every state at 0, so
// the first store_error after its first acquired is an increase rate() sees (it was a new series
// starting at 1, which rate() cannot tell from one that had always been 1); the duration
// histogram has every state before any request.
func TestEveryStateStartsAtZero(t *testing.T) {
	reg := prometheus.NewRegistry()
	o := idemprom.NewObserver(reg)
	series := func(name string) map[string]float64 {
		t.Helper()
		mfs, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		got := map[string]float64{}
		for _, mf := range mfs {
			if mf.GetName() != name {
				continue
			}
			for _, m := range mf.GetMetric() {
				key := ""
				for _, lp := range m.GetLabel() {
					key += lp.GetName() + "=" + lp.GetValue() + ","
				}
				if m.GetCounter() != nil {
					got[key] = m.GetCounter().GetValue()
				} else {
					got[key] = float64(m.GetHistogram().GetSampleCount())
				}
			}
		}
		return got
	}
	durations := series("idempotency_request_duration_seconds")
	if len(durations) != len(idem.States()) {
		t.Fatalf("duration series before any request: %v, want one per state", durations)
	}
	o.Count("create-order", idem.StateAcquired)
	got := series("idempotency_requests_total")
	for _, s := range idem.States() {
		v, ok := got["action=create-order,state="+string(s)+","]
		want := 0.0
		if s == idem.StateAcquired {
			want = 1
		}
		if !ok || v != want {
			t.Errorf("state %s: %v (exported %v), want %v", s, v, ok, want)
		}
	}
	if len(got) != len(idem.States()) {
		t.Errorf("series: %v, want one per state of the one action", got)
	}
}

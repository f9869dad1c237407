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
		"idempotency_lease_work_seconds", "idempotency_leases_lost_total", "idempotency_leases_run_out",
		"idempotency_oldest_in_progress_seconds", "idempotency_refused_total", "idempotency_request_duration_seconds",
		"idempotency_requests_total", "idempotency_waiting_duplicate_bytes", "idempotency_waiting_duplicates"}
	slices.Sort(names)
	if !slices.Equal(names, want) {
		t.Fatalf("metrics %v,\nwant %v", names, want)
	}
	states := labels["idempotency_requests_total"]
	slices.Sort(states)
	if !slices.Equal(states, []string{"acquired", "replayed"}) {
		t.Fatalf("states %v, want acquired and replayed", states)
	}
	results := labels["idem_cleanup_passes_total"]
	slices.Sort(results)
	if !slices.Equal(results, []string{"done", "failed", "skipped", "stopped"}) {
		t.Fatalf("pass results %v, want all four from the start", results)
	}
}

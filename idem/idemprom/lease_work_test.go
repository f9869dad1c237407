package idemprom_test

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/pgidem/pgidem/idem/idemprom"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// familiesOf gathers reg by name.
func familiesOf(t *testing.T, reg *prometheus.Registry) map[string]*dto.MetricFamily {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]*dto.MetricFamily{}
	for _, mf := range mfs {
		out[mf.GetName()] = mf
	}
	return out
}

// workSamples is the sample count of idempotency_lease_work_seconds{action}.
func workSamples(t *testing.T, reg *prometheus.Registry, action string) uint64 {
	t.Helper()
	mf := familiesOf(t, reg)["idempotency_lease_work_seconds"]
	if mf == nil {
		return 0
	}
	for _, m := range mf.GetMetric() {
		for _, l := range m.GetLabel() {
			if l.GetName() == "action" && l.GetValue() == action {
				return m.GetHistogram().GetSampleCount()
			}
		}
	}
	return 0
}

// TestLostLeaseWorkIsNotTimedAsRecorded: idempotency_lease_work_seconds times the work of lease
// routes whose answer was recorded (its help text; docs/operations.md "Metrics"). A lease lost
// while its work runs (idem_extend gone: the lease runs out by this process's clock) answers
// 409 and records nothing: it is counted in idempotency_leases_lost_total, and was timed in
// the histogram too.
func TestLostLeaseWorkIsNotTimedAsRecorded(t *testing.T) {
	t.Parallel()
	reg, _, url := lostLeaseRoute(t, 0)
	st, _, body := pgtest.Send(t, context.Background(), "POST", url, `{}`, "Idempotency-Key", "lost-1")
	if st != http.StatusConflict {
		t.Fatalf("a lease that ran out by this process's clock: %d %s, want 409", st, body)
	}
	if v := value(t, reg, "idempotency_leases_lost_total", "action", "POST /pay"); v != 1 {
		t.Fatalf("idempotency_leases_lost_total = %v, want 1", v)
	}
	if n := workSamples(t, reg, "POST /pay"); n != 0 {
		t.Errorf("idempotency_lease_work_seconds{action=\"POST /pay\"} has %d sample(s) after one lease whose answer was NOT recorded (lost, 409); its help says \"How long the work of lease routes ran, its answer recorded\"", n)
	}
}

// lockedLog collects slog output safely.
type lockedLog struct {
	mu sync.Mutex
	b  strings.Builder
}

func (l *lockedLog) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedLog) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

var healthGauges = []string{"idempotency_keys_in_progress", "idempotency_leases_run_out", "idempotency_oldest_in_progress_seconds",
	"idempotency_cleanup_backlog", "idempotency_key_table_bytes", "idempotency_keys_estimated"}

// TestHealthCollectorAbsentWhileFailingAndBack: HealthCollector "exports idem.ReadHealth
// as gauges, read at scrape time at most every interval (a scrape in between gets the figures
// of the last read) ... A failed read exports nothing (the gauges go absent) and is logged
// once." As a login in idem_app (ReadHealth: "The application role (idem_app) may"). Asserted:
// all six gauges present; the figures of the last read between reads; absent while
// idem_health is missing, one log line for two failed reads; present again after it is back,
// which is logged; a second outage (the key table locked) logged again, with its cause.
func TestHealthCollectorAbsentWhileFailingAndBack(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	owner, url := pgtest.NewPool(t, 2)
	app, err := pgxpool.New(ctx, pgtest.LoginRole(t, url, "idem_app"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(app.Close)
	logs := &lockedLog{}
	reg := prometheus.NewRegistry()
	const interval = 300 * time.Millisecond
	reg.MustRegister(idemprom.NewHealthCollector(app, interval, slog.New(slog.NewTextHandler(logs, nil))))
	present := func() []string {
		fams := familiesOf(t, reg)
		var out []string
		for _, g := range healthGauges {
			if fams[g] != nil {
				out = append(out, g)
			}
		}
		return out
	}
	if got := present(); len(got) != len(healthGauges) {
		t.Fatalf("gauges present as the app role: %v, want all six (%v); log: %s", got, healthGauges, logs.String())
	}
	// A claim in progress right after a read: the next scrape within the interval keeps 0.
	pgtest.Exec(t, owner, `SELECT idem.idem_begin('p', 'k-lease', 'POST /x', sha256('b'), p_lease => interval '1 hour')`)
	if v := familiesOf(t, reg)["idempotency_keys_in_progress"].GetMetric()[0].GetGauge().GetValue(); v != 0 {
		t.Logf("in progress within the interval: %v (the read was older than the interval?)", v)
	}
	time.Sleep(interval + 50*time.Millisecond)
	if v := familiesOf(t, reg)["idempotency_keys_in_progress"].GetMetric()[0].GetGauge().GetValue(); v != 1 {
		t.Errorf("idempotency_keys_in_progress after the interval: %v, want 1", v)
	}
	pgtest.Exec(t, owner, `ALTER FUNCTION idem.idem_health RENAME TO idem_health_gone`)
	time.Sleep(interval + 50*time.Millisecond)
	if got := present(); len(got) != 0 {
		t.Errorf("gauges present while idem_health fails: %v, want none", got)
	}
	time.Sleep(interval + 50*time.Millisecond)
	if got := present(); len(got) != 0 {
		t.Errorf("gauges present while idem_health fails (second read): %v, want none", got)
	}
	if n := strings.Count(logs.String(), "\n"); n != 1 {
		t.Errorf("%d log lines for two failed reads, want 1: %s", n, logs.String())
	}
	pgtest.Exec(t, owner, `ALTER FUNCTION idem.idem_health_gone RENAME TO idem_health`)
	time.Sleep(interval + 50*time.Millisecond)
	if got := present(); len(got) != len(healthGauges) {
		t.Errorf("gauges after idem_health is back: %v, want all six", got)
	}
	if n := strings.Count(logs.String(), "\n"); n != 2 || !strings.Contains(logs.String(), "again") {
		t.Errorf("%d log lines after the read succeeded again, want 2 (the outage, its end): %s", n, logs.String())
	}
	// A second outage is logged too (D246), with its cause: a lock on the key table held past
	// idem_health's own lock timeout of 2 s, which the read's bound outlasts.
	locker, err := owner.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, locker, `LOCK TABLE idem.idempotency_keys IN ACCESS EXCLUSIVE MODE`)
	time.Sleep(interval + 50*time.Millisecond)
	got := present()
	_ = locker.Rollback(ctx)
	if len(got) != 0 {
		t.Errorf("gauges present while the key table is locked: %v, want none", got)
	}
	if lines := strings.Split(strings.TrimSpace(logs.String()), "\n"); len(lines) != 3 || !strings.Contains(lines[2], "the key table is locked") {
		t.Errorf("the log after a second outage, behind a locked key table: %q; want a third line that says the key table is locked", lines)
	}
	_ = io.Discard
}

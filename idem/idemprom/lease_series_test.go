package idemprom_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"slices"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/idem/idemprom"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestLeaseCountersStartAtZero: a lease route's lease counters are exported at 0 from its
// first lease claim on (LeaseClaimed), so a route's first lost lease is an increase that
// increase() and rate() see. The lost counter was created by the loss itself, born at 1, and
// the dashboard's "lost in the last hour" read 0 for a route's first lost lease (after every
// restart). A route without a lease exports no lease series.
func TestLeaseCountersStartAtZero(t *testing.T) {
	reg := prometheus.NewRegistry()
	o := idemprom.NewObserver(reg)
	o.Count("POST /tx", idem.StateAcquired) // a transactional route's claim
	o.LeaseClaimed("POST /pay")
	o.Count("POST /pay", idem.StateAcquired)
	for _, name := range []string{"idempotency_leases_lost_total", "idempotency_lease_extensions_total"} {
		if vals := labelValues(t, reg, name, "action"); !slices.Equal(vals, []string{"POST /pay"}) {
			t.Errorf("%s after a lease route's first claim: series of %v, want POST /pay (at 0) alone", name, vals)
		} else if v := value(t, reg, name, "action", "POST /pay"); v != 0 {
			t.Errorf("%s: %v, want 0", name, v)
		}
	}
	o.LeaseEnded("POST /pay", true, time.Second)
	if v := value(t, reg, "idempotency_leases_lost_total", "action", "POST /pay"); v != 1 {
		t.Errorf("lost after the loss: %v, want 1", v)
	}
}

// TestLeaseCountersExistWhileTheFirstLeaseWorks: through the middleware, a scrape while a
// lease route's first work runs sees its lost-lease counter at 0.
func TestLeaseCountersExistWhileTheFirstLeaseWorks(t *testing.T) {
	t.Parallel()
	_, reg, m := observed(t)
	seen := make(chan []string, 1)
	srv := httptest.NewServer(m.Route(idem.Route{Action: "POST /pay", Lease: 5 * time.Second})(http.HandlerFunc(
		func(w http.ResponseWriter, r *http.Request) {
			seen <- labelValues(t, reg, "idempotency_leases_lost_total", "action")
			w.WriteHeader(http.StatusCreated)
		})))
	t.Cleanup(srv.Close)
	if st, _, body := pgtest.Send(t, context.Background(), "POST", srv.URL, `{}`, "X-Principal", "alice", "Idempotency-Key", "first-lease"); st != http.StatusCreated {
		t.Fatalf("the first lease: %d %s", st, body)
	}
	if got := <-seen; !slices.Equal(got, []string{"POST /pay"}) {
		t.Errorf("idempotency_leases_lost_total while the route's first lease worked: series of %v, want POST /pay at 0", got)
	}
}

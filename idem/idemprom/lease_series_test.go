package idemprom_test

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/idem/idemprom"
)

// TestLeaseCountersStartAtZero: an action's lease counters are exported at 0 from its first
// request (the claim) on, so a route's first lost lease is an increase that increase() and
// rate() see. The lost counter was created by the loss itself, born at 1, and the dashboard's
// "lost in the last hour" read 0 for a route's first lost lease (after every restart).
func TestLeaseCountersStartAtZero(t *testing.T) {
	reg := prometheus.NewRegistry()
	o := idemprom.NewObserver(reg)
	o.Count("POST /pay", idem.StateAcquired) // the lease route's claim
	for _, name := range []string{"idempotency_leases_lost_total", "idempotency_lease_extensions_total"} {
		if vals := labelValues(t, reg, name, "action"); len(vals) != 1 || vals[0] != "POST /pay" {
			t.Errorf("%s after the action's first claim: series of %v, want POST /pay at 0", name, vals)
		} else if v := value(t, reg, name, "action", "POST /pay"); v != 0 {
			t.Errorf("%s: %v, want 0", name, v)
		}
	}
	o.LeaseEnded("POST /pay", true, time.Second)
	if v := value(t, reg, "idempotency_leases_lost_total", "action", "POST /pay"); v != 1 {
		t.Errorf("lost after the loss: %v, want 1", v)
	}
}

package idemprom_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestLeaseWorkTimedForAGivenUp5xx: docs/operations.md, Metrics:
// "idempotency_lease_work_seconds{action} | histogram | how long lease routes' work ran to its
// answer and that answer's recording, or to the lease given up after a 5xx (a lost lease's work
// is counted in idempotency_leases_lost_total only ...)"; the help text: "How long the work of
// lease routes ran to its answer, recorded or given up". A 502, a panic (500) and a 201 each add
// one sample; a replay adds none; none of them is counted lost.
func TestLeaseWorkTimedForAGivenUp5xx(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, reg, m := observedWith(t, nil)
	var run atomic.Int32
	srv := httptest.NewServer(m.Route(idem.Route{Action: "POST /pay", Lease: 10 * time.Second})(http.HandlerFunc(
		func(w http.ResponseWriter, r *http.Request) {
			switch run.Add(1) {
			case 1:
				http.Error(w, "provider down", http.StatusBadGateway)
			case 2:
				panic("boom")
			default:
				w.WriteHeader(http.StatusCreated)
			}
		})))
	defer srv.Close()
	for i, want := range []int{http.StatusBadGateway, http.StatusInternalServerError, http.StatusCreated, http.StatusCreated} {
		st, _, body := pgtest.Send(t, ctx, "POST", srv.URL, `{"a":1}`, "Idempotency-Key", "work-1")
		if st != want {
			t.Fatalf("try %d: %d %s, want %d", i, st, body, want)
		}
		if wantN := uint64(min(i+1, 3)); workSamples(t, reg, "POST /pay") != wantN {
			t.Errorf("after try %d (%d): %d samples of idempotency_lease_work_seconds, want %d",
				i, st, workSamples(t, reg, "POST /pay"), wantN)
		}
	}
	if v := value(t, reg, "idempotency_leases_lost_total", "action", "POST /pay"); v != 0 {
		t.Errorf("idempotency_leases_lost_total = %v, want 0", v)
	}
}

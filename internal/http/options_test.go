package idemhttp_test

import (
	"net/http"
	"slices"
	"testing"

	idemhttp "github.com/pgidem/pgidem/internal/http"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestOptionDefaults reads every default back, and checks what New refuses.
func TestOptionDefaults(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 2)
	principal := func(*http.Request) (string, bool) { return "", false }
	m, err := idemhttp.New(idemhttp.Options{DB: pool, Principal: principal})
	if err != nil {
		t.Fatal(err)
	}
	o := m.Options()
	if o.KeyHeader != "Idempotency-Key" || o.ReplayHeader != "Idempotent-Replayed" || o.CorrelationHeader != "X-Request-Id" ||
		o.TTL != 0 || o.LockTimeout != 0 || o.MaxBodyBytes != 1<<20 || o.MaxStoredBodyBytes != 256<<10 ||
		!slices.Equal(o.StoredHeaders, []string{"Content-Type", "Location", "ETag", "Content-Location", "Last-Modified"}) ||
		o.ProblemBase != "https://github.com/pgidem/pgidem/blob/main/docs/http.md#" || o.MaxAttempts != 0 ||
		o.Logger == nil || o.Metrics == nil || o.FinalStatus == nil {
		t.Fatalf("defaults: %+v", o)
	}
	for s := 100; s < 600; s++ {
		want := slices.Contains([]int{400, 403, 404, 409, 410, 412, 413, 415, 422}, s)
		if o.FinalStatus(s) != want {
			t.Errorf("FinalStatus(%d) = %v", s, !want)
		}
	}
	for _, bad := range []idemhttp.Options{
		{Principal: principal},
		{DB: pool},
		{DB: pool, Principal: principal, TTL: -1},
		{DB: pool, Principal: principal, MaxBodyBytes: -1},
		{DB: pool, Principal: principal, MaxWaitingClaims: -1},
	} {
		if _, err := idemhttp.New(bad); err == nil {
			t.Errorf("New accepted %+v", bad)
		}
	}
}

package idem_test

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

// TestLateAnswerAfterTheKeyExpiredIsStored: a lease route's handler that outlives its
// LeaseTimeout (a slow provider call that does not honour its context) answers 201 once the
// key has expired (its lease and the TTL after it ran out), while no other attempt took the
// key. The completion, fenced by the token, finds the claim gone; the middleware answered 409
// "still running", and the client's retry claimed the key afresh: a new generation, the work
// run again under a new provider key, which a provider that deduplicates pays twice (D249).
// The answer is stored for the key nobody holds now: the client gets it, and its retry
// replays it; the work ran once, under one provider key.
func TestLateAnswerAfterTheKeyExpiredIsStored(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, url := pgtest.NewPool(t, 6)
	admin := pgtest.Connect(t, url)
	m := quietMiddleware(t, idem.Options{DB: pool, TTL: time.Second})
	seen := &seenKeys{}
	var runs atomic.Int32
	expired := false
	mux := http.NewServeMux()
	mux.Handle("POST /pay", m.Route(idem.Route{Required: true, Lease: time.Second, LeaseTimeout: time.Second})(
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			c, _ := idem.ClaimOf(r.Context())
			seen.add(c.ProviderKey)
			if runs.Add(1) == 1 {
				// the answer comes once the key's lease and TTL have run out, nobody else
				// having claimed it
				for deadline := time.Now().Add(15 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
					if pgtest.Count(t, admin, `SELECT count(*) FROM idem.idempotency_keys
						WHERE key = 'late-1' AND state = 'p' AND expires_at < clock_timestamp()
						  AND lease_expires_at < clock_timestamp()`) == 1 {
						expired = true
						break
					}
				}
			}
			w.WriteHeader(http.StatusCreated)
			_, _ = w.Write([]byte(`{"paid":true}`))
		})))
	srv := httptest.NewServer(mux)
	defer srv.Close()
	st1, _, b1 := pgtest.Send(t, ctx, "POST", srv.URL+"/pay", `{"amount":5}`, "Idempotency-Key", "late-1")
	if !expired {
		t.Fatal("the key never expired under the first attempt: the test did not hold the gap open")
	}
	st2, h2, b2 := pgtest.Send(t, ctx, "POST", srv.URL+"/pay", `{"amount":5}`, "Idempotency-Key", "late-1")
	if st1 != http.StatusCreated || b1 != `{"paid":true}` {
		t.Errorf("the first attempt, whose 201 came after its key expired: %d %s; want the 201", st1, b1)
	}
	if st2 != http.StatusCreated || h2.Get("Idempotent-Replayed") != "true" || b2 != `{"paid":true}` {
		t.Errorf("the retry: %d %s (replayed %q); want the first answer replayed", st2, b2, h2.Get("Idempotent-Replayed"))
	}
	if keys := seen.all(); runs.Load() != 1 || len(keys) != 1 {
		t.Errorf("the work ran %d times under provider keys %q; want once", runs.Load(), keys)
	}
}

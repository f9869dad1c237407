package idem_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// seenKeys records the ClaimInfo.ProviderKey every run of a handler saw, in order.
type seenKeys struct {
	mu   sync.Mutex
	keys []string
}

func (k *seenKeys) add(s string) { k.mu.Lock(); k.keys = append(k.keys, s); k.mu.Unlock() }
func (k *seenKeys) all() []string {
	k.mu.Lock()
	defer k.mu.Unlock()
	return append([]string(nil), k.keys...)
}

// TestTxRouteProviderKeyLivesWithItsTransaction: on a transactional route the claim and its
// generation roll back with the work (ClaimInfo.ProviderKey, docs/http.md): the middleware's
// own run after a serialization failure has a provider key of its own, as the answer that
// commits does. (The documentation promised the same key to every attempt on every route.)
func TestTxRouteProviderKeyLivesWithItsTransaction(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	m := quietMiddleware(t, idem.Options{DB: pool})
	var runs atomic.Int32
	seen := &seenKeys{}
	mux := http.NewServeMux()
	mux.Handle("POST /charge", m.Route(idem.Route{Required: true})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		c, ok := idem.ClaimOf(r.Context())
		if !ok {
			http.Error(w, "no claim", http.StatusInternalServerError)
			return
		}
		seen.add(c.ProviderKey)
		if runs.Add(1) == 1 {
			// The first run's transaction meets a serialization failure (as a concurrent
			// writer would cause under SERIALIZABLE); the middleware runs the unit again.
			_, err := idem.TxFrom(r.Context()).Exec(r.Context(),
				`DO $$ BEGIN RAISE EXCEPTION 'conflict' USING ERRCODE = '40001'; END $$`)
			if err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
		}
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte(`{"charged":true}`))
	})))
	srv := httptest.NewServer(mux)
	defer srv.Close()
	st, _, body := pgtest.Send(t, ctx, "POST", srv.URL+"/charge", `{"amount":5}`, "Idempotency-Key", "gen-tx-1")
	if st != http.StatusCreated {
		t.Fatalf("status %d %s, want 201 after the middleware's retry", st, body)
	}
	keys := seen.all()
	if len(keys) != 2 {
		t.Fatalf("handler ran %d times, want 2 (one serialization failure, one retry)", len(keys))
	}
	if keys[0] == keys[1] || len(keys[0]) != 64 || len(keys[1]) != 64 {
		t.Fatalf("the run that rolled back and the run that committed: provider keys %q and %q; want two, "+
			"the rolled-back claim's generation gone with it", keys[0], keys[1])
	}
}

// TestTxRouteRetryAfter5xxIsANewGeneration: a client's retry after a 5xx on a transactional
// route claims a key whose first claim rolled back: a new generation, a new provider key
// (docs/sql-api.md, "Generations and provider keys").
func TestTxRouteRetryAfter5xxIsANewGeneration(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	m := quietMiddleware(t, idem.Options{DB: pool})
	var runs atomic.Int32
	seen := &seenKeys{}
	mux := http.NewServeMux()
	mux.Handle("POST /charge", m.Route(idem.Route{Required: true})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		c, _ := idem.ClaimOf(r.Context())
		seen.add(c.ProviderKey)
		if runs.Add(1) == 1 {
			http.Error(w, "provider timed out", http.StatusBadGateway)
			return
		}
		w.WriteHeader(http.StatusCreated)
	})))
	srv := httptest.NewServer(mux)
	defer srv.Close()
	for i, want := range []int{http.StatusBadGateway, http.StatusCreated} {
		if st, _, body := pgtest.Send(t, ctx, "POST", srv.URL+"/charge", `{"amount":5}`, "Idempotency-Key", "gen-tx-2"); st != want {
			t.Fatalf("try %d: %d %s, want %d", i, st, body, want)
		}
	}
	keys := seen.all()
	if len(keys) != 2 || keys[0] == keys[1] {
		t.Fatalf("a client's retry after a 5xx on a transactional route: provider keys %v; want two", keys)
	}
}

// TestLeaseRouteProviderKeyPaths: on a lease route the provider key is the
// same for the first run, a retry after a 5xx (yield) and the replay's claim, and a new one
// after idem.Release frees the key, and after the key expired.
func TestLeaseRouteProviderKeyPaths(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, url := pgtest.NewPool(t, 4)
	m := quietMiddleware(t, idem.Options{DB: pool})
	var runs atomic.Int32
	seen := &seenKeys{}
	fail := atomic.Bool{}
	mux := http.NewServeMux()
	mux.Handle("POST /pay", m.Route(idem.Route{Required: true, Lease: 30 * time.Second})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		c, _ := idem.ClaimOf(r.Context())
		seen.add(c.ProviderKey)
		runs.Add(1)
		if fail.Load() {
			http.Error(w, "provider down", http.StatusBadGateway)
			return
		}
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte(`{"ok":1}`))
	})))
	srv := httptest.NewServer(mux)
	defer srv.Close()
	send := func(want int) {
		t.Helper()
		if st, _, body := pgtest.Send(t, ctx, "POST", srv.URL+"/pay", `{"amount":5}`, "Idempotency-Key", "gen-l"); st != want {
			t.Fatalf("%d %s, want %d", st, body, want)
		}
	}
	fail.Store(true)
	send(http.StatusBadGateway) // yields
	fail.Store(false)
	send(http.StatusCreated) // takes over in the same generation
	send(http.StatusCreated) // replay, no run
	keys := seen.all()
	if len(keys) != 2 || keys[0] != keys[1] {
		t.Fatalf("first run and the retry after a 5xx: %v, want one key", keys)
	}
	// Expire the key (as the owner), then the same request: a new generation.
	admin := pgtest.Connect(t, url)
	pgtest.Exec(t, admin, `UPDATE idem.idempotency_keys SET expires_at = clock_timestamp() - interval '1 second',
		lease_expires_at = clock_timestamp() - interval '1 second' WHERE key = 'gen-l'`)
	send(http.StatusCreated)
	keys = seen.all()
	if len(keys) != 3 || keys[2] == keys[0] {
		t.Fatalf("after expiry: %v, want a third, new key", keys)
	}
}

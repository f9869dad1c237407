package idem_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestSwitchingProtocolsIsNoAnswer: net/http takes WriteHeader(101) for a final status (the
// connection is then the handler's). The recorder ignored it as an informational status, so
// the implicit 200 that followed committed the work and was stored and replayed: an empty 200
// that said the work was done. A keyed route's handler that writes 101 panics now, as for a
// status no response can carry: 500 internal_error, its work rolled back, nothing stored.
func TestSwitchingProtocolsIsNoAnswer(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	m := quietMiddleware(t, idem.Options{DB: pool})
	srv := httptest.NewServer(m.Route(idem.Route{Action: "POST /up"})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Upgrade", "foo")
		w.WriteHeader(http.StatusSwitchingProtocols)
	})))
	defer srv.Close()
	for i := range 2 {
		st, _, body := pgtest.Send(t, ctx, "POST", srv.URL, `{}`, "Idempotency-Key", "up-1")
		if st != 500 || !strings.Contains(body, "internal_error") {
			t.Errorf("try %d: %d %s, want 500 internal_error", i, st, body)
		}
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem.idempotency_keys WHERE key = 'up-1'`); n != 0 {
		t.Errorf("%d keys stored for a 101", n)
	}
}

// TestFinalStatusAboveTheTableIsNotFinal: the key table stores statuses 100 to 599. A
// FinalStatus that takes 799 (s >= 400) made the handler's 799 a final answer the store
// refused: 500 idempotency_misconfigured on every try, blaming the route's action or the TTL.
// A status above 599 is never final: the handler's answer is sent, its work rolled back, and
// nothing stored, so a retry runs again.
func TestFinalStatusAboveTheTableIsNotFinal(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	m := quietMiddleware(t, idem.Options{DB: pool, FinalStatus: func(s int) bool { return s >= 400 }})
	var runs atomic.Int32
	srv := httptest.NewServer(m.Route(idem.Route{Action: "POST /odd"})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		w.WriteHeader(799)
		_, _ = w.Write([]byte("odd\n"))
	})))
	defer srv.Close()
	for i := range 2 {
		if st, _, body := pgtest.Send(t, ctx, "POST", srv.URL, `{}`, "Idempotency-Key", "odd-1"); st != 799 || body != "odd\n" {
			t.Errorf("try %d: %d %q, want the handler's 799", i, st, body)
		}
	}
	if n := runs.Load(); n != 2 {
		t.Errorf("the handler ran %d times, want 2 (nothing stored)", n)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem.idempotency_keys WHERE key = 'odd-1'`); n != 0 {
		t.Errorf("%d keys stored for a 799", n)
	}
}

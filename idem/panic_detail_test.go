package idem_test

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// A lease route's handler that recorded a step and then panicked was answered 500 with "nothing
// was changed", which its step (and a provider called in it) had (a black-box review). The
// detail now says what is kept, and that the retry goes on after it; a transactional route's
// panic still says nothing was changed, which is true there.
func TestPanicDetailSaysWhatALeaseRouteKept(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 6)
	m, err := idem.New(context.Background(), idem.Options{DB: pool, Principal: alice, Logger: auditQuiet})
	if err != nil {
		t.Fatal(err)
	}
	var runs atomic.Int64
	stepThenPanic := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if _, err := idem.Step(r.Context(), "charge", func(context.Context, pgx.Tx) (int, error) { return 1, nil }); err != nil {
			t.Error(err)
		}
		if runs.Add(1) == 1 || r.Header.Get("Idempotency-Key") == "" {
			panic("after the step")
		}
		w.WriteHeader(http.StatusCreated)
	})
	mux := http.NewServeMux()
	mux.Handle("POST /lease", m.Route(idem.Route{Lease: 10 * time.Second})(stepThenPanic))
	mux.Handle("POST /tx", m.Route(idem.Route{})(http.HandlerFunc(func(http.ResponseWriter, *http.Request) { panic("tx") })))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	detail := func(body string) string {
		var p struct{ Detail string }
		if err := json.Unmarshal([]byte(body), &p); err != nil {
			t.Fatalf("%v: %s", err, body)
		}
		return p.Detail
	}
	ctx := context.Background()
	status, _, body := pgtest.Send(t, ctx, "POST", srv.URL+"/lease", `{}`, "Idempotency-Key", "k1")
	if d := detail(body); status != 500 || strings.Contains(d, "nothing was changed") || !strings.Contains(d, "steps it recorded are kept") {
		t.Errorf("a keyed lease handler's panic after a step: %d %q; want 500 saying the steps are kept", status, d)
	}
	if status, _, _ := pgtest.Send(t, ctx, "POST", srv.URL+"/lease", `{}`, "Idempotency-Key", "k1"); status != http.StatusCreated {
		t.Errorf("the retry: %d, want 201", status)
	}
	status, _, body = pgtest.Send(t, ctx, "POST", srv.URL+"/lease", `{}`)
	if d := detail(body); status != 500 || strings.Contains(d, "nothing was changed") || strings.Contains(d, "safe") {
		t.Errorf("an unkeyed lease handler's panic after a step: %d %q; want 500 that does not call a retry safe", status, d)
	}
	status, _, body = pgtest.Send(t, ctx, "POST", srv.URL+"/tx", `{}`, "Idempotency-Key", "k2")
	if d := detail(body); status != 500 || !strings.Contains(d, "nothing was changed") {
		t.Errorf("a transactional handler's panic: %d %q; want 500 saying nothing was changed", status, d)
	}
}

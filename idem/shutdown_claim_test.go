package idem_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestShutdownEndsAClaimUnderWay: Shutdown's deadline passed while a keyed request waited for
// a connection to claim its key (the pool's only connection was held). The claim was ended,
// nothing was stored, and the client was told 503 store_unavailable, "the request could not
// be recorded", as though the database had failed: an operator's alert on store errors fired
// at every deploy. It is 503 shutting_down now, with Retry-After, counted in no state.
func TestShutdownEndsAClaimUnderWay(t *testing.T) {
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 1)
	var runs atomic.Int32
	m, err := idem.New(ctx, idem.Options{DB: pool, Principal: alice})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(m.Route(idem.Route{Action: "POST /t"})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		w.WriteHeader(201)
	})))
	defer srv.Close()
	// The only connection is held: the request's claim waits for it.
	held, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	res := shutdownSend(t, srv.URL, `{"a":1}`, "S1")
	release := sync.OnceFunc(held.Release)
	defer release() // also when the test failed: srv.Close waits for the handler
	// The gap is held open by the connection: the request waits in the pool's Acquire.
	waitForStack(t, "pgxpool.(*Pool).Acquire")
	sctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- m.Shutdown(sctx) }()
	cancel()
	var r shutdownResult
	select {
	case r = <-res:
	case <-time.After(10 * time.Second):
		t.Fatal("the request was not answered after Shutdown's deadline")
	}
	release()
	if r.status != 503 || !strings.Contains(r.body, `"code":"`+idem.CodeShuttingDown+`"`) || r.header.Get("Retry-After") == "" {
		t.Errorf("a claim ended by Shutdown: %d %v %s", r.status, r.header, r.body)
	}
	if err := <-done; err == nil {
		t.Error("Shutdown returned nil after its context ended with a request in flight")
	}
	if n := runs.Load(); n != 0 {
		t.Errorf("the handler ran %d times", n)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem.idempotency_keys`); n != 0 {
		t.Errorf("%d keys stored", n)
	}
}

// TestShutdownRefusesAtOnceAfterItsContextEnded: a keyed request that came right after
// Shutdown's context was cancelled went on to claim its key, because the middleware learnt
// of the end from a callback that had not run yet; the claim was then ended under way and the
// client got 503 store_unavailable. From the moment the context has ended, the request is
// refused before any claim.
func TestShutdownRefusesAtOnceAfterItsContextEnded(t *testing.T) {
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	for i := range 50 {
		m, err := idem.New(ctx, idem.Options{DB: pool, Principal: alice})
		if err != nil {
			t.Fatal(err)
		}
		h := m.Route(idem.Route{Action: "POST /t"})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.WriteHeader(201)
		}))
		sctx, cancel := context.WithCancel(ctx)
		if err := m.Shutdown(sctx); err != nil {
			t.Fatal(err)
		}
		cancel()
		req := httptest.NewRequest("POST", "/t", strings.NewReader(`{"a":1}`))
		req.Header.Set("Idempotency-Key", "R"+string(rune('a'+i%26))+string(rune('a'+i/26)))
		req.Header.Set("Content-Type", "application/json")
		w := httptest.NewRecorder()
		h.ServeHTTP(w, req)
		if w.Code != 503 || !strings.Contains(w.Body.String(), idem.CodeShuttingDown) {
			t.Fatalf("round %d: a keyed request after Shutdown's context ended: %d %s", i, w.Code, w.Body.String())
		}
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem.idempotency_keys`); n != 0 {
		t.Errorf("%d keys stored", n)
	}
}

// waitForStack waits until some goroutine's stack holds frame: a gap in the middleware held
// open by a real resource (a held connection), seen from outside.
func waitForStack(t *testing.T, frame string) {
	t.Helper()
	buf := make([]byte, 1<<20)
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		if strings.Contains(string(buf[:runtime.Stack(buf, true)]), frame) {
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
	t.Fatalf("no goroutine reached %s", frame)
}

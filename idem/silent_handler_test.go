package idem_test

// A review of what the middleware answers and stores when a handler says nothing or too little
// (D173). Each test failed before; its comment says what it showed.

// Adversarial review (after D172): answers that are not the handler's real answer, stored or
// sent, around contexts that end and handlers that say nothing or little.

import (
	"context"
	"io"
	"log"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

func quietLogger() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// quietMiddleware is idem.New with o, principal alice and a logger that discards, for the
// reviews of what handlers answer.
func quietMiddleware(t *testing.T, o idem.Options) *idem.Middleware {
	t.Helper()
	o.Principal, o.Logger = alice, quietLogger()
	m, err := idem.New(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// TestReviewSilentInvalidStatusRollsBack: a handler that writes a status net/http refuses
// (WriteHeader(0): a status taken from a zero provider response, a map miss) panics under plain
// net/http: nothing is sent, the connection is dropped. The recorder ignored any status below
// 200, so under the middleware the handler's failure became net/http's implicit 200: its
// transaction committed and the 200 (with the error text as body) was stored and replayed for
// the TTL. The recorder panics as net/http does now: 500, rolled back.
func TestReviewSilentInvalidStatusRollsBack(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	pgtest.Exec(t, pool, `CREATE TABLE zz_effects (id int)`)
	m := quietMiddleware(t, idem.Options{DB: pool})
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if tx := idem.TxFrom(r.Context()); tx != nil {
			if _, err := tx.Exec(r.Context(), `INSERT INTO zz_effects VALUES (1)`); err != nil {
				t.Errorf("insert: %v", err)
			}
		}
		var providerStatus int // the provider call failed: a zero response
		w.WriteHeader(providerStatus)
		_, _ = w.Write([]byte("provider failed\n"))
	})
	plain := httptest.NewUnstartedServer(h)
	plain.Config.ErrorLog = log.New(io.Discard, "", 0)
	plain.Start()
	defer plain.Close()
	pst, _, pbody := pgtest.Send(t, ctx, "POST", plain.URL, `{"a":1}`)
	t.Logf("plain net/http: %d %q", pst, pbody)

	srv := httptest.NewServer(m.Route(idem.Route{Action: "POST /zz"})(h))
	defer srv.Close()
	st1, _, b1 := pgtest.Send(t, ctx, "POST", srv.URL, `{"a":1}`, "Idempotency-Key", "zz-inv")
	st2, h2, b2 := pgtest.Send(t, ctx, "POST", srv.URL, `{"a":1}`, "Idempotency-Key", "zz-inv")
	story, _, _ := idem.ReadKey(ctx, pool, "alice", "zz-inv")
	n := pgtest.Count(t, pool, `SELECT count(*) FROM zz_effects`)
	t.Logf("idem: first %d %q; repeat %d %q (replayed %q); stored %s %d; effects %d", st1, b1, st2, b2,
		h2.Get("Idempotent-Replayed"), story.State, story.Status, n)
	// The same on a lease route: the failed provider call's invalid status becomes a stored 200.
	lsrv := httptest.NewServer(m.Route(idem.Route{Action: "POST /zzl", Lease: 5 * time.Second})(h))
	defer lsrv.Close()
	lst, _, lb := pgtest.Send(t, ctx, "POST", lsrv.URL, `{"a":1}`, "Idempotency-Key", "zz-inv-l")
	lstory, _, _ := idem.ReadKey(ctx, pool, "alice", "zz-inv-l")
	t.Logf("lease route: first %d %q; stored %s %d", lst, lb, lstory.State, lstory.Status)
	if story.State == "completed" || n != 0 || st1 == 200 || lstory.State == "completed" {
		t.Fatalf("a handler that wrote an invalid status (a panic under net/http, which sent %d) had its work committed "+
			"(%d effect rows) and an implicit 200 stored (%s %d) and replayed (%d %q); on a lease route stored %s %d", pst, n, story.State, story.Status, st2, b2,
			lstory.State, lstory.Status)
	}
}

// TestReviewSilentUnkeyedLeaseRequestSilentAtShutdown: ErrShutdown's doc says "A lease route's handler
// that returns without writing anything is answered 503 shutting_down (it is not sent as an
// empty 200, nor stored)". A request without a key on a lease route (key optional) runs on
// the same work context, which Shutdown ends with ErrShutdown, but its silent handler was sent
// net/http's empty 200: the client was told the work succeeded although it never ran.
func TestReviewSilentUnkeyedLeaseRequestSilentAtShutdown(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	m := quietMiddleware(t, idem.Options{DB: pool})
	hIn := make(chan struct{}, 1)
	var cause atomic.Value
	srv := httptest.NewServer(m.Route(idem.Route{Action: "POST /pay", Lease: 5 * time.Second})(http.HandlerFunc(
		func(w http.ResponseWriter, r *http.Request) {
			hIn <- struct{}{}
			<-r.Context().Done()
			cause.Store(context.Cause(r.Context()))
			// gives up: writes nothing
		})))
	defer srv.Close()
	res := make(chan shutdownResult, 1)
	go func() {
		st, h, b := pgtest.Send(t, ctx, "POST", srv.URL, `{"p":1}`) // no key
		res <- shutdownResult{st, h, b}
	}()
	select {
	case <-hIn:
	case <-time.After(10 * time.Second):
		t.Fatal("no handler")
	}
	sctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel()
	_ = m.Shutdown(sctx)
	r := <-res
	t.Logf("client got %d %q; handler's cause %v", r.status, r.body, cause.Load())
	if r.status == 200 {
		t.Fatalf("an unkeyed lease request whose handler stopped on %v without writing was answered an empty 200 "+
			"(the work never ran); want 503 %s as for a keyed one", cause.Load(), idem.CodeShuttingDown)
	}
}

// TestReviewSilentUnkeyedLeaseRequestNotBoundedByLeaseTimeout: Route.LeaseTimeout "bounds a lease
// route's handler: its context ends then". A request without a key on a lease route ran
// without that bound: its handler's context did not end at LeaseTimeout.
func TestReviewSilentUnkeyedLeaseRequestNotBoundedByLeaseTimeout(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	m := quietMiddleware(t, idem.Options{DB: pool})
	var ended atomic.Bool
	srv := httptest.NewServer(m.Route(idem.Route{Action: "POST /pay", Lease: time.Second, LeaseTimeout: time.Second})(http.HandlerFunc(
		func(w http.ResponseWriter, r *http.Request) {
			select {
			case <-r.Context().Done():
				ended.Store(true)
				http.Error(w, "gave up", http.StatusGatewayTimeout)
			case <-time.After(4 * time.Second):
				w.WriteHeader(201)
			}
		})))
	defer srv.Close()
	start := time.Now()
	st, _, body := pgtest.Send(t, ctx, "POST", srv.URL, `{"p":1}`)
	took := time.Since(start)
	t.Logf("unkeyed: %d %q after %v", st, strings.TrimSpace(body), took.Round(time.Millisecond))
	if !ended.Load() {
		t.Fatalf("an unkeyed request on a lease route with LeaseTimeout 1s ran %v: its context did not end at LeaseTimeout", took.Round(time.Millisecond))
	}
}

// TestHandlerThatWritesNothingStoresAnEmpty200: Route.LeaseTimeout's doc says a handler that
// returns without writing, while its context still runs, answers net/http's empty 200, stored
// and replayed like any answer, on every route (a review of the go doc read "never an empty
// 200" as a rule for every such handler).
func TestHandlerThatWritesNothingStoresAnEmpty200(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 4)
	m := quietMiddleware(t, idem.Options{DB: pool})
	var runs atomic.Int32
	silent := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { runs.Add(1) })
	for _, route := range []idem.Route{{Action: "POST /tx"}, {Action: "POST /lease", Lease: 10 * time.Second}} {
		srv := httptest.NewServer(m.Route(route)(silent))
		key := "silent-" + strings.TrimPrefix(route.Action, "POST /")
		ctx := context.Background()
		st, _, body := pgtest.Send(t, ctx, "POST", srv.URL+"/x", `{}`, "Idempotency-Key", key)
		st2, h2, body2 := pgtest.Send(t, ctx, "POST", srv.URL+"/x", `{}`, "Idempotency-Key", key)
		srv.Close()
		if st != 200 || body != "" || st2 != 200 || body2 != "" || h2.Get("Idempotent-Replayed") != "true" {
			t.Errorf("%s: %d %q then %d %q replayed %q, want an empty 200 stored and replayed",
				route.Action, st, body, st2, body2, h2.Get("Idempotent-Replayed"))
		}
	}
	if n := runs.Load(); n != 2 {
		t.Errorf("the handler ran %d times, want once a route", n)
	}
}

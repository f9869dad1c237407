package idem_test

import (
	"context"
	"fmt"
	"io"
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

// d270Servers starts n middlewares (n processes) on one database, each serving POST /w.
func d270Servers(t *testing.T, n int, o idem.Options, rt idem.Route, h http.HandlerFunc) ([]*idem.Middleware, []string) {
	t.Helper()
	pool, _ := pgtest.NewPool(t, 8)
	o.DB = pool
	o.Principal = alice
	o.Logger = slog.New(slog.DiscardHandler)
	var ms []*idem.Middleware
	var urls []string
	for range n {
		m, err := idem.New(context.Background(), o)
		if err != nil {
			t.Fatal(err)
		}
		mux := http.NewServeMux()
		mux.Handle("POST /w", m.Route(rt)(h))
		srv := httptest.NewServer(mux)
		t.Cleanup(srv.Close)
		ms, urls = append(ms, m), append(urls, srv.URL+"/w")
	}
	return ms, urls
}

func d270Post(url, key string) string {
	req, _ := http.NewRequest(http.MethodPost, url, strings.NewReader(`{"a":1}`))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", key)
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		return "error " + err.Error()
	}
	defer res.Body.Close()
	b, _ := io.ReadAll(res.Body)
	return fmt.Sprintf("%d %s", res.StatusCode, b)
}

// TestShutdownGraceKeepsALeaseExtended (D270): Shutdown's deadline ends a lease handler's
// context and waits up to five seconds more for it. The heartbeat ran on the same context, so
// a handler that went on into the grace stopped being extended: at the lease's end another
// process took the key over and ran the work beside it, and the first's answer, given within
// the grace, was discarded (its client got 409). The lease is now extended until the handler
// returns.
func TestShutdownGraceKeepsALeaseExtended(t *testing.T) {
	t.Parallel()
	var runs atomic.Int32
	ms, urls := d270Servers(t, 2, idem.Options{DuplicateWait: 10 * time.Second}, idem.Route{Required: true, Lease: 2 * time.Second},
		func(w http.ResponseWriter, r *http.Request) {
			n := runs.Add(1)
			if n == 1 {
				time.Sleep(3500 * time.Millisecond) // past the deadline and the lease's end, within the grace
			}
			w.WriteHeader(http.StatusCreated)
			fmt.Fprintf(w, `{"run":%d}`, n)
		})
	first := make(chan string, 1)
	go func() { first <- d270Post(urls[0], "k1") }()
	for runs.Load() == 0 {
		time.Sleep(10 * time.Millisecond)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	shut := make(chan error, 1)
	go func() { shut <- ms[0].Shutdown(ctx) }()
	time.Sleep(400 * time.Millisecond)
	other := d270Post(urls[1], "k1") // the client's retry, on the other process
	f := <-first
	<-shut
	if n := runs.Load(); n != 1 || !strings.HasPrefix(f, "201") || !strings.HasPrefix(other, "201") || !strings.Contains(other, `"run":1`) {
		t.Errorf("the handler ran %d times; the first client got %q, the retry on the other process %q; want one run, and its 201 for both", n, f, other)
	}
}

// TestShutdownLetsTheLineReadAStoredAnswer (D270): duplicates waiting in the Gate behind a
// request that read the key's answer were told 409 request_in_progress when Shutdown began,
// for an answered key; they read the answer now, as one past its wait does.
func TestShutdownLetsTheLineReadAStoredAnswer(t *testing.T) {
	t.Parallel()
	for _, lease := range []time.Duration{0, 30 * time.Second} {
		t.Run(fmt.Sprint("lease ", lease), func(t *testing.T) {
			t.Parallel()
			ms, urls := d270Servers(t, 1, idem.Options{DuplicateWait: 20 * time.Second}, idem.Route{Required: true, Lease: lease},
				func(w http.ResponseWriter, r *http.Request) {
					time.Sleep(time.Second)
					w.WriteHeader(http.StatusCreated)
					_, _ = w.Write([]byte(`{"ok":1}`))
				})
			first := make(chan string, 1)
			go func() { first <- d270Post(urls[0], "k1") }()
			time.Sleep(100 * time.Millisecond)
			dups := make(chan string, 20)
			for range 20 {
				go func() { dups <- d270Post(urls[0], "k1") }()
			}
			f := <-first
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			go func() { _ = ms[0].Shutdown(ctx) }()
			var refused []string
			for range 20 {
				if d := <-dups; !strings.HasPrefix(d, "201") {
					refused = append(refused, d)
				}
			}
			if !strings.HasPrefix(f, "201") || len(refused) > 0 {
				t.Errorf("first %q; %d of 20 duplicates got no replay of the stored answer: %q", f, len(refused), refused)
			}
		})
	}
}

// TestRouteRefusesTheOtherKindsBound (D270): Route.WorkTimeout on a lease route, and
// LeaseTimeout on a transactional one, were accepted and ignored (a lease handler ran past a
// WorkTimeout of 300 ms to its 5-minute LeaseTimeout). Route panics on them, as on any
// declaration that cannot work.
func TestRouteRefusesTheOtherKindsBound(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 2)
	m, err := idem.New(context.Background(), idem.Options{DB: pool, Principal: alice, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	for _, rt := range []idem.Route{
		{Lease: time.Second, WorkTimeout: 300 * time.Millisecond},
		{LeaseTimeout: time.Minute},
	} {
		func() {
			defer func() {
				if p := recover(); p == nil || !strings.Contains(fmt.Sprint(p), "WorkTimeout") {
					t.Errorf("Route(%+v): panic %v; want one that names the bounds", rt, p)
				}
			}()
			m.Route(rt)
		}()
	}
	m.Route(idem.Route{Lease: time.Second, LeaseTimeout: time.Minute})
	m.Route(idem.Route{WorkTimeout: time.Minute})
}

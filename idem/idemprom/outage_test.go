package idemprom_test

import (
	"context"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/idem/idemprom"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// holeProxy is a TCP proxy to target that, once hole is set, stops forwarding the client's
// bytes (a black-holed network: the server never sees the statement, nothing comes back), and
// cut closes every connection it made (a handler stuck on the silent database ends).
func holeProxy(t *testing.T, target string, hole *atomic.Bool) (addr string, cut func()) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var conns []net.Conn
	cut = func() {
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			_ = c.Close()
		}
	}
	t.Cleanup(func() { _ = ln.Close(); cut() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s, err := net.Dial("tcp", target)
			if err != nil {
				_ = c.Close()
				continue
			}
			mu.Lock()
			conns = append(conns, c, s)
			mu.Unlock()
			go func() { _, _ = io.Copy(c, s) }()
			go func() {
				buf := make([]byte, 32<<10)
				for {
					n, err := c.Read(buf)
					if n > 0 && !hole.Load() {
						if _, werr := s.Write(buf[:n]); werr != nil {
							return
						}
					}
					if err != nil {
						return
					}
				}
			}()
		}
	}()
	return ln.Addr().String(), cut
}

// TestStoreOutagePastAnOuterDeadlineIsAStoreError: D186 answers 409, counted busy, to a
// request whose context ended by a deadline while it waited for another holder of its key. Its
// first mend matched any context.DeadlineExceeded once the request's context had ended, and
// the claim's own bound on a silent database is one: a fresh key whose database went silent,
// with an outer timeout shorter than that bound, was told "in progress" and counted busy, so
// IdemStoreErrors stayed silent through the outage. It is 503, counted store_error.
func TestStoreOutagePastAnOuterDeadlineIsAStoreError(t *testing.T) {
	t.Parallel()
	storeOutage(t, time.Second)
}

// TestStoreOutageIsAStoreError: the same outage without an outer deadline is 503
// store_unavailable, counted store_error.
func TestStoreOutageIsAStoreError(t *testing.T) {
	t.Parallel()
	storeOutage(t, 0)
}

func storeOutage(t *testing.T, outer time.Duration) {
	ctx := context.Background()
	dbURL := pgtest.NewDB(t)
	var hole atomic.Bool
	target := pgtest.TCPAddr(t)
	addr, cut := holeProxy(t, target, &hole)
	proxied := pgtest.Via(t, dbURL, addr)
	cfg, err := pgxpool.ParseConfig(proxied)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 4
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	reg := prometheus.NewRegistry()
	m, err := idem.New(ctx, idem.Options{DB: pool, Principal: func(*http.Request) (string, bool) { return "alice", true },
		Metrics: idemprom.NewObserver(reg), Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	inner := m.Route(idem.Route{Action: "POST /t"})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusCreated)
	}))
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if outer > 0 {
			c, cancel := context.WithTimeout(r.Context(), outer) // an outer middleware's timeout
			defer cancel()
			r = r.WithContext(c)
		}
		inner.ServeHTTP(w, r)
	}))
	defer srv.Close()
	defer cut() // before srv.Close: a handler stuck on the silent database ends
	// Warm: the store answers.
	if st, _, body := pgtest.Send(t, ctx, "POST", srv.URL+"/t", `{}`, "Idempotency-Key", "warm"); st != http.StatusCreated {
		t.Fatalf("warm-up: %d %s", st, body)
	}
	hole.Store(true)
	began := time.Now()
	st, hdr, body := pgtest.Send(t, ctx, "POST", srv.URL+"/t", `{}`, "Idempotency-Key", "fresh-in-outage")
	took := time.Since(began)
	busy := value(t, reg, "idempotency_requests_total", "state", "busy")
	storeErr := value(t, reg, "idempotency_requests_total", "state", "store_error")
	t.Logf("fresh key, store silent: %d (Retry-After %q) after %v: %s; busy %v store_error %v", st, hdr.Get("Retry-After"),
		took.Round(time.Millisecond), body, busy, storeErr)
	if st == http.StatusConflict || busy != 0 || storeErr != 1 {
		t.Fatalf("a fresh key whose database went silent, past the outer deadline: %d %s, counted busy %v store_error %v; "+
			"want 503 store_unavailable counted store_error (nothing holds the key)", st, body, busy, storeErr)
	}
}

// outageAtConnect sends a fresh key once the database behind the pool went silent and the
// pool lost its connections (the claim must connect), through an outer middleware's timeout
// (outer, 0: none). dsnExtra is added to the pool's connection string.
func outageAtConnect(t *testing.T, dsnExtra string, outer time.Duration) (st int, hdr http.Header, body string, took time.Duration, busy, storeErr float64) {
	ctx := context.Background()
	dbURL := pgtest.NewDB(t)
	var hole atomic.Bool
	addr, cut := holeProxy(t, pgtest.TCPAddr(t), &hole)
	cfg, err := pgxpool.ParseConfig(pgtest.Via(t, dbURL, addr) + dsnExtra)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 4
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	reg := prometheus.NewRegistry()
	m, err := idem.New(ctx, idem.Options{DB: pool, Principal: func(*http.Request) (string, bool) { return "alice", true },
		Metrics: idemprom.NewObserver(reg), Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	inner := m.Route(idem.Route{Action: "POST /t"})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusCreated)
	}))
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if outer > 0 {
			c, cancel := context.WithTimeout(r.Context(), outer) // an outer middleware's timeout
			defer cancel()
			r = r.WithContext(c)
		}
		inner.ServeHTTP(w, r)
	}))
	defer srv.Close()
	defer cut() // before srv.Close: a handler stuck on the silent database ends
	if st, _, body := pgtest.Send(t, ctx, "POST", srv.URL+"/t", `{}`, "Idempotency-Key", "warm"); st != http.StatusCreated {
		t.Fatalf("warm-up: %d %s", st, body)
	}
	hole.Store(true)
	pool.Reset() // the connections were lost with the outage: the next claim must connect
	sctx, scancel := context.WithTimeout(ctx, 15*time.Second)
	defer scancel()
	began := time.Now()
	st, hdr, body = pgtest.Send(t, sctx, "POST", srv.URL+"/t", `{}`, "Idempotency-Key", "fresh-in-outage")
	took = time.Since(began)
	busy = value(t, reg, "idempotency_requests_total", "state", "busy")
	storeErr = value(t, reg, "idempotency_requests_total", "state", "store_error")
	t.Logf("fresh key, store silent at connect: %d (Retry-After %q) after %v: %s; busy %v store_error %v",
		st, hdr.Get("Retry-After"), took.Round(time.Millisecond), body, busy, storeErr)
	return st, hdr, body, took, busy, storeErr
}

// TestOutageAtConnectPastAnOuterDeadlineIsAStoreError: a store that does not answer is a 503
// counted store_error, whatever outer deadline also ended (D186). The second mend recognised
// only the claim statement's own bound: when the pool had to open a new connection to a
// silent database (its connections lost with a failover, a restart, a network cut), the
// connect's own connect_timeout was a context.DeadlineExceeded too, and with an outer deadline
// shorter than it the outage was answered 409 "in progress", counted busy. Only the end of a
// wait for another holder of the key is answered so now (dbidem.IsWaitEnded).
func TestOutageAtConnectPastAnOuterDeadlineIsAStoreError(t *testing.T) {
	t.Parallel()
	st, _, _, _, busy, storeErr := outageAtConnect(t, " connect_timeout=1", 300*time.Millisecond)
	if st == http.StatusConflict || busy != 0 || storeErr != 1 {
		t.Fatalf("a fresh key whose database is silent at connect, past the outer deadline: %d, counted busy %v store_error %v; "+
			"want 503 store_unavailable counted store_error (nothing holds the key; IdemStoreErrors must see the outage)",
			st, busy, storeErr)
	}
}

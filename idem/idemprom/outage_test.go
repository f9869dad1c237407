package idemprom_test

import (
	"context"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/idem/idemprom"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// blackHoleProxy is a TCP proxy to target that, once hole is set, stops forwarding the client's
// bytes (a black-holed network: the server never sees the statement, nothing comes back).
func blackHoleProxy(t *testing.T, target string, hole *atomic.Bool) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
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
			t.Cleanup(func() { _ = c.Close(); _ = s.Close() })
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
	return ln.Addr().String()
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
	proxied := pgtest.Via(t, dbURL, blackHoleProxy(t, target, &hole))
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

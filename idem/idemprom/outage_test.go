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
	storeOutage(t, "", time.Second, false)
}

// TestStoreOutageIsAStoreError: the same outage without an outer deadline is 503
// store_unavailable, counted store_error.
func TestStoreOutageIsAStoreError(t *testing.T) {
	t.Parallel()
	storeOutage(t, "", 0, false)
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
	storeOutage(t, " connect_timeout=1", 300*time.Millisecond, true)
}

// storeOutage sends a fresh key once the database behind the pool went silent, through an
// outer middleware's timeout (outer, 0: none), and checks it is answered 503, counted
// store_error. dsnExtra is added to the pool's connection string; reconnect drops the pool's
// connections first (lost with the outage: the claim must connect).
func storeOutage(t *testing.T, dsnExtra string, outer time.Duration, reconnect bool) {
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
	if reconnect {
		pool.Reset()
	}
	sctx, scancel := context.WithTimeout(ctx, 15*time.Second)
	defer scancel()
	began := time.Now()
	st, hdr, body := pgtest.Send(t, sctx, "POST", srv.URL+"/t", `{}`, "Idempotency-Key", "fresh-in-outage")
	busy := value(t, reg, "idempotency_requests_total", "state", "busy")
	storeErr := value(t, reg, "idempotency_requests_total", "state", "store_error")
	if st != http.StatusServiceUnavailable || hdr.Get("Retry-After") == "" || busy != 0 || storeErr != 1 {
		t.Fatalf("a fresh key whose database went silent (outer deadline %v, connect again %v): %d %s after %v, counted busy %v store_error %v; "+
			"want 503 store_unavailable counted store_error (nothing holds the key)", outer, reconnect, st, body,
			time.Since(began).Round(time.Millisecond), busy, storeErr)
	}
}

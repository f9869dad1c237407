package idemhttp_test

import (
	"context"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/internal/dbidem"
	idemhttp "github.com/pgidem/pgidem/internal/http"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// slowLinkTo forwards TCP to the test server, the server's bytes at rate bytes a second (a
// copy of internal/dbidem's slowLink).
func slowLinkTo(t *testing.T, rate int) string {
	t.Helper()
	target := pgtest.TCPAddr(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var conns []net.Conn
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			c.Close()
		}
	})
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s, err := net.Dial("tcp", target)
			if err != nil {
				c.Close()
				continue
			}
			mu.Lock()
			conns = append(conns, c, s)
			mu.Unlock()
			go func() { _, _ = io.Copy(s, c) }()
			go func() {
				buf := make([]byte, 32<<10)
				start, sent := time.Now(), 0
				for {
					n, err := s.Read(buf)
					if n > 0 {
						if _, werr := c.Write(buf[:n]); werr != nil {
							return
						}
						sent += n
						if ahead := time.Duration(sent)*time.Second/time.Duration(rate) - time.Since(start); ahead > 0 {
							time.Sleep(ahead)
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

func replyServer(t *testing.T, pool *pgxpool.Pool, body string) *httptest.Server {
	t.Helper()
	m, err := idemhttp.New(idemhttp.Options{
		DB: pool,
		Principal: func(r *http.Request) (string, bool) {
			p := r.Header.Get("X-Principal")
			return p, p != ""
		},
		Logger:             slog.New(slog.NewTextHandler(io.Discard, nil)),
		MaxStoredBodyBytes: 16 << 20,
		LockTimeout:        5 * time.Second,
	})
	if err != nil {
		t.Fatal(err)
	}
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("X-Again") != "" {
			http.Error(w, "ran again", 500)
			return
		}
		w.Header().Set("Content-Type", "text/plain")
		w.WriteHeader(201)
		_, _ = io.WriteString(w, body)
	})
	mux := http.NewServeMux()
	mux.Handle("POST /big", m.Route(idemhttp.Route{Required: true})(h))
	mux.Handle("POST /bigjob", m.Route(idemhttp.Route{Required: true, Lease: time.Minute})(h))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return srv
}

func replyPost(t *testing.T, url, key string, again bool) (int, string, http.Header) {
	t.Helper()
	req, err := http.NewRequest("POST", url, strings.NewReader(`{}`))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Idempotency-Key", key)
	req.Header.Set("X-Principal", "alice")
	req.Header.Set("Content-Type", "application/json")
	if again {
		req.Header.Set("X-Again", "1")
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), resp.Header
}

// A large stored body (12 MB, MaxStoredBodyBytes 16 MB) replays through the middleware on a
// 1.5 MB/s link, on a transactional and a lease route: the claim's reply is arriving, so its
// bound waits for it (D213), and a client that retries gets the answer it paid for.
func TestReplyLargeStoredBodyOnASlowLinkReplays(t *testing.T) {
	t.Parallel()
	pool, url := pgtest.NewPool(t, 4)
	body := strings.Repeat("y", 12<<20)
	direct := replyServer(t, pool, body)
	slowPool, err := pgxpool.New(context.Background(), pgtest.Via(t, url, slowLinkTo(t, 3<<19)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(slowPool.Close)
	slow := replyServer(t, slowPool, "other")
	for _, route := range []string{"/big", "/bigjob"} {
		t.Run(route, func(t *testing.T) {
			key := "large" + route
			if st, b, _ := replyPost(t, direct.URL+route, key, false); st != 201 || len(b) != len(body) {
				t.Fatalf("first: %d, %d bytes", st, len(b))
			}
			start := time.Now()
			st, b, h := replyPost(t, slow.URL+route, key, true)
			took := time.Since(start)
			if st != 201 || len(b) != len(body) || h.Get("Idempotent-Replayed") != "true" {
				t.Fatalf("replay of 12 MB on a slow link after %s: %d, %d bytes (%.200s), replayed %q",
					took, st, len(b), b, h.Get("Idempotent-Replayed"))
			}
			t.Logf("replayed 12 MB on a 1.5 MB/s link in %s", took)
		})
	}
}

// trickleLink forwards TCP to the test server; once *on is set, the server's bytes go one
// every 4 s (a path that has all but stopped answering).
func trickleLink(t *testing.T, on *atomic.Bool) string {
	t.Helper()
	target := pgtest.TCPAddr(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closed := make(chan struct{})
	var mu sync.Mutex
	var conns []net.Conn
	t.Cleanup(func() {
		close(closed)
		ln.Close()
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			c.Close()
		}
	})
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s, err := net.Dial("tcp", target)
			if err != nil {
				c.Close()
				continue
			}
			mu.Lock()
			conns = append(conns, c, s)
			mu.Unlock()
			go func() { _, _ = io.Copy(s, c) }()
			go func() {
				buf := make([]byte, 32<<10)
				for {
					n, err := s.Read(buf)
					for i := 0; i < n; {
						if !on.Load() {
							if _, werr := c.Write(buf[i:n]); werr != nil {
								return
							}
							break
						}
						if _, werr := c.Write(buf[i : i+1]); werr != nil {
							return
						}
						i++
						select {
						case <-closed:
							return
						case <-time.After(4 * time.Second):
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

// A replay whose reply trickles (one byte every 4 s) through the middleware: the bound did not
// end while a byte came within each 5 s, and the work context outlives the client and has no
// WorkTimeout before the claim, so the request and its connection stayed until Shutdown. A
// reply past its bound must bring 64 KiB in each margin (D213): 503 store_unavailable within
// about two margins.
func TestReplyTrickleThroughTheMiddlewareIsBounded(t *testing.T) {
	t.Parallel()
	pool, url := pgtest.NewPool(t, 4)
	direct := replyServer(t, pool, "small answer")
	var on atomic.Bool
	tricklePool, err := pgxpool.New(context.Background(), pgtest.Via(t, url, trickleLink(t, &on))+" pool_max_conns=1")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(tricklePool.Close)
	slow := replyServer(t, tricklePool, "other")
	key := "trickle"
	if st, _, _ := replyPost(t, direct.URL+"/big", key, false); st != 201 {
		t.Fatalf("first: %d", st)
	}
	if st, _, h := replyPost(t, slow.URL+"/big", key, true); st != 201 || h.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("warm-up replay: %d", st)
	}
	on.Store(true)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, "POST", slow.URL+"/big", strings.NewReader(`{}`))
	req.Header.Set("Idempotency-Key", key)
	req.Header.Set("X-Principal", "alice")
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Again", "1")
	start := time.Now()
	resp, err := http.DefaultClient.Do(req)
	took := time.Since(start)
	if err == nil {
		resp.Body.Close()
		if resp.StatusCode != http.StatusServiceUnavailable || took > 3*dbidem.ClaimReplyMargin {
			t.Fatalf("a replay whose reply trickles: %d after %s, want 503 within about two margins", resp.StatusCode, took)
		}
		return
	}
	// The client has gone: is the request's connection given back?
	left := time.Now()
	for tricklePool.Stat().AcquiredConns() > 0 && time.Since(left) < 15*time.Second {
		time.Sleep(100 * time.Millisecond)
	}
	held := tricklePool.Stat().AcquiredConns()
	on.Store(false) // let the reply through, so that the server's Close does not wait for ever
	t.Fatalf("a replay whose reply trickles had no answer after %s (%v); %s after its client left, %d connection(s) still held by it",
		took, err, time.Since(left).Round(time.Second), held)
}

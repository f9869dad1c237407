package idemhttp_test

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/internal/dbidem"
	idemhttp "github.com/pgidem/pgidem/internal/http"
	"github.com/pgidem/pgidem/internal/pgtest"
)

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
	slowPool, err := pgxpool.New(context.Background(), pgtest.Via(t, url, pgtest.SlowLink(t, 3<<19, 0)))
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

// A replay whose bytes were all written long before the client had them (a buffering hop in
// front of a slow link) sat idle in its transaction past the server's idle_in_transaction
// timeout (a lease claim's own, 5 s; a DBA's on the role for a transactional route): the
// server ended the connection before the claim's COMMIT, and the client that had paid for the
// answer got 503 store_unavailable. The claim wrote nothing, so its replay stands (D226).
func TestReplayOutlastingTheServersIdleTimeoutThroughTheMiddleware(t *testing.T) {
	t.Parallel()
	pool, url := pgtest.NewPool(t, 4)
	body := strings.Repeat("y", 2<<20)
	direct := replyServer(t, pool, body)
	p := pgtest.NewProxy(t, pgtest.TCPAddr(t))
	p.Buffered.Store(true)
	p.Rate.Store(300 << 10)
	slowPool, err := pgxpool.New(context.Background(), pgtest.Via(t, url, p.Addr)+" idle_in_transaction_session_timeout=2000")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(slowPool.Close)
	slow := replyServer(t, slowPool, "other")
	for _, route := range []string{"/big", "/bigjob"} {
		t.Run(route, func(t *testing.T) {
			key := "idle" + route
			if st, b, _ := replyPost(t, direct.URL+route, key, false); st != 201 || b != body {
				t.Fatalf("first: %d, %d bytes", st, len(b))
			}
			start := time.Now()
			st, b, h := replyPost(t, slow.URL+route, key, true)
			took := time.Since(start)
			if st != 201 || b != body || h.Get("Idempotent-Replayed") != "true" {
				t.Fatalf("replay after %s: %d, %d bytes (%.200s), replayed %q", took, st, len(b), b, h.Get("Idempotent-Replayed"))
			}
			if took < 6*time.Second {
				t.Fatalf("the link forwarded 2 MB in %s: the transaction never sat idle past its timeout", took)
			}
		})
	}
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
	trickle := pgtest.NewProxy(t, pgtest.TCPAddr(t))
	tricklePool, err := pgxpool.New(context.Background(), pgtest.Via(t, url, trickle.Addr)+" pool_max_conns=1")
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
	trickle.SetFault(pgtest.Trickle)
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
	trickle.SetFault(pgtest.Forward) // let the reply through, so that the server's Close does not wait for ever
	t.Fatalf("a replay whose reply trickles had no answer after %s (%v); %s after its client left, %d connection(s) still held by it",
		took, err, time.Since(left).Round(time.Second), held)
}

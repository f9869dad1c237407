package idem_test

import (
	"bytes"
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

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/idemclient"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// cpServer is the middleware over the deposits handler on an httptest server.
func cpServer(t *testing.T, opts idem.Options) (*httptest.Server, func(string) int) {
	t.Helper()
	pool, _ := pgtest.NewPool(t, 8)
	pgtest.Exec(t, pool, `CREATE TABLE deposits (id serial PRIMARY KEY, account text, amount int)`)
	opts.DB = pool
	if opts.Principal == nil {
		opts.Principal = alice
	}
	opts.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	m, err := idem.New(context.Background(), opts)
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("POST /accounts/{id}/deposits", m.Route(idem.Route{Required: true})(deposits(make(chan struct{}))))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return srv, func(amount string) int {
		return pgtest.Count(t, pool, `SELECT count(*) FROM deposits WHERE amount = $1`, amount)
	}
}

// TestLargeBodyFinalAnswerIsNotRetried: a final answer the server gives before it has read a
// large body (413 request_too_large over MaxBodyBytes, 400 idempotency_key_invalid) "ends the
// operation" at once (go doc idemclient: "A final answer (a 2xx, any other 4xx ...) ends the
// operation: retrying it would get the same answer"), Attempts 1, not ErrGaveUp.
func TestLargeBodyFinalAnswerIsNotRetried(t *testing.T) {
	t.Parallel()
	srv, _ := cpServer(t, idem.Options{})
	c := &idemclient.Client{Backoff: 10 * time.Millisecond, MaxBackoff: 20 * time.Millisecond}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	for _, size := range []int{2 << 20, 16 << 20} {
		body := `{"amount":1,"pad":"` + strings.Repeat("x", size) + `"}`
		req, _ := http.NewRequest("POST", srv.URL+"/accounts/7/deposits", bytes.NewReader([]byte(body)))
		req.Header.Set("Content-Type", "application/json")
		res, err := c.Do(ctx, req, "")
		if err != nil || res.Status != 413 || res.Code() != "request_too_large" || res.Attempts != 1 {
			t.Errorf("%d bytes: status %d code %q attempts %d err %v; want 413 request_too_large, 1 attempt", size, res.Status, res.Code(), res.Attempts, err)
		}
		req, _ = http.NewRequest("POST", srv.URL+"/accounts/7/deposits", bytes.NewReader([]byte(body)))
		req.Header.Set("Content-Type", "application/json")
		res, err = c.Do(ctx, req, strings.Repeat("k", 300))
		if err != nil || res.Status != 400 || res.Code() != "idempotency_key_invalid" || res.Attempts != 1 {
			t.Errorf("%d bytes, long key: status %d code %q attempts %d err %v; want 400 idempotency_key_invalid, 1 attempt", size, res.Status, res.Code(), res.Attempts, err)
		}
	}
}

// cpRouteTo sends the first request to a and every later one to b (the same service behind
// a load balancer that moved the client).
type cpRouteTo struct {
	a, b string
	n    atomic.Int32
}

func (z *cpRouteTo) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	host := z.b
	if z.n.Add(1) == 1 {
		host = z.a
	}
	r.URL.Host, r.Host = host, ""
	return http.DefaultTransport.RoundTrip(r)
}

// TestImpatientClientAcrossProcesses: a transactional route whose work takes 2.5 s, a client
// whose attempts last 300 ms; its first attempt reaches process A, its retries process B (same
// database, small pools). docs/http.md: the work "runs to its end and commits with its
// answer ... the client's retry waits for it while it runs and replays it after"; B's duplicate
// waits on the key's row lock, its waits end when its client goes away, and it is "answered
// the moment the first commits". One effect, the answer replayed, soon after the commit; and B
// still serves fresh keys afterwards (its connections were not lost to abandoned waits). With
// shutdown: A shuts down with a 500 ms deadline while the work runs: it rolls back, and the
// retry on B runs the work (one effect, a 201 not replayed).
func TestImpatientClientAcrossProcesses(t *testing.T) {
	t.Parallel()
	for _, shutdown := range []bool{false, true} {
		name := "plain"
		if shutdown {
			name = "shutdown"
		}
		t.Run(name, func(t *testing.T) {
			pool, url := pgtest.NewPool(t, 3)
			pgtest.Exec(t, pool, `CREATE TABLE deposits (id serial PRIMARY KEY, account text, amount int, by text)`)
			mk := func(by string, p *pgxpool.Pool, slow time.Duration) (*idem.Middleware, *httptest.Server) {
				m, err := idem.New(context.Background(), idem.Options{DB: p, Principal: alice, LockTimeout: 500 * time.Millisecond,
					Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
				if err != nil {
					t.Fatal(err)
				}
				mux := http.NewServeMux()
				mux.Handle("POST /accounts/{id}/deposits", m.Route(idem.Route{Required: true})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					var in struct {
						Amount int `json:"amount"`
					}
					if !idem.DecodeJSON(w, r, &in) {
						return
					}
					select {
					case <-time.After(slow):
					case <-r.Context().Done():
						http.Error(w, "ended", http.StatusServiceUnavailable)
						return
					}
					var id int
					if err := idem.TxFrom(r.Context()).QueryRow(r.Context(), `INSERT INTO deposits (account, amount, by) VALUES ($1, $2, $3) RETURNING id`,
						r.PathValue("id"), in.Amount, by).Scan(&id); err != nil {
						http.Error(w, err.Error(), 500)
						return
					}
					w.Header().Set("Content-Type", "application/json")
					w.WriteHeader(201)
					fmt.Fprintf(w, `{"id":%d}`, id)
				})))
				srv := httptest.NewServer(mux)
				t.Cleanup(srv.Close)
				return m, srv
			}
			ma, a := mk("a", pool, 2500*time.Millisecond)
			poolB, err := pgxpool.New(context.Background(), url+" pool_max_conns=3")
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(poolB.Close)
			_, b := mk("b", poolB, 10*time.Millisecond)
			rt := &cpRouteTo{a: strings.TrimPrefix(a.URL, "http://"), b: strings.TrimPrefix(b.URL, "http://")}
			c := &idemclient.Client{HTTP: &http.Client{Transport: rt}, AttemptTimeout: 300 * time.Millisecond,
				Backoff: 20 * time.Millisecond, MaxBackoff: 100 * time.Millisecond, MaxAttempts: -1}
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			if shutdown {
				time.AfterFunc(700*time.Millisecond, func() {
					sctx, scancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
					defer scancel()
					_ = ma.Shutdown(sctx)
				})
			}
			req, _ := http.NewRequest("POST", a.URL+"/accounts/7/deposits", strings.NewReader(`{"amount":42}`))
			req.Header.Set("Content-Type", "application/json")
			start := time.Now()
			res, err := c.Do(ctx, req, "")
			took := time.Since(start)
			n := pgtest.Count(t, pool, `SELECT count(*) FROM deposits WHERE amount = 42`)
			var by string
			if n == 1 {
				if err := pool.QueryRow(context.Background(), `SELECT by FROM deposits WHERE amount = 42`).Scan(&by); err != nil {
					t.Fatal(err)
				}
			}
			t.Logf("%s: %d replayed %v attempts %d in %s, %d effects by %q, err %v", name, res.Status, res.Replayed, res.Attempts, took, n, by, err)
			if err != nil || res.Status != 201 || n != 1 {
				t.Fatalf("%s: %d %s err %v, %d effects; want 201 and one effect", name, res.Status, res.Body, err, n)
			}
			// The effect's author, not Replayed, tells who ran: B's own answer is
			// replayed too when B's run outlasts the client's 300 ms attempt.
			if !shutdown && (by != "a" || !res.Replayed || took > 4*time.Second) {
				t.Errorf("plain: effect by %q, replayed %v after %s; want A's answer replayed soon after its commit (2.5 s)", by, res.Replayed, took)
			}
			if shutdown && (by != "b" || took > 5*time.Second) {
				t.Errorf("shutdown: effect by %q after %s; want B's own run soon after A rolled back", by, took)
			}
			// B still serves.
			for i := range 6 {
				req, _ := http.NewRequest("POST", b.URL+"/accounts/8/deposits", strings.NewReader(fmt.Sprintf(`{"amount":%d}`, 100+i)))
				req.Header.Set("Content-Type", "application/json")
				rctx, rcancel := context.WithTimeout(ctx, 3*time.Second)
				r, err := (&idemclient.Client{MaxAttempts: 1}).Do(rctx, req, "")
				rcancel()
				if err != nil || r.Status != 201 {
					t.Errorf("B after the storm, fresh key %d: %d %s %v", i, r.Status, r.Body, err)
				}
			}
		})
	}
}

package idem_test

// Adversarial review: idemclient against lease routes, end to end. Each test asks the
// promise "every repeat gets the first answer, soon" and "a client that keeps retrying must
// converge" of a lease route with idemclient as the client.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/idemclient"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// clientProv is a provider that deduplicates by its idempotency key, and counts.
type clientProv struct {
	mu    sync.Mutex
	calls int
	keys  map[string]int
}

func (p *clientProv) pay(key string) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.calls++
	if p.keys == nil {
		p.keys = map[string]int{}
	}
	if _, ok := p.keys[key]; !ok {
		p.keys[key] = len(p.keys) + 1
	}
	return p.keys[key]
}

func (p *clientProv) counts() (calls, keys int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.calls, len(p.keys)
}

// clientLeaseApp is one "process": a middleware on pool with a lease route POST /pay whose handler
// is behave(n) for the n-th call (1-based) of this process.
type clientLeaseApp struct {
	m     *idem.Middleware
	srv   *httptest.Server
	calls atomic.Int32
}

func clientLeaseServe(t *testing.T, pool *pgxpool.Pool, o idem.Options, rt idem.Route,
	behave func(n int32, w http.ResponseWriter, r *http.Request)) *clientLeaseApp {
	t.Helper()
	o.DB = pool
	if o.Principal == nil {
		o.Principal = alice
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	m, err := idem.New(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	a := &clientLeaseApp{m: m}
	if rt.Action == "" {
		rt.Action = "POST /pay"
	}
	mux := http.NewServeMux()
	mux.Handle("POST /pay", m.Route(rt)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		behave(a.calls.Add(1), w, r)
	})))
	a.srv = httptest.NewServer(mux)
	t.Cleanup(a.srv.Close)
	return a
}

func clientPayReq(t *testing.T, url, body string) *http.Request {
	t.Helper()
	req, err := http.NewRequest("POST", url+"/pay", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	return req
}

// clientPay is the usual lease handler: it pays the provider under the provider key after work d
// (honouring its context), and answers 201 with the payout number.
func clientPay(prov *clientProv, d time.Duration) func(n int32, w http.ResponseWriter, r *http.Request) {
	return func(n int32, w http.ResponseWriter, r *http.Request) {
		claim, _ := idem.ClaimOf(r.Context())
		select {
		case <-time.After(d):
		case <-r.Context().Done():
			http.Error(w, "gave up", http.StatusBadGateway)
			return
		}
		payout := prov.pay(claim.ProviderKey)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"id":"po_%d","call":%d}`, payout, n)
	}
}

// TestLeaseClientImpatientClient: an attempt timeout shorter than the lease work (and the work
// longer than the lease, so that it is extended): the client converges on the one answer,
// replayed, with one provider call, soon after the work ends.
func TestLeaseClientImpatientClient(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 8)
	prov := &clientProv{}
	a := clientLeaseServe(t, pool, idem.Options{}, idem.Route{Required: true, Lease: time.Second}, clientPay(prov, 2500*time.Millisecond))
	c := &idemclient.Client{AttemptTimeout: 500 * time.Millisecond}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	began := time.Now()
	res, err := c.Do(ctx, clientPayReq(t, a.srv.URL, `{"amount":1}`), "")
	took := time.Since(began)
	calls, keys := prov.counts()
	t.Logf("status %d replayed %v attempts %d took %v body %s calls %d", res.Status, res.Replayed, res.Attempts, took, res.Body, calls)
	if err != nil || res.Status != 201 || !res.Replayed || res.Attempts < 2 || a.calls.Load() != 1 || calls != 1 || keys != 1 {
		t.Fatalf("got %d %s replayed %v attempts %d err %v; handler runs %d, provider calls %d keys %d",
			res.Status, res.Body, res.Replayed, res.Attempts, err, a.calls.Load(), calls, keys)
	}
	if took > 2500*time.Millisecond+2*time.Second {
		t.Errorf("converged after %v, the work took 2.5 s", took)
	}
	// A later Do under the key: the same answer, replayed, one attempt.
	again, err := c.Do(ctx, clientPayReq(t, a.srv.URL, `{"amount":1}`), res.Key)
	if err != nil || again.Status != 201 || !again.Replayed || again.Attempts != 1 || string(again.Body) != string(res.Body) || again.Key != res.Key {
		t.Fatalf("again: %d %s replayed %v attempts %d key %q err %v", again.Status, again.Body, again.Replayed, again.Attempts, again.Key, err)
	}
}

// TestLeaseClientFailThenSucceed: the handler answers 502 (the provider failed) and then succeeds
// on the retry: the client gets 201 (not a replay: the second attempt ran), two attempts, one
// provider key.
func TestLeaseClientFailThenSucceed(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 8)
	prov := &clientProv{}
	var pks sync.Map
	pay := clientPay(prov, 0)
	a := clientLeaseServe(t, pool, idem.Options{}, idem.Route{Required: true, Lease: 2 * time.Second},
		func(n int32, w http.ResponseWriter, r *http.Request) {
			claim, _ := idem.ClaimOf(r.Context())
			pks.Store(claim.ProviderKey, true)
			if n == 1 {
				http.Error(w, "provider down", http.StatusBadGateway)
				return
			}
			pay(n, w, r)
		})
	c := &idemclient.Client{}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	began := time.Now()
	res, err := c.Do(ctx, clientPayReq(t, a.srv.URL, `{"amount":2}`), "")
	took := time.Since(began)
	n := 0
	pks.Range(func(any, any) bool { n++; return true })
	if err != nil || res.Status != 201 || res.Replayed || res.Attempts != 2 || a.calls.Load() != 2 || n != 1 || took > 3*time.Second {
		t.Fatalf("got %d %s replayed %v attempts %d err %v took %v; runs %d, provider keys %d",
			res.Status, res.Body, res.Replayed, res.Attempts, err, took, a.calls.Load(), n)
	}
}

// TestLeaseClientPanicThenSucceed: the handler panics (a bug), then succeeds on the retry; and a
// handler that panics with http.ErrAbortHandler (the connection dropped) likewise.
func TestLeaseClientPanicThenSucceed(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		p    any
	}{{"panic", "boom"}, {"abort", http.ErrAbortHandler}} {
		t.Run(tc.name, func(t *testing.T) {
			pool, _ := pgtest.NewPool(t, 8)
			prov := &clientProv{}
			pay := clientPay(prov, 0)
			a := clientLeaseServe(t, pool, idem.Options{}, idem.Route{Required: true, Lease: 5 * time.Second},
				func(n int32, w http.ResponseWriter, r *http.Request) {
					if n == 1 {
						panic(tc.p)
					}
					pay(n, w, r)
				})
			a.srv.Config.ErrorLog = nil
			c := &idemclient.Client{}
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			began := time.Now()
			res, err := c.Do(ctx, clientPayReq(t, a.srv.URL, `{"amount":3}`), "")
			took := time.Since(began)
			if err != nil || res.Status != 201 || res.Replayed || res.Attempts != 2 || a.calls.Load() != 2 || took > 3*time.Second {
				t.Fatalf("got %d %s replayed %v attempts %d err %v took %v; runs %d",
					res.Status, res.Body, res.Replayed, res.Attempts, err, took, a.calls.Load())
			}
		})
	}
}

// TestLeaseClientHungHandlerTakenOver: the first run hangs (it ignores its context, as a stuck
// outside call does) past its LeaseTimeout. The docs: LeaseTimeout "bounds a lease route's
// handler", DefaultLeaseTimeout "bounds the work of a lease". A client that keeps retrying
// must converge: once the handler's bound passed, its lease should no longer be extended,
// and a retry should take the key over and run the work again (same provider key).
func TestLeaseClientHungHandlerTakenOver(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 8)
	prov := &clientProv{}
	pay := clientPay(prov, 0)
	release := make(chan struct{})
	defer close(release)
	a := clientLeaseServe(t, pool, idem.Options{DuplicateWait: time.Second},
		idem.Route{Required: true, Lease: time.Second, LeaseTimeout: 2 * time.Second},
		func(n int32, w http.ResponseWriter, r *http.Request) {
			if n == 1 {
				<-release // hung: ignores its context
				return
			}
			pay(n, w, r)
		})
	c := &idemclient.Client{AttemptTimeout: 1500 * time.Millisecond, MaxAttempts: -1}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	began := time.Now()
	res, err := c.Do(ctx, clientPayReq(t, a.srv.URL, `{"amount":4}`), "")
	took := time.Since(began)
	calls, keys := prov.counts()
	t.Logf("status %d %s replayed %v attempts %d took %v err %v; runs %d calls %d keys %d",
		res.Status, res.Code(), res.Replayed, res.Attempts, took, err, a.calls.Load(), calls, keys)
	if err != nil || res.Status != 201 || calls != 1 {
		t.Fatalf("a hung lease handler past its LeaseTimeout (2 s, lease 1 s) held the key: after %v and %d attempts the client got %d %s, err %v (runs %d)",
			took, res.Attempts, res.Status, res.Code(), err, a.calls.Load())
	}
}

// TestLeaseClientDuplicateOtherProcess: the client's first attempt (on process A) times out while
// the work runs; its retries go to process B (same database): B's duplicate waits for A's
// answer and replays it, soon after A stores it.
func TestLeaseClientDuplicateOtherProcess(t *testing.T) {
	t.Parallel()
	pool, url := pgtest.NewPool(t, 8)
	poolB := newPool(t, url)
	prov := &clientProv{}
	a := clientLeaseServe(t, pool, idem.Options{}, idem.Route{Required: true, Lease: time.Second}, clientPay(prov, 3*time.Second))
	b := clientLeaseServe(t, poolB, idem.Options{}, idem.Route{Required: true, Lease: time.Second}, clientPay(prov, 3*time.Second))
	front := clientFront(t, func(n int32) string {
		if n == 1 {
			return a.srv.URL
		}
		return b.srv.URL
	})
	c := &idemclient.Client{AttemptTimeout: 500 * time.Millisecond}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	began := time.Now()
	res, err := c.Do(ctx, clientPayReq(t, front.URL, `{"amount":5}`), "")
	took := time.Since(began)
	calls, _ := prov.counts()
	t.Logf("status %d replayed %v attempts %d took %v", res.Status, res.Replayed, res.Attempts, took)
	if err != nil || res.Status != 201 || !res.Replayed || calls != 1 || a.calls.Load() != 1 || b.calls.Load() != 0 {
		t.Fatalf("got %d %s replayed %v attempts %d err %v; runs A %d B %d, provider calls %d",
			res.Status, res.Body, res.Replayed, res.Attempts, err, a.calls.Load(), b.calls.Load(), calls)
	}
	if took > 3*time.Second+2*time.Second {
		t.Errorf("converged after %v, the work took 3 s", took)
	}
}

// TestLeaseClientInProgressRetryAfter: a short DuplicateWait, so that duplicates get 409
// request_in_progress: its Retry-After is sensible (at least 1, at most the lease's rest), and
// the default client converges without burning its attempts: a 6 s piece of work, waited for
// by a second client.
func TestLeaseClientInProgressRetryAfter(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 8)
	prov := &clientProv{}
	a := clientLeaseServe(t, pool, idem.Options{DuplicateWait: 300 * time.Millisecond},
		idem.Route{Required: true, Lease: 2 * time.Second}, clientPay(prov, 6*time.Second))
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	key := idemclient.NewKey()
	first := make(chan idemclient.Result, 1)
	go func() {
		r, _ := (&idemclient.Client{}).Do(ctx, clientPayReq(t, a.srv.URL, `{"amount":6}`), key)
		first <- r
	}()
	for a.calls.Load() == 0 {
		time.Sleep(5 * time.Millisecond)
	}
	// One raw duplicate: the 409's Retry-After.
	st, h, body := pgtest.Send(t, ctx, "POST", a.srv.URL+"/pay", `{"amount":6}`, "Content-Type", "application/json", "Idempotency-Key", key)
	t.Logf("raw duplicate: %d Retry-After %q %s", st, h.Get("Retry-After"), body)
	if st != 409 || h.Get("Retry-After") == "" {
		t.Errorf("raw duplicate: %d Retry-After %q", st, h.Get("Retry-After"))
	}
	began := time.Now()
	res, err := (&idemclient.Client{}).Do(ctx, clientPayReq(t, a.srv.URL, `{"amount":6}`), key)
	took := time.Since(began)
	r1 := <-first
	calls, _ := prov.counts()
	t.Logf("duplicate client: %d replayed %v attempts %d took %v; first %d", res.Status, res.Replayed, res.Attempts, took, r1.Status)
	if err != nil || res.Status != 201 || !res.Replayed || r1.Status != 201 || calls != 1 {
		t.Fatalf("duplicate client: %d %s attempts %d err %v; first %d; calls %d", res.Status, res.Code(), res.Attempts, err, r1.Status, calls)
	}
	if res.Attempts >= idemclient.DefaultMaxAttempts {
		t.Errorf("the duplicate client took %d of its %d attempts to wait out 6 s of work", res.Attempts, idemclient.DefaultMaxAttempts)
	}
}

// TestLeaseClientShutdownThenOtherProcess: process A shuts down (a short deadline) while the lease
// work runs; the handler stops on ErrShutdown without writing; the client retries against B,
// which runs the work again under the same provider key: one payout, a 201.
func TestLeaseClientShutdownThenOtherProcess(t *testing.T) {
	t.Parallel()
	pool, url := pgtest.NewPool(t, 8)
	poolB := newPool(t, url)
	prov := &clientProv{}
	var pks sync.Map
	behave := func(d time.Duration) func(n int32, w http.ResponseWriter, r *http.Request) {
		return func(n int32, w http.ResponseWriter, r *http.Request) {
			claim, _ := idem.ClaimOf(r.Context())
			pks.Store(claim.ProviderKey, true)
			select {
			case <-time.After(d):
			case <-r.Context().Done():
				return // stops, writing nothing
			}
			payout := prov.pay(claim.ProviderKey)
			w.WriteHeader(http.StatusCreated)
			fmt.Fprintf(w, `{"id":"po_%d"}`, payout)
		}
	}
	a := clientLeaseServe(t, pool, idem.Options{}, idem.Route{Required: true, Lease: 5 * time.Second}, behave(20*time.Second))
	b := clientLeaseServe(t, poolB, idem.Options{}, idem.Route{Required: true, Lease: 5 * time.Second}, behave(200*time.Millisecond))
	var down atomic.Bool
	front := clientFront(t, func(int32) string {
		if down.Load() {
			return b.srv.URL
		}
		return a.srv.URL
	})
	go func() {
		for a.calls.Load() == 0 {
			time.Sleep(5 * time.Millisecond)
		}
		time.Sleep(300 * time.Millisecond)
		down.Store(true)
		sctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
		defer cancel()
		_ = a.m.Shutdown(sctx)
	}()
	c := &idemclient.Client{}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	began := time.Now()
	res, err := c.Do(ctx, clientPayReq(t, front.URL, `{"amount":7}`), "")
	took := time.Since(began)
	n := 0
	pks.Range(func(any, any) bool { n++; return true })
	calls, keys := prov.counts()
	t.Logf("status %d %s replayed %v attempts %d took %v; runs A %d B %d; pks %d calls %d keys %d",
		res.Status, res.Body, res.Replayed, res.Attempts, took, a.calls.Load(), b.calls.Load(), n, calls, keys)
	if err != nil || res.Status != 201 || res.Attempts != 2 || b.calls.Load() != 1 || n != 1 || keys != 1 || took > 4*time.Second {
		t.Fatalf("got %d %s attempts %d err %v took %v; runs A %d B %d; provider keys %d",
			res.Status, res.Body, res.Attempts, err, took, a.calls.Load(), b.calls.Load(), n)
	}
}

// TestLeaseClientOneTimeSecretImpatient: a lease route whose answer is a one-time secret, and a
// client whose attempt times out before the work ends. The secret is written once, to the
// first attempt's connection, which its client had given up; every retry gets 409
// one_time_secret with the resource id, and the work ran once (docs/http.md says so: give
// such a route's clients an attempt timeout longer than the work).
func TestLeaseClientOneTimeSecretImpatient(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 8)
	a := clientLeaseServe(t, pool, idem.Options{}, idem.Route{Required: true, Lease: time.Second},
		func(n int32, w http.ResponseWriter, r *http.Request) {
			time.Sleep(1500 * time.Millisecond)
			idem.MarkOneTimeSecret(r.Context())
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusCreated)
			fmt.Fprintf(w, `{"id":"tok_%d","secret":"s3cr3t"}`, n)
		})
	c := &idemclient.Client{AttemptTimeout: 500 * time.Millisecond}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	res, err := c.Do(ctx, clientPayReq(t, a.srv.URL, `{"amount":8}`), "")
	t.Logf("status %d %s replayed %v attempts %d err %v runs %d", res.Status, res.Body, res.Replayed, res.Attempts, err, a.calls.Load())
	if err != nil || a.calls.Load() != 1 {
		t.Fatalf("err %v runs %d", err, a.calls.Load())
	}
	var p idem.Problem
	_ = res.JSON(&p)
	if res.Status != 409 || res.Code() != idem.CodeOneTimeSecret || !res.Replayed || p.ResourceID != "tok_1" {
		t.Fatalf("got %d %s replayed %v; want 409 one_time_secret with resource_id tok_1", res.Status, res.Body, res.Replayed)
	}
}

// TestLeaseClientSlowWorkGivesUpThenAnswers: work longer than the client's attempts and backoff:
// the client gives up with ErrGaveUp (outcome unknown, Result.Key set), the work completes
// later, once, and a later Do under res.Key gets its answer, replayed.
func TestLeaseClientSlowWorkGivesUpThenAnswers(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 8)
	prov := &clientProv{}
	a := clientLeaseServe(t, pool, idem.Options{DuplicateWait: 200 * time.Millisecond},
		idem.Route{Required: true, Lease: time.Second}, clientPay(prov, 8*time.Second))
	c := &idemclient.Client{AttemptTimeout: 300 * time.Millisecond, MaxAttempts: 4}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	res, err := c.Do(ctx, clientPayReq(t, a.srv.URL, `{"amount":9}`), "")
	t.Logf("gave up: %d %s attempts %d key %q err %v", res.Status, res.Code(), res.Attempts, res.Key, err)
	if !errors.Is(err, idemclient.ErrGaveUp) || res.Key == "" || res.Attempts != 4 {
		t.Fatalf("want ErrGaveUp with the key: %d attempts %d key %q err %v", res.Status, res.Attempts, res.Key, err)
	}
	for a.m.GateStats().Waiting > 0 {
		time.Sleep(10 * time.Millisecond)
	}
	time.Sleep(9 * time.Second)
	again, err := c.Do(ctx, clientPayReq(t, a.srv.URL, `{"amount":9}`), res.Key)
	calls, _ := prov.counts()
	if err != nil || again.Status != 201 || !again.Replayed || again.Attempts != 1 || calls != 1 || a.calls.Load() != 1 {
		t.Fatalf("later: %d %s replayed %v attempts %d err %v; runs %d calls %d",
			again.Status, again.Body, again.Replayed, again.Attempts, err, a.calls.Load(), calls)
	}
}

// TestLeaseClientSlowWorkDefaultClient: the default client (no AttemptTimeout) against work longer
// than DuplicateWait: the first attempt waits for the work itself; converges, no ErrGaveUp.
func TestLeaseClientSlowWorkDefaultClient(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 8)
	prov := &clientProv{}
	a := clientLeaseServe(t, pool, idem.Options{DuplicateWait: 500 * time.Millisecond},
		idem.Route{Required: true, Lease: time.Second}, clientPay(prov, 12*time.Second))
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	res, err := (&idemclient.Client{}).Do(ctx, clientPayReq(t, a.srv.URL, `{"amount":10}`), "")
	calls, _ := prov.counts()
	if err != nil || res.Status != 201 || res.Replayed || res.Attempts != 1 || calls != 1 {
		t.Fatalf("%d %s replayed %v attempts %d err %v calls %d", res.Status, res.Body, res.Replayed, res.Attempts, err, calls)
	}
}

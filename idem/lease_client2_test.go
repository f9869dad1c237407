package idem_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/idemclient"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// clientFront forwards each request to pick(n) (n: the request's number, 1-based).
func clientFront(t *testing.T, pick func(n int32) string) *httptest.Server {
	var n atomic.Int32
	front := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		target := pick(n.Add(1))
		body, _ := io.ReadAll(r.Body)
		req, _ := http.NewRequestWithContext(r.Context(), r.Method, target+r.URL.Path, strings.NewReader(string(body)))
		req.Header = r.Header.Clone()
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return
		}
		defer resp.Body.Close()
		for k, v := range resp.Header {
			w.Header()[k] = v
		}
		w.WriteHeader(resp.StatusCode)
		io.Copy(w, resp.Body)
	}))
	t.Cleanup(front.Close)
	return front
}

// TestLeaseClientImpatientFailThenSucceed: an impatient client (attempt 300 ms) and a first run
// that fails with 502 after 1.5 s: the client's waiting retry takes over as soon as the lease
// is given up, and gets the second run's 201.
func TestLeaseClientImpatientFailThenSucceed(t *testing.T) {
	t.Parallel()
	for _, cross := range []bool{false, true} {
		t.Run(fmt.Sprintf("cross=%v", cross), func(t *testing.T) {
			pool, url := pgtest.NewPool(t, 8)
			prov := &clientProv{}
			pay := clientPay(prov, 200*time.Millisecond)
			var runs atomic.Int32
			behave := func(n int32, w http.ResponseWriter, r *http.Request) {
				if runs.Add(1) == 1 {
					time.Sleep(1500 * time.Millisecond)
					http.Error(w, "provider down", http.StatusBadGateway)
					return
				}
				pay(n, w, r)
			}
			a := clientLeaseServe(t, pool, idem.Options{}, idem.Route{Required: true, Lease: 2 * time.Second}, behave)
			target := a.srv.URL
			if cross {
				b := clientLeaseServe(t, newPool(t, url), idem.Options{}, idem.Route{Required: true, Lease: 2 * time.Second}, behave)
				target = clientFront(t, func(n int32) string {
					if n == 1 {
						return a.srv.URL
					}
					return b.srv.URL
				}).URL
			}
			c := &idemclient.Client{AttemptTimeout: 300 * time.Millisecond}
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			began := time.Now()
			res, err := c.Do(ctx, clientPayReq(t, target, `{"amount":11}`), "")
			took := time.Since(began)
			calls, keys := prov.counts()
			t.Logf("status %d %s replayed %v attempts %d took %v; runs %d calls %d keys %d", res.Status, res.Body, res.Replayed, res.Attempts, took, runs.Load(), calls, keys)
			if err != nil || res.Status != 201 || runs.Load() != 2 || calls != 1 || took > 4*time.Second {
				t.Fatalf("got %d %s attempts %d err %v took %v runs %d", res.Status, res.Code(), res.Attempts, err, took, runs.Load())
			}
		})
	}
}

// TestLeaseClientCrashedHolder: another process claimed the key (the same request) and died
// without an answer: the default client converges once the lease runs out (2 s), with one run.
func TestLeaseClientCrashedHolder(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 8)
	prov := &clientProv{}
	a := clientLeaseServe(t, pool, idem.Options{}, idem.Route{Required: true, Lease: 2 * time.Second}, clientPay(prov, 100*time.Millisecond))
	body := `{"amount":12}`
	key := idemclient.NewKey()
	fp := idem.ComputeFingerprint("POST", "/pay", []byte(body))
	d, err := idem.Begin(context.Background(), pool, idem.Claim{Principal: "alice", Key: key, Action: "POST /pay",
		Fingerprint: fp.Sum, Fields: fp.Fields, Lease: 2 * time.Second})
	if err != nil || d.Outcome != idem.Claimed {
		t.Fatalf("the crashed holder's claim: %+v %v", d, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	began := time.Now()
	res, err := (&idemclient.Client{}).Do(ctx, clientPayReq(t, a.srv.URL, body), key)
	took := time.Since(began)
	t.Logf("status %d replayed %v attempts %d took %v", res.Status, res.Replayed, res.Attempts, took)
	if err != nil || res.Status != 201 || res.Replayed || res.Attempts != 1 || a.calls.Load() != 1 || took > 3500*time.Millisecond {
		t.Fatalf("got %d %s attempts %d err %v took %v runs %d", res.Status, res.Code(), res.Attempts, err, took, a.calls.Load())
	}
}

// TestLeaseClientRetryAfterWithAFigure: once this process knows the action's work takes ~4 s, a
// duplicate's 409 Retry-After estimates the rest (at least 1, at most the lease's rest), and a
// client with a short DuplicateWait converges without burning its attempts.
func TestLeaseClientRetryAfterWithAFigure(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 8)
	prov := &clientProv{}
	a := clientLeaseServe(t, pool, idem.Options{DuplicateWait: 200 * time.Millisecond},
		idem.Route{Required: true, Lease: 10 * time.Second}, clientPay(prov, 4*time.Second))
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if res, err := (&idemclient.Client{}).Do(ctx, clientPayReq(t, a.srv.URL, `{"amount":13}`), ""); err != nil || res.Status != 201 {
		t.Fatalf("warm-up: %d %v", res.Status, err)
	}
	key := idemclient.NewKey()
	first := clientPayReq(t, a.srv.URL, `{"amount":14}`)
	firstDone := make(chan struct{})
	defer func() { <-firstDone }()
	go func() { defer close(firstDone); _, _ = (&idemclient.Client{}).Do(ctx, first, key) }()
	for a.calls.Load() < 2 {
		time.Sleep(5 * time.Millisecond)
	}
	time.Sleep(500 * time.Millisecond)
	st, h, _ := pgtest.Send(t, ctx, "POST", a.srv.URL+"/pay", `{"amount":14}`, "Content-Type", "application/json", "Idempotency-Key", key)
	ra, _ := strconv.Atoi(h.Get("Retry-After"))
	t.Logf("409 at 0.7 s of 4 s work: %d Retry-After %d", st, ra)
	if st != 409 || ra < 2 || ra > 4 {
		t.Errorf("Retry-After %d at 0.7 s into work that takes 4 s, want about 3", ra)
	}
	res, err := (&idemclient.Client{}).Do(ctx, clientPayReq(t, a.srv.URL, `{"amount":14}`), key)
	t.Logf("client: %d replayed %v attempts %d", res.Status, res.Replayed, res.Attempts)
	if err != nil || res.Status != 201 || !res.Replayed || res.Attempts > 4 {
		t.Fatalf("client: %d %s attempts %d err %v", res.Status, res.Code(), res.Attempts, err)
	}
}

// TestLeaseClientRowLockedPastLease: the key's row is locked (an operator's long transaction)
// past the lease, so the extensions cannot land and the work loses its lease by this
// process's clock. The client keeps retrying and must converge once the lock goes, with one
// provider payout.
func TestLeaseClientRowLockedPastLease(t *testing.T) {
	t.Parallel()
	pool, url := pgtest.NewPool(t, 8)
	prov := &clientProv{}
	a := clientLeaseServe(t, pool, idem.Options{}, idem.Route{Required: true, Lease: time.Second}, clientPay(prov, 2*time.Second))
	key := idemclient.NewKey()
	conn := pgtest.Connect(t, url)
	locked := make(chan struct{})
	defer func() { <-locked }() // the lock's goroutine ends before the connection is closed
	go func() {
		defer close(locked)
		for a.calls.Load() == 0 {
			time.Sleep(5 * time.Millisecond)
		}
		tx, err := conn.Begin(context.Background())
		if err != nil {
			return
		}
		_, _ = tx.Exec(context.Background(), `SELECT 1 FROM idem.idempotency_keys WHERE key = $1 FOR UPDATE`, key)
		time.Sleep(3 * time.Second)
		_ = tx.Rollback(context.Background())
	}()
	c := &idemclient.Client{AttemptTimeout: time.Second, MaxAttempts: -1}
	ctx, cancel := context.WithTimeout(context.Background(), 40*time.Second)
	defer cancel()
	began := time.Now()
	res, err := c.Do(ctx, clientPayReq(t, a.srv.URL, `{"amount":15}`), key)
	took := time.Since(began)
	calls, keys := prov.counts()
	t.Logf("status %d %s replayed %v attempts %d took %v; runs %d calls %d keys %d", res.Status, res.Body, res.Replayed, res.Attempts, took, a.calls.Load(), calls, keys)
	if err != nil || res.Status != 201 || keys != 1 || took > 10*time.Second {
		t.Fatalf("got %d %s attempts %d err %v took %v", res.Status, res.Code(), res.Attempts, err, took)
	}
}

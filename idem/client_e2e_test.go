package idem_test

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/idemclient"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestClientAgainstTheMiddleware: idemclient against the real middleware: a lost answer is
// replayed, a duplicate that outlasts DuplicateWait gets 409 request_in_progress and converges,
// a key reused for another body gets 422 once, and many goroutines of one Client under one key
// make one effect.
func TestClientAgainstTheMiddleware(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 8)
	pgtest.Exec(t, pool, `CREATE TABLE deposits (id serial PRIMARY KEY, account text, amount int)`)
	m, err := idem.New(context.Background(), idem.Options{DB: pool, DuplicateWait: 300 * time.Millisecond,
		Principal: alice, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	hold := make(chan struct{})
	mux := http.NewServeMux()
	mux.Handle("POST /accounts/{id}/deposits", m.Route(idem.Route{Required: true})(deposits(hold)))
	var lose atomic.Bool
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if lose.CompareAndSwap(true, false) { // the work commits, its answer is lost on the way
			rec := httptest.NewRecorder()
			mux.ServeHTTP(rec, r)
			conn, _, _ := w.(http.Hijacker).Hijack()
			conn.Close()
			return
		}
		mux.ServeHTTP(w, r)
	}))
	defer srv.Close()
	c := &idemclient.Client{Backoff: 10 * time.Millisecond}
	newReq := func(body string) *http.Request {
		req, _ := http.NewRequest("POST", srv.URL+"/accounts/7/deposits", strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		return req
	}
	effects := func(account string) int {
		return pgtest.Count(t, pool, `SELECT count(*) FROM deposits WHERE amount = $1`, account)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()

	// A lost answer.
	lose.Store(true)
	res, err := c.Do(ctx, newReq(`{"amount":1}`), "")
	if err != nil || res.Status != 201 || !res.Replayed || res.Attempts != 2 || effects("1") != 1 {
		t.Errorf("lost answer: %d replayed %v attempts %d err %v, %d effects", res.Status, res.Replayed, res.Attempts, err, effects("1"))
	}

	// A duplicate while the first runs past DuplicateWait.
	key := idemclient.NewKey()
	first := make(chan idemclient.Result, 1)
	go func() {
		r, _ := c.Do(ctx, newReq(`{"amount":2,"hold":true}`), key)
		first <- r
	}()
	// The duplicate is sent once the first holds the key (its claim's transaction open while its
	// handler waits on hold), not after a fixed pause: on a loaded machine the first could come
	// second, and the duplicate then ran the work itself, not replayed.
	pgtest.WaitFor(t, pool, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
		AND state = 'idle in transaction' AND pid <> pg_backend_pid()`)
	time.AfterFunc(1500*time.Millisecond, func() { close(hold) })
	res, err = c.Do(ctx, newReq(`{"amount":2,"hold":true}`), key)
	r1 := <-first
	if err != nil || res.Status != 201 || !res.Replayed || res.Attempts < 2 || r1.Status != 201 || effects("2") != 1 {
		t.Errorf("duplicate: %d replayed %v attempts %d err %v (first %d), %d effects", res.Status, res.Replayed, res.Attempts, err, r1.Status, effects("2"))
	}

	// The same key for another body: 422, once.
	res, err = c.Do(ctx, newReq(`{"amount":3,"hold":true}`), key)
	if err != nil || res.Status != 422 || res.Code() != "idempotency_key_reuse" || res.Attempts != 1 || effects("3") != 0 {
		t.Errorf("reuse: %d %s attempts %d err %v", res.Status, res.Code(), res.Attempts, err)
	}

	// Many goroutines, one Client, one key.
	key = idemclient.NewKey()
	var wg sync.WaitGroup
	var replays atomic.Int32
	for range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r, err := c.Do(ctx, newReq(`{"amount":4}`), key)
			if err != nil || r.Status != 201 {
				t.Errorf("concurrent: %d %s %v", r.Status, r.Code(), err)
			}
			if r.Replayed {
				replays.Add(1)
			}
		}()
	}
	wg.Wait()
	if effects("4") != 1 || replays.Load() != 15 {
		t.Errorf("concurrent: %d effects, %d replays; want 1 and 15", effects("4"), replays.Load())
	}
}

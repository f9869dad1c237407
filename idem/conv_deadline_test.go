package idem_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/idemclient"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// deadlineServer serves POST /things (work that takes `work`, one row per run) through the
// middleware, behind an outer middleware that gives each request's context a deadline: the
// context ends while the client is still connected and waiting for its answer.
func deadlineServer(t *testing.T, rt idem.Route, deadline, work time.Duration) (*httptest.Server, *atomic.Int32, func() int) {
	t.Helper()
	pool, _ := pgtest.NewPool(t, 8)
	pgtest.Exec(t, pool, `CREATE TABLE conv_effects (id serial PRIMARY KEY, note text)`)
	m, err := idem.New(context.Background(), idem.Options{DB: pool, Principal: alice, Logger: auditQuiet})
	if err != nil {
		t.Fatal(err)
	}
	var runs atomic.Int32
	mux := http.NewServeMux()
	mux.Handle("POST /things", m.Route(rt)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		time.Sleep(work)
		if tx := idem.TxFrom(r.Context()); tx != nil {
			if _, err := tx.Exec(r.Context(), `INSERT INTO conv_effects (note) VALUES ('x')`); err != nil {
				http.Error(w, err.Error(), 500)
				return
			}
		} else if _, err := pool.Exec(r.Context(), `INSERT INTO conv_effects (note) VALUES ('x')`); err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		w.Write([]byte(`{"id":1,"status":"done"}`))
	})))
	// An outer middleware gives every request a deadline (a service's request budget, or a
	// deadline propagated from a gateway), as Go services commonly do with context.WithTimeout.
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), deadline)
		defer cancel()
		mux.ServeHTTP(w, r.WithContext(ctx))
	}))
	t.Cleanup(srv.Close)
	return srv, &runs, func() int { return pgtest.Count(t, pool, `SELECT count(*) FROM conv_effects`) }
}

// convDuplicate sends a first request under key (its client just waits), then, while it runs,
// the same request through idemclient, and returns what idemclient reports.
func convDuplicate(t *testing.T, srv *httptest.Server, runs *atomic.Int32, c *idemclient.Client) (first int, res idemclient.Result, err error) {
	t.Helper()
	key := idemclient.NewKey()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	firstc := make(chan int, 1)
	go func() {
		st, _, _ := pgtest.Send(t, ctx, "POST", srv.URL+"/things", `{"n":1}`, "Idempotency-Key", key, "Content-Type", "application/json")
		firstc <- st
	}()
	// The first request's handler runs before the duplicate is sent.
	for deadline := time.Now().Add(10 * time.Second); runs.Load() == 0; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the first request's handler did not start")
		}
	}
	req, _ := http.NewRequest("POST", srv.URL+"/things", strings.NewReader(`{"n":1}`))
	req.Header.Set("Content-Type", "application/json")
	res, err = c.Do(ctx, req, key)
	return <-firstc, res, err
}

// TestDuplicatePastItsRequestDeadlineIsToldToRetry: a duplicate that waits for the first
// request's answer ("waits for the first's answer ... up to Options.DuplicateWait (default
// 10 s) ... then answers as the first did", docs/http.md "What happens") behind a middleware
// that gives each request a deadline (1 s here) shorter than the wait. When the request's
// context ended, keyedOnce (internal/http/unit.go) took it for "the client went away ...
// nobody to answer" and returned without writing anything, and net/http sent an empty 200 OK
// to the client, which was still connected. idemclient took that as the final answer: 200, no
// body, not replayed, where the first answer (which commits a second later) is 201 with a
// body. The duplicate is told 409 request_in_progress now, as a lease route's is, and the
// client's retry gets the first answer (D183). The effect happens once.
func TestDuplicatePastItsRequestDeadlineIsToldToRetry(t *testing.T) {
	t.Parallel()
	srv, runs, effects := deadlineServer(t, idem.Route{Required: true}, time.Second, 2500*time.Millisecond)
	c := &idemclient.Client{Backoff: 10 * time.Millisecond}
	first, res, err := convDuplicate(t, srv, runs, c)
	t.Logf("first %d; duplicate through idemclient: %d %q replayed %v attempts %d err %v; runs %d effects %d",
		first, res.Status, res.Body, res.Replayed, res.Attempts, err, runs.Load(), effects())
	if first != 201 {
		t.Fatalf("setup: the first request got %d", first)
	}
	if n := effects(); n != 1 {
		t.Errorf("%d effects, want 1", n)
	}
	if err != nil || res.Status != 201 || !res.Replayed || string(res.Body) != `{"id":1,"status":"done"}` {
		t.Fatalf("the duplicate's operation ended with %d %q (replayed %v, err %v): want the first answer, 201 with its body, replayed",
			res.Status, res.Body, res.Replayed, err)
	}
}

package idem_test

// Callbacks the application hands to the library, doing what a buggy application does:
// panicking (with a value, with nil), returning odd values, calling back into the library.
// Whatever they do: no key left held past its lease or lock timeout, a well-formed answer,
// connections back to the pool, Shutdown completes, metrics counted once.

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// cbSend posts on a fresh connection and returns the status (-1 on a transport error, with
// the error as body), the header and the body.
func cbSend(t *testing.T, url, key, body string) (int, http.Header, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, "POST", url+"/things", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	c := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	res, err := c.Do(req)
	if err != nil {
		return -1, nil, err.Error()
	}
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	if err != nil {
		return -1, res.Header, err.Error()
	}
	return res.StatusCode, res.Header, string(b)
}

func cbCode(body string) string {
	var p idem.Problem
	_ = json.Unmarshal([]byte(body), &p)
	return p.Code
}

// cbObs counts Done calls by state and every Count.
type cbObs struct {
	mu    sync.Mutex
	done  map[idem.State]int
	count map[idem.State]int
	ended int
}

func newCBObs() *cbObs { return &cbObs{done: map[idem.State]int{}, count: map[idem.State]int{}} }
func (o *cbObs) Count(_ string, s idem.State) {
	o.mu.Lock()
	o.count[s]++
	o.mu.Unlock()
}
func (o *cbObs) Done(s idem.State, _ time.Duration) {
	o.mu.Lock()
	o.done[s]++
	o.mu.Unlock()
}
func (o *cbObs) LeaseExtended(string) {}
func (o *cbObs) LeaseEnded(string, bool, time.Duration) {
	o.mu.Lock()
	o.ended++
	o.mu.Unlock()
}
func (o *cbObs) totalDone() int {
	o.mu.Lock()
	defer o.mu.Unlock()
	n := 0
	for _, v := range o.done {
		n += v
	}
	return n
}

// TestCallbacksPrincipalPanics: Options.Principal (the application's authentication lookup)
// panics on a keyed request, with a value and with nil. docs/http.md: "the principal function
// or a route's fingerprint function panics | 500 internal_error", as for a handler's panic;
// nothing is claimed, Shutdown completes. The connection was dropped instead (D222).
func TestCallbacksPrincipalPanics(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		value any
		lease time.Duration
	}{
		{"string", "auth lookup bug", 0},
		{"nil", nil, 0},
		{"string-lease", "auth lookup bug", 5 * time.Second},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pool, _ := pgtest.NewPool(t, 4)
			var armed atomic.Bool
			armed.Store(true)
			principal := func(r *http.Request) (string, bool) {
				if armed.Load() {
					panic(tc.value)
				}
				return "alice", true
			}
			var runs atomic.Int32
			srv, m := prServe(t, idem.Options{DB: pool, Principal: principal}, idem.Route{Lease: tc.lease},
				func(w http.ResponseWriter, r *http.Request) {
					runs.Add(1)
					w.WriteHeader(201)
				})
			st, _, body := cbSend(t, srv.URL, "pp-"+tc.name, `{"a":1}`)
			if st != 500 || cbCode(body) != idem.CodeInternalError {
				t.Errorf("Principal panicked: got %d %q; want a well-formed 500 internal_error", st, body)
			}
			armed.Store(false)
			if st, _, body := cbSend(t, srv.URL, "pp-"+tc.name, `{"a":1}`); st != 201 || runs.Load() != 1 {
				t.Errorf("after the panic: %d %q, runs %d", st, body, runs.Load())
			}
			prSettled(t, pool, m)
		})
	}
}

// TestCallbacksFingerprintPanics: a Route.Fingerprint function that panics. As above: a 500
// internal_error, where the connection was dropped (D222); nothing is held.
func TestCallbacksFingerprintPanics(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 4)
	var armed atomic.Bool
	armed.Store(true)
	rt := idem.Route{Fingerprint: func(r *http.Request, body []byte) idem.Fingerprint {
		if armed.Load() {
			panic("fingerprint bug")
		}
		return idem.ComputeFingerprint(r.Method, r.URL.Path, body)
	}}
	srv, m := prServe(t, idem.Options{DB: pool}, rt, func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(201) })
	st, _, body := cbSend(t, srv.URL, "fp-1", `{"a":1}`)
	if st != 500 || cbCode(body) != idem.CodeInternalError {
		t.Errorf("Fingerprint panicked: got %d %q; want a well-formed 500 internal_error", st, body)
	}
	armed.Store(false)
	if st, _, body := cbSend(t, srv.URL, "fp-1", `{"a":1}`); st != 201 {
		t.Errorf("after the panic: %d %q", st, body)
	}
	prSettled(t, pool, m)
}

// TestCallbacksPrincipalOddValues: Options.Principal: "Keys belong to a principal: 1 to 255
// characters (longer is a 500 idempotency_misconfigured)"; docs/http.md: "the store refuses the
// configuration (a principal over 255 characters, or one that is not UTF-8 or holds U+0000) |
// 500 idempotency_misconfigured, final: no Retry-After". The handler does not run, the request
// is timed once. 255 characters of several bytes each are a valid principal.
func TestCallbacksPrincipalOddValues(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 4)
	var current atomic.Value
	current.Store("alice")
	obs := newCBObs()
	var runs atomic.Int32
	srv, m := prServe(t, idem.Options{DB: pool, Metrics: obs, Principal: func(*http.Request) (string, bool) {
		return current.Load().(string), true
	}}, idem.Route{}, func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		w.WriteHeader(201)
		_, _ = io.WriteString(w, `{"id":1}`)
	})
	bad := map[string]string{
		"empty":      "",
		"256-ascii":  strings.Repeat("a", 256),
		"300-runes":  strings.Repeat("é", 300),
		"nul":        "ali\x00ce",
		"not-utf8":   "ali\xffce",
		"lone-surr":  "ali\xed\xa0\x80ce",
		"only-nul":   "\x00",
		"256-astral": strings.Repeat("𝄞", 256),
	}
	for name, p := range bad {
		current.Store(p)
		before := obs.totalDone()
		st, h, body := cbSend(t, srv.URL, "odd-"+name, `{"a":1}`)
		if st != 500 || cbCode(body) != idem.CodeMisconfigured || h.Get("Retry-After") != "" {
			t.Errorf("principal %s: got %d %q Retry-After %q; want 500 idempotency_misconfigured without Retry-After",
				name, st, body, h.Get("Retry-After"))
		}
		if d := obs.totalDone() - before; d != 1 {
			t.Errorf("principal %s: Done called %d times, want 1", name, d)
		}
	}
	if runs.Load() != 0 {
		t.Errorf("the handler ran %d times for refused principals", runs.Load())
	}
	for name, p := range map[string]string{
		"255-ascii":  strings.Repeat("a", 255),
		"255-runes":  strings.Repeat("é", 255),
		"255-astral": strings.Repeat("𝄞", 255),
		"one":        "x",
	} {
		current.Store(p)
		st, _, body := cbSend(t, srv.URL, "ok-"+name, `{"a":1}`)
		st2, h2, body2 := cbSend(t, srv.URL, "ok-"+name, `{"a":1}`)
		if st != 201 || st2 != 201 || h2.Get("Idempotent-Replayed") != "true" || body2 != body {
			t.Errorf("principal %s: first %d %q, repeat %d %q replayed %q", name, st, body, st2, body2, h2.Get("Idempotent-Replayed"))
		}
	}
	prSettled(t, pool, m)
}

// TestCallbacksRouteTemplateOddValues: Options.RouteTemplate returning a very long string,
// bytes that are not UTF-8 and U+0000 (the default action is "cut to MaxActionLength", its
// text made storable); "" falls back to the default. The request is claimed, replayed and a
// different body under the key is 422.
func TestCallbacksRouteTemplateOddValues(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 4)
	var current atomic.Value
	srv, m := prServe(t, idem.Options{DB: pool, RouteTemplate: func(*http.Request) string { return current.Load().(string) }},
		idem.Route{}, func(w http.ResponseWriter, r *http.Request) {
			w.WriteHeader(201)
			_, _ = io.WriteString(w, `{"id":7}`)
		})
	for name, tpl := range map[string]string{
		"long":     "/" + strings.Repeat("x", 5000),
		"long-mb":  "/" + strings.Repeat("é", 3000),
		"bytes":    "/v1/\xff\xfe/\x00/things",
		"empty":    "",
		"cut-mid":  "/" + strings.Repeat("a", 993) + "é\xff",
		"controls": "/\r\n\t",
	} {
		current.Store(tpl)
		key := "rt-" + name
		st, _, body := cbSend(t, srv.URL, key, `{"a":1}`)
		st2, h2, _ := cbSend(t, srv.URL, key, `{"a":1}`)
		st3, _, body3 := cbSend(t, srv.URL, key, `{"a":2}`)
		if st != 201 || st2 != 201 || h2.Get("Idempotent-Replayed") != "true" || st3 != 422 {
			t.Errorf("template %s: first %d %q, repeat %d (replayed %q), other body %d %q", name, st, body, st2,
				h2.Get("Idempotent-Replayed"), st3, body3)
		}
	}
	prSettled(t, pool, m)
}

// TestCallbacksFinalStatusPanics: Options.FinalStatus panics (with a value, with nil) when
// asked about the handler's 422. On a transactional route the work rolls back and the client
// gets 500; on a lease route the lease is given up at once ("the handler answers anything else
// (..., a panic) | gives the lease up at once"), so the retry runs the work again at once
// instead of waiting the lease out with 409.
func TestCallbacksFinalStatusPanics(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		value any
		lease time.Duration
	}{
		{"tx-string", "final bug", 0},
		{"tx-nil", nil, 0},
		{"lease-string", "final bug", 20 * time.Second},
		{"lease-nil", nil, 20 * time.Second},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			pool, _ := pgtest.NewPool(t, 6)
			pgtest.Exec(t, pool, `CREATE TABLE cb_effects (id serial PRIMARY KEY)`)
			var armed atomic.Bool
			armed.Store(true)
			obs := newCBObs()
			var runs atomic.Int32
			final := func(status int) bool {
				if armed.Load() {
					panic(tc.value)
				}
				return idem.DefaultFinalStatus(status)
			}
			srv, m := prServe(t, idem.Options{DB: pool, FinalStatus: final, Metrics: obs}, idem.Route{Lease: tc.lease},
				func(w http.ResponseWriter, r *http.Request) {
					runs.Add(1)
					if tx := idem.TxFrom(r.Context()); tx != nil {
						if _, err := tx.Exec(r.Context(), `INSERT INTO cb_effects DEFAULT VALUES`); err != nil {
							http.Error(w, err.Error(), 500)
							return
						}
					}
					w.WriteHeader(422)
					_, _ = io.WriteString(w, `{"code":"nope"}`)
				})
			st, _, body := cbSend(t, srv.URL, "fs", `{"a":1}`)
			if st != 500 || cbCode(body) != idem.CodeInternalError {
				t.Errorf("FinalStatus panicked: got %d %q; want 500 internal_error", st, body)
			}
			if n := pgtest.Count(t, pool, `SELECT count(*) FROM cb_effects`); n != 0 {
				t.Errorf("the work's effect committed: %d rows", n)
			}
			armed.Store(false)
			began := time.Now()
			st, _, body = cbSend(t, srv.URL, "fs", `{"a":1}`)
			if st != 422 || runs.Load() != 2 || time.Since(began) > 3*time.Second {
				t.Errorf("retry: %d %q after %v, runs %d; want the handler's 422 at once", st, body, time.Since(began), runs.Load())
			}
			if d := obs.totalDone(); d != 2 {
				t.Errorf("Done called %d times for 2 requests (%v)", d, obs.done)
			}
			prSettled(t, pool, m)
		})
	}
}

// TestCallbacksFinalStatusOddValues: FinalStatus true for everything. A 2xx is still a
// success (committed, its effect kept); a 500 declared final is rolled back, stored and
// replayed with Idempotent-Replayed ("FinalStatus tells which error statuses are final: rolled
// back, then stored and replayed").
func TestCallbacksFinalStatusOddValues(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 4)
	pgtest.Exec(t, pool, `CREATE TABLE cb_odd (k text)`)
	var status atomic.Int32
	var runs atomic.Int32
	srv, m := prServe(t, idem.Options{DB: pool, FinalStatus: func(int) bool { return true }}, idem.Route{},
		func(w http.ResponseWriter, r *http.Request) {
			runs.Add(1)
			if _, err := idem.TxFrom(r.Context()).Exec(r.Context(), `INSERT INTO cb_odd VALUES ($1)`, r.Header.Get("Idempotency-Key")); err != nil {
				http.Error(w, err.Error(), 500)
				return
			}
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(int(status.Load()))
			_, _ = io.WriteString(w, `{"id":"x"}`)
		})
	for _, s := range []int{201, 500, 302, 401, 503} {
		status.Store(int32(s))
		key := "odd-" + strconv.Itoa(s)
		before := runs.Load()
		st, _, _ := cbSend(t, srv.URL, key, `{"a":1}`)
		st2, h2, _ := cbSend(t, srv.URL, key, `{"a":1}`)
		n := pgtest.Count(t, pool, `SELECT count(*) FROM cb_odd WHERE k = $1`, key)
		wantRows := 0
		if s < 300 {
			wantRows = 1
		}
		if st != s || st2 != s || h2.Get("Idempotent-Replayed") != "true" || runs.Load()-before != 1 || n != wantRows {
			t.Errorf("status %d: first %d, repeat %d replayed %q, runs %d, rows %d (want %d)", s, st, st2,
				h2.Get("Idempotent-Replayed"), runs.Load()-before, n, wantRows)
		}
	}
	prSettled(t, pool, m)
}

// TestCallbacksObserverReentrant: an Observer that reads m.GateStats() and m.Options() from
// every event (a gauge refreshed from the counter) does not deadlock or change answers.
func TestCallbacksObserverReentrant(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 6)
	var mp atomic.Pointer[idem.Middleware]
	var calls atomic.Int32
	obs := reentrantObs{m: &mp, calls: &calls}
	release := make(chan struct{})
	var entered sync.Once
	in := make(chan struct{})
	srv, m := prServe(t, idem.Options{DB: pool, Metrics: obs}, idem.Route{Lease: 3 * time.Second},
		func(w http.ResponseWriter, r *http.Request) {
			entered.Do(func() { close(in) })
			<-release
			w.WriteHeader(201)
		})
	mp.Store(m)
	var wg sync.WaitGroup
	results := make([]int, 4)
	for i := range results {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if i > 0 {
				<-in
			}
			results[i], _, _ = cbSend(t, srv.URL, "re-1", `{"a":1}`)
		}()
	}
	<-in
	time.Sleep(2500 * time.Millisecond) // a heartbeat's extension (every third of 3 s) runs LeaseExtended
	close(release)
	wg.Wait()
	for i, st := range results {
		if st != 201 {
			t.Errorf("request %d: %d", i, st)
		}
	}
	if calls.Load() == 0 {
		t.Error("the Observer was never called")
	}
	prSettled(t, pool, m)
}

type reentrantObs struct {
	m     *atomic.Pointer[idem.Middleware]
	calls *atomic.Int32
}

func (o reentrantObs) touch() {
	o.calls.Add(1)
	if m := o.m.Load(); m != nil {
		_ = m.GateStats()
		_ = m.Options()
	}
}
func (o reentrantObs) Count(string, idem.State)               { o.touch() }
func (o reentrantObs) Done(idem.State, time.Duration)         { o.touch() }
func (o reentrantObs) LeaseExtended(string)                   { o.touch() }
func (o reentrantObs) LeaseEnded(string, bool, time.Duration) { o.touch() }

// TestCallbacksNestedDoSameKey: a Do inside a Do's fn with the same job on the same pool.
// Do: "a run still in progress past the lock timeout, ErrInProgress": the inner Do waits (in
// the process's Gate, for the outer one) at most the lock timeout and returns ErrInProgress,
// never waits forever; the outer fn's error rolls back, the key is free at once afterwards.
// Another key inside fn commits on its own.
func TestCallbacksNestedDoSameKey(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	job := idem.Job{Principal: "alice", Key: "nest-same", Action: "a", LockTimeout: 500 * time.Millisecond}
	var innerErr error
	var innerTook time.Duration
	done := make(chan error, 1)
	go func() {
		_, _, err := idem.Do(ctx, pool, job, idem.TxOptions{}, func(ctx context.Context, tx pgx.Tx) (int, error) {
			began := time.Now()
			_, _, innerErr = idem.Do(ctx, pool, job, idem.TxOptions{}, func(context.Context, pgx.Tx) (int, error) { return 2, nil })
			innerTook = time.Since(began)
			other := idem.Job{Principal: "alice", Key: "nest-other", Action: "a"}
			if _, _, err := idem.Do(ctx, pool, other, idem.TxOptions{}, func(context.Context, pgx.Tx) (int, error) { return 3, nil }); err != nil {
				return 0, err
			}
			return 0, innerErr
		})
		done <- err
	}()
	var err error
	select {
	case err = <-done:
	case <-time.After(15 * time.Second):
		t.Fatal("a Do nested in a Do with the same key did not return within 15 s (deadlock)")
	}
	if !errors.Is(innerErr, idem.ErrInProgress) || innerTook > 5*time.Second {
		t.Errorf("inner Do: %v after %v; want ErrInProgress within about the lock timeout", innerErr, innerTook)
	}
	if !errors.Is(err, idem.ErrInProgress) {
		t.Errorf("outer Do: %v", err)
	}
	began := time.Now()
	v, replayed, err := idem.Do(ctx, pool, job, idem.TxOptions{}, func(context.Context, pgx.Tx) (int, error) { return 9, nil })
	if err != nil || replayed || v != 9 || time.Since(began) > time.Second {
		t.Errorf("after: %d %v %v in %v", v, replayed, err, time.Since(began))
	}
	v, replayed, err = idem.Do(ctx, pool, idem.Job{Principal: "alice", Key: "nest-other", Action: "a"}, idem.TxOptions{},
		func(context.Context, pgx.Tx) (int, error) { return 4, nil })
	if err != nil || !replayed || v != 3 {
		t.Errorf("the other key: %d %v %v; want its committed 3, replayed", v, replayed, err)
	}
	if n := pool.Stat().AcquiredConns(); n != 0 {
		t.Errorf("%d connections still acquired", n)
	}
}

// TestCallbacksDoLeasePanicNil: DoLease's fn panics with nil (a *runtime.PanicNilError since
// Go 1.21). "When fn panics, the heartbeat stops and the claim is given up before the panic
// goes on to the caller": the next DoLease runs fn at once, with the same ProviderKey.
func TestCallbacksDoLeasePanicNil(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	job := idem.Job{Principal: "alice", Key: "dl-nil", Action: "a", Lease: 20 * time.Second}
	var first string
	var recovered any
	func() {
		defer func() { recovered = recover() }()
		_, _, _ = idem.DoLease(ctx, pool, job, func(ctx context.Context, c idem.LeaseClaim) (int, error) {
			first = c.ProviderKey
			panic(nil)
		})
	}()
	var pn *runtime.PanicNilError
	if e, ok := recovered.(error); !ok || !errors.As(e, &pn) {
		t.Errorf("recovered %#v, want *runtime.PanicNilError", recovered)
	}
	began := time.Now()
	v, replayed, err := idem.DoLease(ctx, pool, job, func(ctx context.Context, c idem.LeaseClaim) (int, error) {
		if c.ProviderKey != first {
			t.Errorf("provider key %s, first %s", c.ProviderKey, first)
		}
		return 5, nil
	})
	if err != nil || replayed || v != 5 || time.Since(began) > 3*time.Second {
		t.Errorf("after the panic: %d %v %v in %v", v, replayed, err, time.Since(began))
	}
}

// TestCallbacksDoLeaseGoexit: DoLease's fn ends its goroutine (runtime.Goexit: t.FailNow in
// a test's job, or log.Fatal's cousin in a worker library). Neither a panic nor a return, but
// the heartbeat must stop and the claim be given up, or the key stays held the whole Timeout.
func TestCallbacksDoLeaseGoexit(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	job := idem.Job{Principal: "alice", Key: "dl-goexit", Action: "a", Lease: 20 * time.Second}
	exited := make(chan struct{})
	go func() {
		defer close(exited)
		_, _, _ = idem.DoLease(ctx, pool, job, func(ctx context.Context, c idem.LeaseClaim) (int, error) {
			runtime.Goexit()
			return 0, nil
		})
	}()
	<-exited
	began := time.Now()
	v, _, err := idem.DoLease(ctx, pool, job, func(ctx context.Context, c idem.LeaseClaim) (int, error) { return 5, nil })
	if err != nil || v != 5 || time.Since(began) > 3*time.Second {
		t.Errorf("after Goexit: %d %v in %v; want fn run at once", v, err, time.Since(began))
	}
}

// TestCallbacksLeaseHandlerGoexit: a lease route's handler ends its goroutine with
// runtime.Goexit. The lease must not be left extended by the heartbeat until LeaseTimeout:
// the retry runs the work (or gets the answer) within the lease, not 409 for minutes.
func TestCallbacksLeaseHandlerGoexit(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 6)
	var runs atomic.Int32
	srv, m := prServe(t, idem.Options{DB: pool}, idem.Route{Lease: 2 * time.Second},
		func(w http.ResponseWriter, r *http.Request) {
			if runs.Add(1) == 1 {
				runtime.Goexit()
			}
			w.WriteHeader(201)
		})
	st, _, body := cbSend(t, srv.URL, "gx", `{"a":1}`)
	t.Logf("first: %d %q", st, body)
	deadline := time.Now().Add(8 * time.Second)
	for {
		st, _, body = cbSend(t, srv.URL, "gx", `{"a":1}`)
		if st == 201 || time.Now().After(deadline) {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	if st != 201 {
		t.Errorf("retry 8 s after a handler's Goexit under a 2 s lease: %d %q (runs %d); the key is still held",
			st, body, runs.Load())
	}
	prSettled(t, pool, m)
}

// cbCleanupObs panics in Vacuumed, and counts PassEnded.
type cbCleanupObs struct {
	passes   atomic.Int32
	vacuumed atomic.Int32
	panicAt  string
}

func (o *cbCleanupObs) PassEnded(idem.PassResult, int, time.Duration) {
	o.passes.Add(1)
	if o.panicAt == "pass" {
		panic("metrics bug in PassEnded")
	}
}
func (o *cbCleanupObs) Vacuumed() {
	o.vacuumed.Add(1)
	if o.panicAt == "vacuum" {
		panic("metrics bug in Vacuumed")
	}
}

// cbChild runs test name in a child process with env set, and fails when the child dies.
func cbChild(t *testing.T, name, env string) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^"+name+"$", "-test.v", "-test.count=1")
	cmd.Env = append(os.Environ(), env)
	if out, err := cmd.CombinedOutput(); err != nil {
		s := string(out)
		if i := strings.Index(s, "goroutine "); i > 0 {
			s = s[:i]
		}
		t.Fatalf("the child process: %v\n%s", err, s)
	}
}

// TestCallbacksCleanupObserverPanicsVacuumed: CleanupObserver: "PassEnded is called once per
// pass"; "A panic of theirs is recovered ... and costs that event only" (D222). A Vacuumed that
// panicked (a metrics bug) reached Pass's caller, and its pass was never counted.
func TestCallbacksCleanupObserverPanicsVacuumed(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 4)
	obs := &cbCleanupObs{panicAt: "vacuum"}
	pgtest.InsertExpired(t, pool, "alice", 500)
	c, err := idem.NewCleaner(pool, idem.CleanerOptions{Duty: 1, Metrics: obs, Logger: auditQuiet})
	if err != nil {
		t.Fatal(err)
	}
	var recovered any
	func() {
		defer func() { recovered = recover() }()
		_, _, _ = c.Pass(context.Background())
	}()
	if obs.vacuumed.Load() == 0 {
		t.Fatal("the pass did not vacuum: the test needs the table's owner")
	}
	if recovered != nil {
		t.Errorf("a panic of CleanupObserver.Vacuumed reached Pass's caller: %v", recovered)
	}
	if obs.passes.Load() != 1 {
		t.Errorf("PassEnded called %d times for a pass whose Vacuumed panicked; want 1", obs.passes.Load())
	}
}

// TestCallbacksCleanupObserverPanicsScheduled: a started Cleaner (StartCleaner, "the one call
// a service makes") whose CleanupObserver.PassEnded panics. The pass runs on the scheduler's
// goroutine, where the panic ended the whole process, every request in flight with it (D222).
// Run in a child process; the test fails when the child dies.
func TestCallbacksCleanupObserverPanicsScheduled(t *testing.T) {
	if url := os.Getenv("CALLBACKS_CLEANER_OBS_DB"); url != "" {
		cbScheduledCleaner(t, url, &cbCleanupObs{panicAt: "pass"}, auditQuiet)
		return
	}
	t.Parallel()
	cbChild(t, "TestCallbacksCleanupObserverPanicsScheduled", "CALLBACKS_CLEANER_OBS_DB="+pgtest.NewDB(t))
}

// TestCallbacksCleanerLoggerPanicsScheduled: CleanerOptions.Logger whose slog handler panics
// ("A record whose handler panics is dropped"). A started cleaner logs each pass that deleted
// keys from the scheduler's goroutine, where the panic ended the process (D222).
func TestCallbacksCleanerLoggerPanicsScheduled(t *testing.T) {
	if url := os.Getenv("CALLBACKS_CLEANER_LOG_DB"); url != "" {
		logger, _, _ := prPanicLogger(slog.LevelDebug)
		cbScheduledCleaner(t, url, &cbCleanupObs{}, logger)
		return
	}
	t.Parallel()
	cbChild(t, "TestCallbacksCleanerLoggerPanicsScheduled", "CALLBACKS_CLEANER_LOG_DB="+pgtest.NewDB(t))
}

func cbScheduledCleaner(t *testing.T, url string, obs *cbCleanupObs, logger *slog.Logger) {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	pgtest.InsertExpired(t, pool, "alice", 20)
	c, err := idem.StartCleaner(ctx, pool, idem.CleanerOptions{Interval: 50 * time.Millisecond, Duty: 1, SkipVacuum: true,
		Metrics: obs, Logger: logger})
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(3 * time.Second)
	for i := 0; obs.passes.Load() < 3 && time.Now().Before(deadline); i++ {
		pgtest.InsertExpired(t, pool, "bob"+strconv.Itoa(i), 5)
		time.Sleep(30 * time.Millisecond)
	}
	c.Stop()
	if obs.passes.Load() < 3 {
		t.Errorf("passes: %d", obs.passes.Load())
	}
}

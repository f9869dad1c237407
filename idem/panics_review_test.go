package idem_test

// Panics and aborts through the middleware, Do and DoLease: the key is not left held, the
// Gate's line drains, connections go back to the pool, Shutdown completes, counts are taken
// once. A panicking callback the library calls (here the slog Logger's handler) is among them.

import (
	"context"
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

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// prPanicHandler is a slog.Handler that panics on records at or above level while armed.
type prPanicHandler struct {
	armed *atomic.Bool
	level slog.Level
	hits  *atomic.Int32
}

func (h prPanicHandler) Enabled(context.Context, slog.Level) bool { return true }
func (h prPanicHandler) Handle(_ context.Context, r slog.Record) error {
	if h.armed.Load() && r.Level >= h.level {
		h.hits.Add(1)
		panic("pr: the log handler panics on: " + r.Message)
	}
	return nil
}
func (h prPanicHandler) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h prPanicHandler) WithGroup(string) slog.Handler      { return h }

func prPanicLogger(level slog.Level) (*slog.Logger, *atomic.Bool, *atomic.Int32) {
	armed, hits := new(atomic.Bool), new(atomic.Int32)
	armed.Store(true)
	return slog.New(prPanicHandler{armed: armed, level: level, hits: hits}), armed, hits
}

// prObs records every event.
type prObs struct {
	mu     sync.Mutex
	events []string
}

func (o *prObs) add(s string)                       { o.mu.Lock(); o.events = append(o.events, s); o.mu.Unlock() }
func (o *prObs) Count(_ string, s idem.State)       { o.add("count:" + string(s)) }
func (o *prObs) Done(s idem.State, _ time.Duration) { o.add("done:" + string(s)) }
func (o *prObs) LeaseExtended(string)               {}
func (o *prObs) LeaseEnded(_ string, lost bool, _ time.Duration) {
	o.add(fmt.Sprintf("lease_ended:%v", lost))
}
func (o *prObs) String() string { o.mu.Lock(); defer o.mu.Unlock(); return fmt.Sprint(o.events) }
func (o *prObs) count(s string) int {
	o.mu.Lock()
	defer o.mu.Unlock()
	n := 0
	for _, e := range o.events {
		if e == s {
			n++
		}
	}
	return n
}

// prSend posts on a fresh connection (no keep-alive: net/http's client retries a request
// carrying Idempotency-Key on a reused connection that drops, which would hide a drop).
func prSend(t *testing.T, url, path, key, body string) (int, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, "POST", url+path, strings.NewReader(body))
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
		return -1, err.Error()
	}
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	if err != nil {
		return -1, err.Error()
	}
	return res.StatusCode, string(b)
}

func prServe(t *testing.T, opts idem.Options, rt idem.Route, h http.HandlerFunc) (*httptest.Server, *idem.Middleware) {
	t.Helper()
	if opts.Principal == nil {
		opts.Principal = alice
	}
	if opts.Logger == nil {
		opts.Logger = auditQuiet
	}
	m, err := idem.New(context.Background(), opts)
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("POST /things", m.Route(rt)(h))
	srv := httptest.NewUnstartedServer(mux)
	srv.Config.ErrorLog = nil
	srv.Start()
	t.Cleanup(srv.Close)
	return srv, m
}

// prSettled waits (up to 5 s) for the pool to have no connection acquired and the Gate no
// duplicate waiting, and that Shutdown completes.
func prSettled(t *testing.T, pool *pgxpool.Pool, m *idem.Middleware) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		s := m.GateStats()
		if pool.Stat().AcquiredConns() == 0 && s.Waiting == 0 && s.WaitingBytes == 0 && s.LockWaits == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Errorf("not settled: acquired conns %d, gate %+v", pool.Stat().AcquiredConns(), s)
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	began := time.Now()
	if err := m.Shutdown(ctx); err != nil {
		t.Errorf("Shutdown: %v after %v", err, time.Since(began))
	}
}

// TestPanicsLeaseLoggerPanicHoldsKey: on a lease route a handler panics (a bug) while the
// Logger's handler panics too (a callback the library calls). docs/http.md, lease table:
// "the handler answers anything else (5xx, 401, 429, a panic) | gives the lease up at once
// without an answer (idem_yield ...) | the same request: a fresh run at once". The middleware
// logged the handler's panic from inside its recovery, the Logger's panic escaped, and the lease
// was never given up: the retry got 409 and the key waited out its 20-second lease. The
// middleware's Logger drops a record whose handler panics now; the retry runs at once.
func TestPanicsLeaseLoggerPanicHoldsKey(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 8)
	logger, armed, hits := prPanicLogger(slog.LevelError)
	var runs atomic.Int32
	srv, m := prServe(t, idem.Options{DB: pool, Logger: logger, DuplicateWait: time.Second},
		idem.Route{Required: true, Lease: 20 * time.Second}, func(w http.ResponseWriter, r *http.Request) {
			if runs.Add(1) == 1 {
				panic("handler bug")
			}
			w.WriteHeader(201)
			fmt.Fprint(w, `{"id":"x"}`)
		})
	code1, body1 := prSend(t, srv.URL, "/things", "k-lease-log", `{"a":1}`)
	armed.Store(false)
	began := time.Now()
	code2, body2 := prSend(t, srv.URL, "/things", "k-lease-log", `{"a":1}`)
	t.Logf("first: %d %q (log handler panicked %d times); retry: %d %q after %v", code1, body1, hits.Load(), code2, body2, time.Since(began))
	if code2 != 201 || runs.Load() != 2 {
		t.Errorf("the retry of a request whose handler panicked got %d %s (runs %d); want a fresh run at once (201)", code2, body2, runs.Load())
	}
	prSettled(t, pool, m)
}

// TestPanicsTxLoggerPanicStillAnswers500: D20, "A panicking handler is rolled back and
// answered with 500 internal_error (stack logged), not re-panicked"; docs/http.md: "handler
// panic | 500 internal_error; its effect rolled back". With a Logger whose handler panics the
// rollback held, but the client's connection was dropped instead of the 500.
func TestPanicsTxLoggerPanicStillAnswers500(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 8)
	pgtest.Exec(t, pool, `CREATE TABLE pr_effects (id serial PRIMARY KEY)`)
	logger, armed, _ := prPanicLogger(slog.LevelError)
	var runs atomic.Int32
	srv, m := prServe(t, idem.Options{DB: pool, Logger: logger}, idem.Route{Required: true},
		func(w http.ResponseWriter, r *http.Request) {
			if _, err := idem.TxFrom(r.Context()).Exec(r.Context(), `INSERT INTO pr_effects DEFAULT VALUES`); err != nil {
				http.Error(w, err.Error(), 500)
				return
			}
			if runs.Add(1) == 1 {
				panic("handler bug")
			}
			w.WriteHeader(201)
		})
	code1, body1 := prSend(t, srv.URL, "/things", "k-tx-log", `{"a":1}`)
	armed.Store(false)
	code2, body2 := prSend(t, srv.URL, "/things", "k-tx-log", `{"a":1}`)
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM pr_effects`); n != 1 || code2 != 201 {
		t.Errorf("effects %d (want 1: the panicking run rolled back), retry %d %s", n, code2, body2)
	}
	if code1 != 500 || auditCode(body1) != "internal_error" {
		t.Errorf("a panicking handler (with a panicking Logger) was answered %d %q; want 500 internal_error", code1, body1)
	}
	prSettled(t, pool, m)
}

// TestPanicsLoggerInfoPanicDoublesDone: Observer.Done "times a keyed request ... by its main
// state" once; D219 "The request states count what the client was told". A Logger whose Info
// panicked after a 422 (the middleware logs every state but acquired and replayed) made the
// request timed twice, the second time as acquired (the count of an aborted handler, D219, took
// any panic for one).
func TestPanicsLoggerInfoPanicDoublesDone(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 8)
	logger, armed, _ := prPanicLogger(slog.LevelInfo)
	armed.Store(false)
	obs := &prObs{}
	srv, m := prServe(t, idem.Options{DB: pool, Logger: logger, Metrics: obs}, idem.Route{Required: true},
		func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(201) })
	if code, body := prSend(t, srv.URL, "/things", "k-info", `{"a":1}`); code != 201 {
		t.Fatalf("first: %d %s", code, body)
	}
	armed.Store(true)
	code, body := prSend(t, srv.URL, "/things", "k-info", `{"a":2}`)
	armed.Store(false)
	t.Logf("mismatch answered %d %q; events %s", code, body, obs)
	if d := obs.count("done:acquired"); d != 1 || obs.count("done:key_reused") != 1 {
		t.Errorf("events %s: want one done:acquired (the first request) and one done:key_reused; the 422 was timed twice", obs)
	}
	prSettled(t, pool, m)
}

// TestPanicsTxPanicWithOpenRows: a handler that panics with a query's rows still open on
// the route's transaction. docs/http.md: "handler panic | 500 internal_error; its effect rolled
// back". The connection goes back (or is dropped), the retry runs.
func TestPanicsTxPanicWithOpenRows(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 4)
	pgtest.Exec(t, pool, `CREATE TABLE pr_rows (id serial PRIMARY KEY)`)
	var runs atomic.Int32
	srv, m := prServe(t, idem.Options{DB: pool}, idem.Route{Required: true},
		func(w http.ResponseWriter, r *http.Request) {
			tx := idem.TxFrom(r.Context())
			if _, err := tx.Exec(r.Context(), `INSERT INTO pr_rows DEFAULT VALUES`); err != nil {
				http.Error(w, err.Error(), 500)
				return
			}
			if runs.Add(1) == 1 {
				rows, err := tx.Query(r.Context(), `SELECT g FROM generate_series(1, 2000000) g`)
				if err != nil {
					http.Error(w, err.Error(), 500)
					return
				}
				rows.Next()
				panic("handler bug with rows open")
			}
			w.WriteHeader(201)
		})
	began := time.Now()
	code1, body1 := prSend(t, srv.URL, "/things", "k-rows", `{"a":1}`)
	took := time.Since(began)
	code2, body2 := prSend(t, srv.URL, "/things", "k-rows", `{"a":1}`)
	if code1 != 500 || auditCode(body1) != "internal_error" || took > 5*time.Second {
		t.Errorf("first: %d %q after %v; want 500 internal_error", code1, body1, took)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM pr_rows`); n != 1 || code2 != 201 {
		t.Errorf("effects %d (want 1), retry %d %s", n, code2, body2)
	}
	prSettled(t, pool, m)
}

// TestPanicsTxAbortOtherProcessDuplicate: a handler aborts (http.ErrAbortHandler) while a
// duplicate in another process (another middleware on the same database) waits on the key's
// row lock. D20: the abort rolls back; docs/http.md: a repeat "waits for the first's answer";
// the duplicate claims the key the moment the row lock goes, and runs. The aborting request is
// counted acquired once and timed once (D219).
func TestPanicsTxAbortOtherProcessDuplicate(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 8)
	pool2, err := pgxpool.New(context.Background(), pgtest.URLOf(t, pool))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool2.Close)
	pgtest.Exec(t, pool, `CREATE TABLE pr_abort (id serial PRIMARY KEY, who text)`)
	inside, release := make(chan struct{}), make(chan struct{})
	var relOnce sync.Once
	defer relOnce.Do(func() { close(release) }) // before the servers' Close, which waits for A's handler
	obsA := &prObs{}
	srvA, mA := prServe(t, idem.Options{DB: pool, Metrics: obsA, LockTimeout: 5 * time.Second, DuplicateWait: 10 * time.Second},
		idem.Route{Required: true}, func(w http.ResponseWriter, r *http.Request) {
			if _, err := idem.TxFrom(r.Context()).Exec(r.Context(), `INSERT INTO pr_abort (who) VALUES ('A')`); err != nil {
				http.Error(w, err.Error(), 500)
				return
			}
			close(inside)
			<-release
			panic(http.ErrAbortHandler)
		})
	srvB, mB := prServe(t, idem.Options{DB: pool2, LockTimeout: 5 * time.Second, DuplicateWait: 10 * time.Second},
		idem.Route{Required: true}, func(w http.ResponseWriter, r *http.Request) {
			if _, err := idem.TxFrom(r.Context()).Exec(r.Context(), `INSERT INTO pr_abort (who) VALUES ('B')`); err != nil {
				http.Error(w, err.Error(), 500)
				return
			}
			w.WriteHeader(201)
			fmt.Fprint(w, `{"who":"B"}`)
		})
	type res struct {
		code int
		body string
		at   time.Time
	}
	aDone, bDone := make(chan res, 1), make(chan res, 1)
	go func() {
		c, b := prSend(t, srvA.URL, "/things", "k-abort", `{"a":1}`)
		aDone <- res{c, b, time.Now()}
	}()
	<-inside
	go func() {
		c, b := prSend(t, srvB.URL, "/things", "k-abort", `{"a":1}`)
		bDone <- res{c, b, time.Now()}
	}()
	// B waits on the key's row, held by A's open transaction.
	pgtest.WaitFor(t, pool, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()`)
	released := time.Now()
	relOnce.Do(func() { close(release) })
	a, b := <-aDone, <-bDone
	t.Logf("A %d at +%v; B %d %q at +%v", a.code, a.at.Sub(released), b.code, b.body, b.at.Sub(released))
	if a.code != -1 {
		t.Errorf("the aborting request got %d %q; want the connection dropped", a.code, a.body)
	}
	if b.code != 201 || b.at.Sub(released) > 2*time.Second {
		t.Errorf("the other process's duplicate got %d %q %v after the abort; want 201 at once", b.code, b.body, b.at.Sub(released))
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM pr_abort WHERE who = 'A'`); n != 0 {
		t.Errorf("the aborted run's effect was kept (%d rows)", n)
	}
	if obsA.count("count:acquired") != 1 || obsA.count("done:acquired") != 1 {
		t.Errorf("A's events %s: want acquired counted and timed once", obsA)
	}
	prSettled(t, pool, mA)
	prSettled(t, pool2, mB)
}

// TestPanicsLeaseDuplicateBehindPanic: on a lease route, a duplicate (the same request) waits
// for the holder's answer; the holder's handler panics (a value, or http.ErrAbortHandler).
// docs/http.md: a panic "gives the lease up at once without an answer ... the same request: a
// fresh run at once, with the same provider key". The duplicate must run the work, under the
// same provider key, well before the 20-second lease, and the gauges come back to 0.
func TestPanicsLeaseDuplicateBehindPanic(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		p    any
		want int // the holder's answer: 500, or -1 (dropped)
	}{{"value", "handler bug", 500}, {"abort", http.ErrAbortHandler, -1}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			pool, _ := pgtest.NewPool(t, 8)
			inside, release := make(chan struct{}), make(chan struct{})
			var relOnce sync.Once
			defer relOnce.Do(func() { close(release) })
			var runs atomic.Int32
			var pks sync.Map
			obs := &prObs{}
			srv, m := prServe(t, idem.Options{DB: pool, Metrics: obs, DuplicateWait: 15 * time.Second},
				idem.Route{Required: true, Lease: 20 * time.Second}, func(w http.ResponseWriter, r *http.Request) {
					ci, _ := idem.ClaimOf(r.Context())
					pks.Store(ci.ProviderKey, true)
					if runs.Add(1) == 1 {
						close(inside)
						<-release
						panic(tc.p)
					}
					w.WriteHeader(201)
					fmt.Fprint(w, `{"id":"2"}`)
				})
			aDone := make(chan int, 1)
			go func() { c, _ := prSend(t, srv.URL, "/things", "k-ld", `{"a":1}`); aDone <- c }()
			<-inside
			type res struct {
				code int
				body string
			}
			bDone := make(chan res, 1)
			go func() { c, b := prSend(t, srv.URL, "/things", "k-ld", `{"a":1}`); bDone <- res{c, b} }()
			deadline := time.Now().Add(5 * time.Second)
			for m.GateStats().Waiting == 0 && time.Now().Before(deadline) {
				time.Sleep(10 * time.Millisecond)
			}
			if m.GateStats().Waiting == 0 {
				t.Fatalf("the duplicate does not wait: %+v", m.GateStats())
			}
			released := time.Now()
			relOnce.Do(func() { close(release) })
			a := <-aDone
			b := <-bDone
			took := time.Since(released)
			t.Logf("holder %d, duplicate %d after %v", a, b.code, took)
			n := 0
			pks.Range(func(any, any) bool { n++; return true })
			if a != tc.want || b.code != 201 || runs.Load() != 2 || n != 1 || took > 3*time.Second {
				t.Errorf("holder %d (want %d); duplicate %d %q after %v; runs %d, provider keys %d", a, tc.want, b.code, b.body, took, runs.Load(), n)
			}
			if obs.count("count:acquired") != 2 || obs.count("done:acquired") != 2 || obs.count("lease_ended:false") != 2 {
				t.Errorf("events %s: want two acquired (counted, timed) and two lease ends", obs)
			}
			prSettled(t, pool, m)
		})
	}
}

// TestPanicsDoAbortDuplicateWaiting: Do's fn panics (http.ErrAbortHandler, as a handler
// calling Do might) while a duplicate Do of the process waits in the Gate. "When fn fails the
// transaction rolls back, nothing is stored, and a later Do runs fn again"; the duplicate runs
// fn and returns its result; the panic reaches the caller; the pool and the Gate are left clean.
func TestPanicsDoAbortDuplicateWaiting(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 4)
	pgtest.Exec(t, pool, `CREATE TABLE pr_do (id serial PRIMARY KEY)`)
	gate := idem.NewGate(idem.GateOptions{})
	job := idem.Job{Principal: "alice", Key: "k-do", Action: "pr", Input: map[string]int{"a": 1}, Gate: gate}
	inside, release := make(chan struct{}), make(chan struct{})
	var runs atomic.Int32
	fn := func(ctx context.Context, tx pgx.Tx) (int, error) {
		if _, err := tx.Exec(ctx, `INSERT INTO pr_do DEFAULT VALUES`); err != nil {
			return 0, err
		}
		if runs.Add(1) == 1 {
			close(inside)
			<-release
			panic(http.ErrAbortHandler)
		}
		return 7, nil
	}
	panicked := make(chan any, 1)
	go func() {
		defer func() { panicked <- recover() }()
		_, _, _ = idem.Do(context.Background(), pool, job, idem.TxOptions{}, fn)
	}()
	<-inside
	type res struct {
		v        int
		replayed bool
		err      error
	}
	dup := make(chan res, 1)
	go func() {
		v, rep, err := idem.Do(context.Background(), pool, job, idem.TxOptions{}, fn)
		dup <- res{v, rep, err}
	}()
	deadline := time.Now().Add(5 * time.Second)
	for gate.Stats().Waiting == 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	close(release)
	if p := <-panicked; p != http.ErrAbortHandler {
		t.Errorf("the panic that reached Do's caller: %v", p)
	}
	select {
	case d := <-dup:
		if d.err != nil || d.v != 7 || d.replayed {
			t.Errorf("duplicate: %v %v %v", d.v, d.replayed, d.err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the duplicate Do hangs")
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM pr_do`); n != 1 {
		t.Errorf("effects %d, want 1", n)
	}
	if s := gate.Stats(); s.Waiting != 0 || s.WaitingBytes != 0 || pool.Stat().AcquiredConns() != 0 {
		t.Errorf("gate %+v, acquired conns %d", s, pool.Stat().AcquiredConns())
	}
}

// TestPanicsDoLeaseStepAbort: inside DoLease, a Step's fn panics (http.ErrAbortHandler) after
// its write. DoLease: "When fn panics, the heartbeat stops and the claim is given up (Yield)
// before the panic goes on"; Step: "When fn fails, its transaction rolls back ... the step is
// not recorded, and runs again on the next attempt". The next DoLease runs at once (not after
// the 20-second lease), skips the recorded step, runs the failed one again; one effect each.
func TestPanicsDoLeaseStepAbort(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 4)
	pgtest.Exec(t, pool, `CREATE TABLE pr_steps (step text)`)
	job := idem.Job{Principal: "alice", Key: "k-dl-step", Action: "pr-steps", Lease: 20 * time.Second, Input: map[string]int{"a": 1}}
	var firstRuns, secondRuns atomic.Int32
	var pks sync.Map
	fn := func(ctx context.Context, c idem.LeaseClaim) (string, error) {
		pks.Store(c.ProviderKey, true)
		if _, err := idem.Step(ctx, "one", func(ctx context.Context, tx pgx.Tx) (int, error) {
			firstRuns.Add(1)
			_, err := tx.Exec(ctx, `INSERT INTO pr_steps VALUES ('one')`)
			return 1, err
		}); err != nil {
			return "", err
		}
		v, err := idem.Step(ctx, "two", func(ctx context.Context, tx pgx.Tx) (int, error) {
			if _, err := tx.Exec(ctx, `INSERT INTO pr_steps VALUES ('two')`); err != nil {
				return 0, err
			}
			if secondRuns.Add(1) == 1 {
				panic(http.ErrAbortHandler)
			}
			return 2, nil
		})
		return fmt.Sprint(v), err
	}
	func() {
		defer func() {
			if p := recover(); p != http.ErrAbortHandler {
				t.Errorf("the panic that reached DoLease's caller: %v", p)
			}
		}()
		_, _, _ = idem.DoLease(context.Background(), pool, job, fn)
	}()
	if n := pool.Stat().AcquiredConns(); n != 0 {
		t.Errorf("acquired connections after the panic: %d", n)
	}
	began := time.Now()
	v, replayed, err := idem.DoLease(context.Background(), pool, job, fn)
	took := time.Since(began)
	n := 0
	pks.Range(func(any, any) bool { n++; return true })
	if err != nil || v != "2" || replayed || took > 3*time.Second || firstRuns.Load() != 1 || secondRuns.Load() != 2 || n != 1 {
		t.Errorf("second DoLease: %q %v %v after %v; step one ran %d, step two %d; provider keys %d", v, replayed, err, took,
			firstRuns.Load(), secondRuns.Load(), n)
	}
	if got := pgtest.Count(t, pool, `SELECT count(*) FROM pr_steps`); got != 2 {
		t.Errorf("effects %d, want 2 (one per step; the aborted step's write rolled back)", got)
	}
}

// TestPanicsLeaseRouteStepPanic: on a lease route, a Step's fn panics (a value) after its
// write; docs/http.md: a panic "gives the lease up at once ... the same request: a fresh run at
// once, with the same provider key"; the handler answers 500 internal_error.
func TestPanicsLeaseRouteStepPanic(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 8)
	pgtest.Exec(t, pool, `CREATE TABLE pr_rsteps (step text)`)
	var secondRuns atomic.Int32
	srv, m := prServe(t, idem.Options{DB: pool}, idem.Route{Required: true, Lease: 20 * time.Second},
		func(w http.ResponseWriter, r *http.Request) {
			if _, err := idem.Step(r.Context(), "one", func(ctx context.Context, tx pgx.Tx) (int, error) {
				_, err := tx.Exec(ctx, `INSERT INTO pr_rsteps VALUES ('one')`)
				return 1, err
			}); err != nil {
				http.Error(w, err.Error(), http.StatusServiceUnavailable)
				return
			}
			if _, err := idem.Step(r.Context(), "two", func(ctx context.Context, tx pgx.Tx) (int, error) {
				if _, err := tx.Exec(ctx, `INSERT INTO pr_rsteps VALUES ('two')`); err != nil {
					return 0, err
				}
				if secondRuns.Add(1) == 1 {
					panic("step bug")
				}
				return 2, nil
			}); err != nil {
				http.Error(w, err.Error(), http.StatusServiceUnavailable)
				return
			}
			w.WriteHeader(201)
		})
	code1, body1 := prSend(t, srv.URL, "/things", "k-rs", `{"a":1}`)
	began := time.Now()
	code2, body2 := prSend(t, srv.URL, "/things", "k-rs", `{"a":1}`)
	if code1 != 500 || auditCode(body1) != "internal_error" || code2 != 201 || time.Since(began) > 3*time.Second {
		t.Errorf("first %d %q; retry %d %q after %v", code1, body1, code2, body2, time.Since(began))
	}
	if got := pgtest.Count(t, pool, `SELECT count(*) FROM pr_rsteps`); got != 2 {
		t.Errorf("effects %d, want 2", got)
	}
	prSettled(t, pool, m)
}

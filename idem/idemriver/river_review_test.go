package idemriver_test

// idemriver under River: retries, rescues, cancels and
// snoozes, steps, Insert from keyed requests, Middleware against Work, hostile inputs.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivertype"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/idem/idemriver"
)

// startedClient is a started River client on pool with cfg's knobs filled in for fast tests.
func startedClient(t *testing.T, pool *pgxpool.Pool, workers *river.Workers, maxWorkers int, mod func(*river.Config)) *river.Client[pgx.Tx] {
	t.Helper()
	cfg := &river.Config{Logger: quietLog, Workers: workers, RetryPolicy: fastRetry{},
		FetchCooldown: 5 * time.Millisecond, FetchPollInterval: 50 * time.Millisecond,
		Queues: map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: maxWorkers}}}
	if mod != nil {
		mod(cfg)
	}
	client, err := river.NewClient(riverpgxv5.New(pool), cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := client.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = client.StopAndCancel(ctx)
	})
	return client
}

// waitState waits up to d for the job to reach state; it returns the state it ended in.
func waitState(t *testing.T, pool *pgxpool.Pool, id int64, state string, d time.Duration) string {
	t.Helper()
	var got string
	for deadline := time.Now().Add(d); ; time.Sleep(25 * time.Millisecond) {
		if err := pool.QueryRow(context.Background(), `SELECT state::text FROM river_job WHERE id = $1`, id).Scan(&got); err != nil {
			t.Fatal(err)
		}
		if got == state || time.Now().After(deadline) {
			return got
		}
	}
}

// flakyWorker fails its first `fails` runs after calling the provider; it records the provider
// keys it saw.
type flakyWorker struct {
	river.WorkerDefaults[ReceiptArgs]
	p     *provider
	fails int32
	runs  atomic.Int32
	mu    sync.Mutex
	keys  []string
}

func (w *flakyWorker) Work(ctx context.Context, job *river.Job[ReceiptArgs]) error {
	claim, ok := idemriver.ClaimOf(ctx)
	if !ok {
		return errors.New("no claim")
	}
	w.mu.Lock()
	w.keys = append(w.keys, claim.ProviderKey)
	w.mu.Unlock()
	w.p.send(claim.ProviderKey)
	if w.runs.Add(1) <= w.fails {
		return errors.New("provider answer lost")
	}
	return nil
}

// TestRetriesAndManualRetryOfCompleted: three failures, then a success, under River: one
// provider key for all; then client.JobRetry of the completed job (an operator's retry) does
// not run the worker again (its result is stored).
func TestRetriesAndManualRetryOfCompleted(t *testing.T) {
	ctx := context.Background()
	pool := newPool(t)
	p := newProvider()
	w := &flakyWorker{p: p, fails: 3}
	workers := river.NewWorkers()
	river.AddWorker(workers, w)
	client := startedClient(t, pool, workers, 2, func(c *river.Config) {
		c.Middleware = []rivertype.Middleware{idemriver.Middleware(idemriver.Options{DB: pool, Lease: 2 * time.Second})}
	})
	res, err := client.Insert(ctx, ReceiptArgs{Order: 1}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if s := waitState(t, pool, res.Job.ID, "completed", 20*time.Second); s != "completed" {
		t.Fatalf("job state %s", s)
	}
	effects, calls := p.figures()
	if effects != 1 || len(calls) != 1 || w.runs.Load() != 4 {
		t.Fatalf("effects %d calls %v runs %d", effects, calls, w.runs.Load())
	}
	if _, err := client.JobRetry(ctx, res.Job.ID); err != nil {
		t.Fatal(err)
	}
	waitFor(t, pool, `SELECT count(*) FROM river_job WHERE id = $1 AND state = 'completed' AND attempt = 5`, res.Job.ID)
	if n := w.runs.Load(); n != 4 {
		t.Fatalf("the manual retry of a completed job ran the worker: %d runs, want 4", n)
	}
}

// hangWorker calls the provider and then hangs, ignoring its context, until released.
type hangWorker struct {
	river.WorkerDefaults[ReceiptArgs]
	p       *provider
	started chan struct{}
	release chan struct{}
	runs    atomic.Int32
}

func (w *hangWorker) Work(ctx context.Context, job *river.Job[ReceiptArgs]) error {
	claim, ok := idemriver.ClaimOf(ctx)
	if !ok {
		return errors.New("no claim")
	}
	w.p.send(claim.ProviderKey)
	if w.runs.Add(1) == 1 {
		close(w.started)
		<-w.release
	}
	return nil
}

// TestLeaseLostLateResultUnderRiver: a real River client runs a job whose worker hangs past
// River's job timeout, ignoring it (the heartbeat stops with the job's context). Another run
// of the same job row (a rescue on another client) takes the key over once the lease ran out
// and stores its result. The hung worker then returns nil: its late result is fenced, River
// records an errored attempt, and the retry completes without running the worker.
func TestLeaseLostLateResultUnderRiver(t *testing.T) {
	ctx := context.Background()
	pool := newPool(t)
	p := newProvider()
	w := &hangWorker{p: p, started: make(chan struct{}), release: make(chan struct{})}
	workers := river.NewWorkers()
	river.AddWorker(workers, w)
	opts := idemriver.Options{DB: pool, Lease: time.Second, Snooze: 200 * time.Millisecond}
	// Work (not the middleware) gets River's job timeout on its context.
	client := startedClient(t, pool, workers, 1, func(c *river.Config) {
		c.JobTimeout = 500 * time.Millisecond
		c.Middleware = []rivertype.Middleware{idemriver.Middleware(opts)}
	})
	res, err := client.Insert(ctx, ReceiptArgs{Order: 2}, nil)
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-w.started:
	case <-time.After(20 * time.Second):
		t.Fatal("never started")
	}
	// The middleware's context has no job timeout (River sets it inside the middleware), so
	// the lease stays extended: a second run of the row is snoozed while the worker hangs.
	row := *res.Job
	row.Attempt, row.AttemptedBy = 2, []string{"c1", "c2"}
	var rescued atomic.Int32
	err = idemriver.Work(ctx, &row, opts, func(context.Context, idem.LeaseClaim) error { rescued.Add(1); return nil })
	var snooze *river.JobSnoozeError
	if !errors.As(err, &snooze) || rescued.Load() != 0 {
		t.Fatalf("a rescue while the hung worker's lease is extended: %v, ran %d", err, rescued.Load())
	}
	close(w.release)
	if s := waitState(t, pool, res.Job.ID, "completed", 20*time.Second); s != "completed" {
		t.Fatalf("state %s", s)
	}
	effects, calls := p.figures()
	if effects != 1 || len(calls) != 1 {
		t.Fatalf("effects %d calls %v", effects, calls)
	}
}

// TestNestedMiddlewareAndWork: Middleware is installed "for every job in
// river.Config.Middleware", and the docs' example workers call Work. A service that did both
// claimed the job's key twice in one run: the inner Work found the outer claim in progress and
// snoozed; the outer fn "failed" with that snooze, yielded, and River snoozed the job, which
// never spent an attempt and never completed. The inner Work runs fn under the outer claim.
func TestNestedMiddlewareAndWork(t *testing.T) {
	ctx := context.Background()
	pool := newPool(t)
	opts := idemriver.Options{DB: pool, Lease: time.Second, Snooze: 100 * time.Millisecond}
	var runs atomic.Int32
	workers := river.NewWorkers()
	river.AddWorker(workers, river.WorkFunc(func(ctx context.Context, job *river.Job[ReceiptArgs]) error {
		outer, _ := idemriver.ClaimOf(ctx)
		return idemriver.Work(ctx, job.JobRow, opts, func(ctx context.Context, claim idem.LeaseClaim) error {
			if claim != outer {
				return errors.New("the inner Work's claim is not the middleware's")
			}
			runs.Add(1)
			return nil
		})
	}))
	client := startedClient(t, pool, workers, 1, func(c *river.Config) {
		c.Middleware = []rivertype.Middleware{idemriver.Middleware(opts)}
	})
	res, err := client.Insert(ctx, ReceiptArgs{Order: 3}, nil)
	if err != nil {
		t.Fatal(err)
	}
	s := waitState(t, pool, res.Job.ID, "completed", 6*time.Second)
	if s != "completed" {
		var snoozes, attempt int
		_ = pool.QueryRow(ctx, `SELECT coalesce((metadata->>'snoozes')::int, 0), attempt FROM river_job WHERE id = $1`, res.Job.ID).Scan(&snoozes, &attempt)
		t.Fatalf("a job under the global middleware whose worker also uses Work: state %s after 6 s, %d snoozes, attempt %d, fn ran %d times; "+
			"want it completed (or refused with an error that says why), not snoozed forever", s, snoozes, attempt, runs.Load())
	}
	if runs.Load() != 1 {
		t.Fatalf("fn ran %d times; want once", runs.Load())
	}
}

// stepWorker does two steps under the middleware, failing after the first on its first run.
type stepWorker struct {
	river.WorkerDefaults[ReceiptArgs]
	pool  *pgxpool.Pool
	aRuns atomic.Int32
	bRuns atomic.Int32
	runs  atomic.Int32
	rps   []string
	mu    sync.Mutex
}

func (w *stepWorker) Work(ctx context.Context, job *river.Job[ReceiptArgs]) error {
	claim, _ := idemriver.ClaimOf(ctx)
	w.mu.Lock()
	w.rps = append(w.rps, claim.RecoveryPoint)
	w.mu.Unlock()
	run := w.runs.Add(1)
	if _, err := idem.Step(ctx, "a", func(ctx context.Context, tx pgx.Tx) (int, error) {
		w.aRuns.Add(1)
		_, err := tx.Exec(ctx, `INSERT INTO step_effects VALUES ('a')`)
		return 1, err
	}); err != nil {
		return err
	}
	if run == 1 {
		return errors.New("fail between the steps")
	}
	_, err := idem.Step(ctx, "b", func(ctx context.Context, tx pgx.Tx) (int, error) {
		w.bRuns.Add(1)
		_, err := tx.Exec(ctx, `INSERT INTO step_effects VALUES ('b')`)
		return 2, err
	})
	return err
}

// TestStepsAcrossRiverRetries: a step recorded by a failed run is not run again by River's
// retry (after the yield, not a takeover), and the retry is told its recovery point.
func TestStepsAcrossRiverRetries(t *testing.T) {
	ctx := context.Background()
	pool := newPool(t)
	pgExec(t, pool, `CREATE TABLE step_effects (s text)`)
	w := &stepWorker{pool: pool}
	workers := river.NewWorkers()
	river.AddWorker(workers, w)
	client := startedClient(t, pool, workers, 1, func(c *river.Config) {
		c.Middleware = []rivertype.Middleware{idemriver.Middleware(idemriver.Options{DB: pool, Lease: 2 * time.Second})}
	})
	res, err := client.Insert(ctx, ReceiptArgs{Order: 4}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if s := waitState(t, pool, res.Job.ID, "completed", 20*time.Second); s != "completed" {
		t.Fatalf("state %s", s)
	}
	if w.aRuns.Load() != 1 || w.bRuns.Load() != 1 || count(t, pool, `SELECT count(*) FROM step_effects`) != 2 {
		t.Fatalf("a ran %d, b ran %d, effects %d; want one each", w.aRuns.Load(), w.bRuns.Load(), count(t, pool, `SELECT count(*) FROM step_effects`))
	}
	if len(w.rps) != 2 || w.rps[1] != "a" {
		t.Logf("recovery points seen: %q (the retry after a yield)", w.rps)
	}
}

// TestStepAfterJobTimeout: River's job timeout ends the work's context (Work called from the
// worker, so the context carries River's timeout); a Step called after that: does it run its
// fn (and the outside call in it) on an ended context?
func TestStepAfterJobTimeout(t *testing.T) {
	pool := newPool(t)
	client := newClient(t, pool, nil)
	job := jobRow(t, client, ReceiptArgs{Order: 5})
	jctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	var stepRan atomic.Int32
	var stepErr error
	err := idemriver.Work(jctx, job, idemriver.Options{DB: pool, Lease: 2 * time.Second}, func(ctx context.Context, _ idem.LeaseClaim) error {
		<-ctx.Done() // the job timeout
		_, stepErr = idem.Step(ctx, "after-timeout", func(ctx context.Context, tx pgx.Tx) (int, error) {
			stepRan.Add(1) // an outside call
			return 1, nil
		})
		return stepErr
	})
	t.Logf("Work: %v; Step: %v; step fn ran %d", err, stepErr, stepRan.Load())
	if stepErr == nil {
		t.Fatalf("a Step after the job's context ended was recorded")
	}
	// Retry: the step runs then (once).
	if err := idemriver.Work(context.Background(), job, idemriver.Options{DB: pool, Lease: 2 * time.Second}, func(ctx context.Context, _ idem.LeaseClaim) error {
		_, err := idem.Step(ctx, "after-timeout", func(ctx context.Context, tx pgx.Tx) (int, error) {
			stepRan.Add(1)
			return 1, nil
		})
		return err
	}); err != nil {
		t.Fatal(err)
	}
}

// poolWorker does a step whose fn first calls out (a slow provider) and then writes.
type poolWorker struct {
	river.WorkerDefaults[ReceiptArgs]
	runs atomic.Int32
}

func (w *poolWorker) Work(ctx context.Context, job *river.Job[ReceiptArgs]) error {
	w.runs.Add(1)
	_, err := idem.Step(ctx, "charge", func(ctx context.Context, tx pgx.Tx) (int64, error) {
		select { // the provider call: longer than a third of the lease
		case <-time.After(700 * time.Millisecond):
		case <-ctx.Done():
			return 0, ctx.Err()
		}
		_, err := tx.Exec(ctx, `INSERT INTO step_effects VALUES ($1::bigint::text)`, job.Args.Order)
		return job.Args.Order, err
	})
	return err
}

// TestSmallPoolStepsCallingOut: River and idem share a pool of 4 connections, then of 2; 4
// jobs run at once, each a step that calls out before its first statement: they all complete,
// each step once, no lease lost, no error (go doc idem.Step: "an outside call before fn's
// first statement holds none").
func TestSmallPoolStepsCallingOut(t *testing.T) {
	for _, conns := range []int32{smallPoolConns, 2} {
		t.Run(fmt.Sprintf("pool of %d", conns), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			big := newPool(t)
			pgExec(t, big, `CREATE TABLE step_effects (s text)`)
			cfg, err := pgxpool.ParseConfig(big.Config().ConnString())
			if err != nil {
				t.Fatal(err)
			}
			cfg.MaxConns = conns
			pool, err := pgxpool.NewWithConfig(ctx, cfg)
			if err != nil {
				t.Fatal(err)
			}
			defer pool.Close()
			w := &poolWorker{}
			workers := river.NewWorkers()
			river.AddWorker(workers, w)
			client := startedClient(t, pool, workers, 4, func(c *river.Config) {
				c.Middleware = []rivertype.Middleware{idemriver.Middleware(idemriver.Options{DB: pool, Lease: time.Second})}
			})
			for i := range 8 {
				if _, err := client.Insert(ctx, ReceiptArgs{Order: int64(100 + i)}, nil); err != nil {
					t.Fatal(err)
				}
			}
			for deadline := time.Now().Add(30 * time.Second); count(t, big, `SELECT count(*) FROM river_job WHERE state = 'completed'`) < 8; time.Sleep(50 * time.Millisecond) {
				if time.Now().After(deadline) {
					t.Fatalf("only %d of 8 jobs completed", count(t, big, `SELECT count(*) FROM river_job WHERE state = 'completed'`))
				}
			}
			var errs int
			if err := big.QueryRow(ctx, `SELECT coalesce(sum(coalesce(array_length(errors, 1), 0)), 0) FROM river_job`).Scan(&errs); err != nil {
				t.Fatal(err)
			}
			if n := count(t, big, `SELECT count(*) FROM step_effects`); n != 8 || w.runs.Load() != 8 || errs != 0 {
				t.Fatalf("effects %d runs %d errors %d, want 8, 8 and 0", n, w.runs.Load(), errs)
			}
		})
	}
}

// TestInsertFromRequests: a handler that enqueues and then answers a final 422 enqueues
// nothing (rolled back to the savepoint); a repeat with another body (422 reuse) and a
// repeat while the first runs (409/wait) enqueue nothing; an unkeyed request on a route that
// does not require a key: does Insert enqueue (one job per request) or refuse?
func TestInsertFromRequests(t *testing.T) {
	ctx := context.Background()
	pool := newPool(t)
	client := newClient(t, pool, nil)
	m, err := idem.New(ctx, idem.Options{DB: pool, Principal: func(*http.Request) (string, bool) { return "alice", true },
		DuplicateWait: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	hold := make(chan struct{})
	entered := make(chan struct{}, 4)
	var insErr []error
	var mu sync.Mutex
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var o struct {
			N    int64  `json:"n"`
			Mode string `json:"mode"`
		}
		if !idem.DecodeJSON(w, r, &o) {
			return
		}
		_, err := idemriver.Insert(r.Context(), client, ReceiptArgs{Order: o.N}, nil)
		mu.Lock()
		insErr = append(insErr, err)
		mu.Unlock()
		switch o.Mode {
		case "final":
			http.Error(w, "unprocessable", http.StatusUnprocessableEntity)
			return
		case "hold":
			entered <- struct{}{}
			<-hold
		}
		w.WriteHeader(http.StatusCreated)
	})
	mux := http.NewServeMux()
	mux.Handle("POST /req", m.Route(idem.Route{Required: true})(h))
	mux.Handle("POST /opt", m.Route(idem.Route{})(h))
	srv := httptest.NewServer(mux)
	defer srv.Close()

	if st, _ := post(t, srv.URL+"/req", "k-final", `{"n":1,"mode":"final"}`); st != 422 {
		t.Fatalf("final: %d", st)
	}
	if n := count(t, pool, `SELECT count(*) FROM river_job`); n != 0 {
		t.Fatalf("%d jobs after a final 422 from the handler, want 0", n)
	}
	if st, rp := post(t, srv.URL+"/req", "k-final", `{"n":1,"mode":"final"}`); st != 422 || rp != "true" {
		t.Fatalf("replay of final: %d %q", st, rp)
	}
	if st, _ := post(t, srv.URL+"/req", "k-ok", `{"n":2}`); st != 201 {
		t.Fatal(st)
	}
	if st, _ := post(t, srv.URL+"/req", "k-ok", `{"n":3}`); st != 422 {
		t.Fatalf("reuse with other body: %d", st)
	}
	// A repeat while the first runs.
	done := make(chan int, 1)
	go func() { st, _ := post(t, srv.URL+"/req", "k-hold", `{"n":4,"mode":"hold"}`); done <- st }()
	<-entered
	if st, _ := post(t, srv.URL+"/req", "k-hold", `{"n":4,"mode":"hold"}`); st != 409 {
		t.Fatalf("a repeat while the first runs: %d", st)
	}
	close(hold)
	if st := <-done; st != 201 {
		t.Fatalf("the held first: %d", st)
	}
	if n := count(t, pool, `SELECT count(*) FROM river_job`); n != 2 {
		t.Fatalf("%d jobs, want 2 (k-ok and k-hold)", n)
	}
	// Unkeyed on an optional route.
	req, _ := http.NewRequest(http.MethodPost, srv.URL+"/opt", strings.NewReader(`{"n":5}`))
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	mu.Lock()
	last := insErr[len(insErr)-1]
	mu.Unlock()
	t.Logf("unkeyed request: status %d, Insert's error %v, jobs %d", resp.StatusCode, last,
		count(t, pool, `SELECT count(*) FROM river_job WHERE args->>'order' = '5'`))
}

// TestClaimOfInsideWork: ClaimOf is false on a plain context, and gives the claim inside Work's
// fn, without the middleware too (a Work nested in it finds the claim held).
func TestClaimOfInsideWork(t *testing.T) {
	pool := newPool(t)
	client := newClient(t, pool, nil)
	job := jobRow(t, client, ReceiptArgs{Order: 6})
	if _, ok := idemriver.ClaimOf(context.Background()); ok {
		t.Fatal("ClaimOf on a plain context")
	}
	var inWork idem.LeaseClaim
	var ok bool
	var given idem.LeaseClaim
	if err := idemriver.Work(context.Background(), job, idemriver.Options{DB: pool, Lease: time.Second}, func(ctx context.Context, c idem.LeaseClaim) error {
		given = c
		inWork, ok = idemriver.ClaimOf(ctx)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if !ok || inWork != given {
		t.Fatalf("ClaimOf inside Work's fn: %+v %v; want the claim fn was given, %+v", inWork, ok, given)
	}
}

// TestHostileInputs: huge args, keys of 300 characters or non-ASCII, zero and negative
// durations.
func TestHostileInputs(t *testing.T) {
	ctx := context.Background()
	pool := newPool(t)
	client := newClient(t, pool, nil)
	run := func(job *rivertype.JobRow, o idemriver.Options) (int, error) {
		o.DB = pool
		n := 0
		err := idemriver.Work(ctx, job, o, func(context.Context, idem.LeaseClaim) error { n++; return nil })
		return n, err
	}
	isCancel := func(err error) bool { var c *river.JobCancelError; return errors.As(err, &c) }

	// Huge args: 4 MB.
	type bigArgs struct {
		ReceiptArgs
		Blob string `json:"blob"`
	}
	big := jobRow(t, client, ReceiptArgs{Order: 7})
	blob, _ := json.Marshal(bigArgs{ReceiptArgs{7}, strings.Repeat("x", 4<<20)})
	big.EncodedArgs = blob
	start := time.Now()
	if n, err := run(big, idemriver.Options{Lease: 2 * time.Second}); err != nil || n != 1 {
		t.Errorf("4 MB args: %v, ran %d", err, n)
	}
	t.Logf("4 MB args took %s", time.Since(start))
	if n, err := run(big, idemriver.Options{Lease: 2 * time.Second}); err != nil || n != 0 {
		t.Errorf("4 MB args again: %v, ran %d", err, n)
	}

	// Key of 300 characters and non-ASCII: a cancel, fn never run.
	for _, k := range []string{strings.Repeat("k", 300), "clé/1", ""} {
		j := jobRow(t, client, ReceiptArgs{Order: 8})
		n, err := run(j, idemriver.Options{Lease: time.Second, Key: func(*rivertype.JobRow) string { return k }})
		if !isCancel(err) || !errors.Is(err, idem.ErrInvalidArgument) || n != 0 {
			t.Errorf("key %.20q: %v, ran %d", k, err, n)
		}
	}
	// Principal of 300 characters.
	j := jobRow(t, client, ReceiptArgs{Order: 9})
	if n, err := run(j, idemriver.Options{Lease: time.Second, PrincipalOf: func(*rivertype.JobRow) string { return strings.Repeat("p", 300) }}); !isCancel(err) || n != 0 {
		t.Errorf("principal of 300: %v, ran %d", err, n)
	}
	// Zero and negative durations: defaults, run.
	for _, o := range []idemriver.Options{{Lease: -time.Second}, {TTL: -time.Hour, Snooze: -1, Timeout: -1}} {
		j := jobRow(t, client, ReceiptArgs{Order: 10})
		if n, err := run(j, o); err != nil || n != 1 {
			t.Errorf("options %+v: %v, ran %d", o, err, n)
		}
	}
	j = jobRow(t, client, ReceiptArgs{Order: 11})
	n, err := run(j, idemriver.Options{Lease: time.Second, LockTimeout: -time.Second})
	if !isCancel(err) || !errors.Is(err, idem.ErrInvalidArgument) || n != 0 {
		t.Errorf("negative LockTimeout: %v, ran %d; want a cancel of ErrInvalidArgument", err, n)
	}
	j = jobRow(t, client, ReceiptArgs{Order: 12})
	n, err = run(j, idemriver.Options{Lease: time.Second, TTL: 200 * 365 * 24 * time.Hour})
	if !isCancel(err) || !errors.Is(err, idem.ErrInvalidArgument) || n != 0 {
		t.Errorf("TTL 200 years: %v, ran %d; want a cancel of ErrInvalidArgument", err, n)
	}
}

var smallPoolConns int32 = 4

// TestLeaseLostLateResultWorkUnderTimeout: Work called in the worker, so its context carries
// River's job timeout (300 ms); the worker hangs, ignoring it. Its heartbeat stops, the lease
// runs out, and another run of the row (a rescue elsewhere) takes the key over and stores its
// result. When the hung worker returns nil, its late result is fenced: River records an error
// for that attempt, and its retry completes without running the worker again.
func TestLeaseLostLateResultWorkUnderTimeout(t *testing.T) {
	ctx := context.Background()
	pool := newPool(t)
	p := newProvider()
	opts := idemriver.Options{DB: pool, Lease: time.Second, Snooze: 100 * time.Millisecond}
	started, release := make(chan struct{}), make(chan struct{})
	var runs atomic.Int32
	workers := river.NewWorkers()
	river.AddWorker(workers, river.WorkFunc(func(ctx context.Context, job *river.Job[ReceiptArgs]) error {
		return idemriver.Work(ctx, job.JobRow, opts, func(ctx context.Context, claim idem.LeaseClaim) error {
			p.send(claim.ProviderKey)
			if runs.Add(1) == 1 {
				close(started)
				<-release // hung
			}
			return nil
		})
	}))
	client := startedClient(t, pool, workers, 1, func(c *river.Config) { c.JobTimeout = 300 * time.Millisecond })
	res, err := client.Insert(ctx, ReceiptArgs{Order: 20}, nil)
	if err != nil {
		t.Fatal(err)
	}
	<-started
	row := *res.Job
	row.Attempt, row.AttemptedBy = 2, []string{"c1", "c2"}
	var rescueKey string
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		err := idemriver.Work(ctx, &row, opts, func(_ context.Context, c idem.LeaseClaim) error {
			rescueKey = c.ProviderKey
			p.send(c.ProviderKey)
			return nil
		})
		if err == nil {
			break
		}
		var snooze *river.JobSnoozeError
		if !errors.As(err, &snooze) || time.Now().After(deadline) {
			t.Fatalf("the rescue: %v", err)
		}
	}
	close(release)
	if s := waitState(t, pool, res.Job.ID, "completed", 20*time.Second); s != "completed" {
		t.Fatalf("state %s", s)
	}
	var errs string
	var attempt int
	if err := pool.QueryRow(ctx, `SELECT coalesce(errors::text, ''), attempt FROM river_job WHERE id = $1`, res.Job.ID).Scan(&errs, &attempt); err != nil {
		t.Fatal(err)
	}
	t.Logf("River recorded: attempt %d, errors %s", attempt, errs)
	effects, calls := p.figures()
	if effects != 1 || len(calls) != 1 || calls[rescueKey] != 2 || runs.Load() != 1 {
		t.Fatalf("effects %d calls %v runs %d", effects, calls, runs.Load())
	}
	if !strings.Contains(errs, "lease") {
		t.Fatalf("River's record of the fenced late result: %s; want the lost lease named", errs)
	}
}

// cancelWorker blocks until its context ends on its first run, snoozes itself on its second,
// and succeeds on its third; it records its provider keys.
type cancelWorker struct {
	river.WorkerDefaults[ReceiptArgs]
	started chan struct{}
	runs    atomic.Int32
	mu      sync.Mutex
	keys    []string
}

func (w *cancelWorker) Work(ctx context.Context, job *river.Job[ReceiptArgs]) error {
	claim, _ := idemriver.ClaimOf(ctx)
	w.mu.Lock()
	w.keys = append(w.keys, claim.ProviderKey)
	w.mu.Unlock()
	switch w.runs.Add(1) {
	case 1:
		close(w.started)
		<-ctx.Done()
		return context.Cause(ctx)
	case 2:
		return river.JobSnooze(50 * time.Millisecond)
	}
	return nil
}

// TestRemoteCancelThenRetry: client.JobCancel of a running job: River records it cancelled,
// nothing stored under the key; an operator's JobRetry later runs it with the same provider
// key; a snooze of the worker's own is a snooze (no attempt spent), again with the same key.
func TestRemoteCancelThenRetry(t *testing.T) {
	ctx := context.Background()
	pool := newPool(t)
	w := &cancelWorker{started: make(chan struct{})}
	workers := river.NewWorkers()
	river.AddWorker(workers, w)
	client := startedClient(t, pool, workers, 1, func(c *river.Config) {
		c.Middleware = []rivertype.Middleware{idemriver.Middleware(idemriver.Options{DB: pool, Lease: 2 * time.Second})}
	})
	res, err := client.Insert(ctx, ReceiptArgs{Order: 21}, nil)
	if err != nil {
		t.Fatal(err)
	}
	<-w.started
	if _, err := client.JobCancel(ctx, res.Job.ID); err != nil {
		t.Fatal(err)
	}
	if s := waitState(t, pool, res.Job.ID, "cancelled", 10*time.Second); s != "cancelled" {
		t.Fatalf("state %s", s)
	}
	if n := count(t, pool, `SELECT count(*) FROM idem.idempotency_keys WHERE key = $1 AND state = 'c'`, idemriver.KeyOf(res.Job)); n != 0 {
		t.Fatal("a cancelled run stored a result")
	}
	if _, err := client.JobRetry(ctx, res.Job.ID); err != nil {
		t.Fatal(err)
	}
	if s := waitState(t, pool, res.Job.ID, "completed", 10*time.Second); s != "completed" {
		t.Fatalf("state after retry %s", s)
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if len(w.keys) != 3 || w.keys[0] != w.keys[1] || w.keys[1] != w.keys[2] {
		t.Fatalf("provider keys %q, want one for the three runs", w.keys)
	}
}

// TestMiddlewareHungPastJobTimeout: under the middleware, River applies the job timeout inside
// the middleware chain (around the worker's Work only), so the lease's context and its heartbeat
// did not end at the job timeout: a worker hung past it kept the key, extended, until
// Options.Timeout (5 minutes by default), and every rescue meanwhile was snoozed. This is now
// documented, with its remedy: Options.Timeout set to the job timeout. With it the hung worker's
// key is taken over about one lease after the timeout, as with Work
// (TestLeaseLostLateResultWorkUnderTimeout).
func TestMiddlewareHungPastJobTimeout(t *testing.T) {
	ctx := context.Background()
	pool := newPool(t)
	p := newProvider()
	w := &hangWorker{p: p, started: make(chan struct{}), release: make(chan struct{})}
	defer close(w.release)
	workers := river.NewWorkers()
	river.AddWorker(workers, w)
	opts := idemriver.Options{DB: pool, Lease: time.Second, Snooze: 100 * time.Millisecond, Timeout: 300 * time.Millisecond}
	client := startedClient(t, pool, workers, 1, func(c *river.Config) {
		c.JobTimeout = 300 * time.Millisecond
		c.Middleware = []rivertype.Middleware{idemriver.Middleware(opts)}
	})
	res, err := client.Insert(ctx, ReceiptArgs{Order: 30}, nil)
	if err != nil {
		t.Fatal(err)
	}
	<-w.started
	began := time.Now()
	row := *res.Job
	row.Attempt, row.AttemptedBy = 2, []string{"c1", "c2"}
	snoozes := 0
	// The job timeout (0.3 s) plus a lease (1 s), plus slack for the last extension: 4 s.
	for deadline := time.Now().Add(4 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		err := idemriver.Work(ctx, &row, opts, func(context.Context, idem.LeaseClaim) error { return nil })
		if err == nil {
			return // taken over, as the table says
		}
		var snooze *river.JobSnoozeError
		if !errors.As(err, &snooze) {
			t.Fatalf("the rescue: %v", err)
		}
		snoozes++
		if time.Now().After(deadline) {
			var leaseEnd time.Time
			_ = pool.QueryRow(ctx, `SELECT lease_expires_at FROM idem.idempotency_keys WHERE key = $1`, idemriver.KeyOf(res.Job)).Scan(&leaseEnd)
			t.Fatalf("a worker hung %s past River's job timeout of 300 ms under the middleware (Lease 1 s) still holds the key: "+
				"%d rescues snoozed, lease extended to %s from now; want it taken over one lease after the timeout",
				time.Since(began).Round(100*time.Millisecond), snoozes, time.Until(leaseEnd).Round(100*time.Millisecond))
		}
	}
}

// TestMiddlewarePanicsOnOptionsNoJobCanRunWith: Middleware, like idem's Route, panics at
// construction on options with which Work would cancel or fail every job (D224, D243: no DB, a
// principal the SQL API refuses), and takes the defaults' edges.
func TestMiddlewarePanicsOnOptionsNoJobCanRunWith(t *testing.T) {
	t.Parallel()
	// never connected: pgxpool connects on first use
	db, err := pgxpool.New(context.Background(), "postgres://nobody@127.0.0.1:1/none")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(db.Close)
	for _, c := range []struct {
		o    idemriver.Options
		want string
	}{
		{idemriver.Options{DB: db, Lease: 500 * time.Millisecond}, "Options.Lease"},
		{idemriver.Options{DB: db, LockTimeout: -time.Second}, "Options.LockTimeout"},
		{idemriver.Options{DB: db, TTL: 11 * 365 * 24 * time.Hour}, "Options.TTL"},
		{idemriver.Options{DB: db, Lease: idem.MaxDuration + time.Hour}, "Options.Lease"},
		{idemriver.Options{}, "Options.DB"},
		{idemriver.Options{DB: db, Principal: strings.Repeat("é", 256)}, "Options.Principal"},
		{idemriver.Options{DB: db, Principal: "a\x00b"}, "Options.Principal"},
		{idemriver.Options{DB: db, Principal: "a\xffb"}, "Options.Principal"},
	} {
		func() {
			defer func() {
				if p := recover(); p == nil || !strings.Contains(fmt.Sprint(p), "idemriver: "+c.want) {
					t.Errorf("Middleware(%+v): recovered %v; want a panic naming %s", c.o, p, c.want)
				}
			}()
			idemriver.Middleware(c.o)
		}()
	}
	for _, o := range []idemriver.Options{{DB: db}, {DB: db, Lease: -time.Second, TTL: -time.Hour, Snooze: -1, Timeout: -1},
		{DB: db, Lease: time.Second, TTL: idem.MaxDuration, LockTimeout: idem.MaxLockTimeout},
		{DB: db, Principal: strings.Repeat("é", 255)},
		// a Principal that PrincipalOf replaces for every job is never sent
		{DB: db, Principal: "a\x00b", PrincipalOf: func(*rivertype.JobRow) string { return "tenant" }}} {
		if idemriver.Middleware(o) == nil {
			t.Errorf("Middleware(%+v) is nil", o)
		}
	}
}

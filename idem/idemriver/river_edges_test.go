package idemriver_test

// idemriver under River's real client: completion lost after the idem answer, two jobs under
// one key at once, StopAndCancel, errors of fn that wrap idem's, jobs enqueued in transactions
// that roll back, a panic, the application role, a lease whose extensions are blocked.

import (
	"context"
	"errors"
	"fmt"
	"strconv"
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
	"github.com/pgidem/pgidem/idem/idemtest"
)

// edgeJob reads a job's state, attempt, number of errors and snoozes.
func edgeJob(t *testing.T, pool *pgxpool.Pool, id int64) (state string, attempt, errs, snoozes int) {
	t.Helper()
	if err := pool.QueryRow(context.Background(), `SELECT state::text, attempt, coalesce(array_length(errors, 1), 0),
		coalesce((metadata->>'snoozes')::int, 0) FROM river_job WHERE id = $1`, id).Scan(&state, &attempt, &errs, &snoozes); err != nil {
		t.Fatal(err)
	}
	return
}

// edgeWorker calls idemriver.Work itself; calls counts the worker's runs (River's), fnRuns the
// runs of fn (the outside work), keys the provider keys fn saw.
type edgeWorker struct {
	river.WorkerDefaults[ReceiptArgs]
	opts   idemriver.Options
	calls  atomic.Int32
	fnRuns atomic.Int32
	mu     sync.Mutex
	keys   []string
	during func(ctx context.Context) error // run inside fn; nil: nothing
	last   atomic.Value                    // the last error Work returned
}

func (w *edgeWorker) Work(ctx context.Context, job *river.Job[ReceiptArgs]) error {
	w.calls.Add(1)
	err := idemriver.Work(ctx, job.JobRow, w.opts, func(ctx context.Context, claim idem.LeaseClaim) error {
		w.fnRuns.Add(1)
		w.mu.Lock()
		w.keys = append(w.keys, claim.ProviderKey)
		w.mu.Unlock()
		if w.during != nil {
			return w.during(ctx)
		}
		return nil
	})
	w.last.Store(fmt.Sprint(err))
	return err
}

// TestRiverCompletionLostAfterTheAnswerReplays: fn succeeded and its result was stored with
// the key, but River's own completion of the job failed (the database refused River's UPDATE;
// the client then stopped, as a process that dies). River's rescuer (a new client, leader)
// finds the job stuck and retries it: the retry must complete the job without running fn
// again ("an earlier run of the job succeeded and was stored but River did not learn of it (the
// worker died after the work): the job completes").
func TestRiverCompletionLostAfterTheAnswerReplays(t *testing.T) {
	ctx := context.Background()
	pool := newPool(t)
	// River's completion of the job's first attempt is refused; every other update passes.
	pgExec(t, pool, `CREATE FUNCTION refuse_completion() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			IF NEW.state = 'completed' AND NEW.attempt = 1 THEN
				RAISE EXCEPTION 'completion refused';
			END IF;
			RETURN NEW;
		END $$;
		CREATE TRIGGER refuse_completion BEFORE UPDATE ON river_job FOR EACH ROW EXECUTE FUNCTION refuse_completion()`)
	w := &edgeWorker{opts: idemriver.Options{DB: pool, Lease: 2 * time.Second}}
	workers := river.NewWorkers()
	river.AddWorker(workers, w)
	fast := func(c *river.Config) { c.JobTimeout = time.Second; c.RescueStuckJobsAfter = 2 * time.Second }
	c1, err := river.NewClient(riverpgxv5.New(pool), &river.Config{Logger: quietLog, Workers: workers, RetryPolicy: fastRetry{},
		FetchCooldown: 5 * time.Millisecond, FetchPollInterval: 50 * time.Millisecond, JobTimeout: time.Second,
		RescueStuckJobsAfter: 2 * time.Second, Queues: map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: 2}}})
	if err != nil {
		t.Fatal(err)
	}
	if err := c1.Start(ctx); err != nil {
		t.Fatal(err)
	}
	res, err := c1.Insert(ctx, ReceiptArgs{Order: 1}, nil)
	if err != nil {
		t.Fatal(err)
	}
	key := idemriver.KeyOf(res.Job)
	waitFor(t, pool, `SELECT count(*) FROM idem.idempotency_keys WHERE principal_id = 'river' AND key = $1 AND state = 'c'`, key)
	time.Sleep(500 * time.Millisecond) // River tries its completion, and is refused
	if state, _, _, _ := edgeJob(t, pool, res.Job.ID); state != "running" {
		t.Fatalf("the job is %s after its completion was refused, want running", state)
	}
	sctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	_ = c1.StopAndCancel(sctx) // the process goes away; its completion never lands (attempt 1 is refused)
	cancel()
	time.Sleep(2 * time.Second) // past RescueStuckJobsAfter
	startedClient(t, pool, workers, 4, fast)
	var state string
	for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		state, _, _, _ = edgeJob(t, pool, res.Job.ID)
		if state == "completed" || state == "discarded" || state == "cancelled" || time.Now().After(deadline) {
			break
		}
	}
	_, attempt, errs, _ := edgeJob(t, pool, res.Job.ID)
	if state != "completed" || w.calls.Load() < 2 || attempt < 2 {
		t.Fatalf("the job after its lost completion: %s, attempt %d, %d errors, worker calls %d (last Work: %v); "+
			"want it rescued, run again and completed", state, attempt, errs, w.calls.Load(), w.last.Load())
	}
	if n := w.fnRuns.Load(); n != 1 {
		t.Fatalf("fn ran %d times; want once: the rescued run finds the stored result", n)
	}
}

// TestRiverTwoJobsOneKeyAtOnce: a Key of the arguments makes two jobs one unit of work.
// Two such jobs with the same arguments run at once on two workers: fn runs once, both jobs
// complete (the second snoozes while the first holds the key, then replays). A third job with
// other arguments under the key is cancelled with ErrMismatch (state cancelled after one
// attempt, not retried).
func TestRiverTwoJobsOneKeyAtOnce(t *testing.T) {
	ctx := context.Background()
	pool := newPool(t)
	started := make(chan struct{})
	var once sync.Once
	w := &edgeWorker{opts: idemriver.Options{DB: pool, Lease: 2 * time.Second, Snooze: 200 * time.Millisecond,
		Key: func(*rivertype.JobRow) string { return "the-order" }}}
	w.during = func(ctx context.Context) error {
		once.Do(func() { close(started) })
		time.Sleep(700 * time.Millisecond)
		return nil
	}
	workers := river.NewWorkers()
	river.AddWorker(workers, w)
	client := startedClient(t, pool, workers, 4, nil)
	res, err := client.InsertMany(ctx, []river.InsertManyParams{{Args: ReceiptArgs{Order: 5}}, {Args: ReceiptArgs{Order: 5}}})
	if err != nil {
		t.Fatal(err)
	}
	<-started
	other, err := client.Insert(ctx, ReceiptArgs{Order: 6}, nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range res {
		if got := waitState(t, pool, r.Job.ID, "completed", 20*time.Second); got != "completed" {
			t.Fatalf("job %d (same args) ended %s, want completed", r.Job.ID, got)
		}
	}
	got := waitState(t, pool, other.Job.ID, "cancelled", 20*time.Second)
	_, attempt, errs, _ := edgeJob(t, pool, other.Job.ID)
	if got != "cancelled" || attempt != 1 || errs != 1 {
		t.Fatalf("the job with other args: %s, attempt %d, %d errors; want cancelled after one attempt", got, attempt, errs)
	}
	var msg string
	if err := pool.QueryRow(ctx, `SELECT errors[1]->>'error' FROM river_job WHERE id = $1`, other.Job.ID).Scan(&msg); err != nil {
		t.Fatal(err)
	}
	if n := w.fnRuns.Load(); n != 1 {
		t.Fatalf("fn ran %d times for two jobs of one key (and one of other args); want 1", n)
	}
	t.Logf("the mismatching job's error: %s", msg)
}

// TestRiverStopAndCancelYieldsAtOnce: a client stopped with StopAndCancel while fn works (fn
// returns its context's error, as it should): the lease is given up at once (fn failed), River
// counts no attempt (a soft stop: fn's error reaches River as it is), and a new client runs the
// job straight away under the same provider key, not a lease later.
func TestRiverStopAndCancelYieldsAtOnce(t *testing.T) {
	ctx := context.Background()
	pool := newPool(t)
	started := make(chan struct{})
	var once sync.Once
	w := &edgeWorker{opts: idemriver.Options{DB: pool, Lease: 30 * time.Second}}
	w.during = func(ctx context.Context) error {
		first := false
		once.Do(func() { first = true; close(started) })
		if first {
			<-ctx.Done()
			return context.Cause(ctx)
		}
		return nil
	}
	workers := river.NewWorkers()
	river.AddWorker(workers, w)
	c1, err := river.NewClient(riverpgxv5.New(pool), &river.Config{Logger: quietLog, Workers: workers, RetryPolicy: fastRetry{},
		FetchCooldown: 5 * time.Millisecond, FetchPollInterval: 50 * time.Millisecond,
		Queues: map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: 2}}})
	if err != nil {
		t.Fatal(err)
	}
	if err := c1.Start(ctx); err != nil {
		t.Fatal(err)
	}
	res, err := c1.Insert(ctx, ReceiptArgs{Order: 4}, nil)
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-started:
	case <-time.After(20 * time.Second):
		t.Fatal("the job never started")
	}
	sctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	if err := c1.StopAndCancel(sctx); err != nil {
		t.Logf("StopAndCancel: %v", err)
	}
	cancel()
	t.Logf("the stopped run's Work returned: %v", w.last.Load())
	began := time.Now()
	startedClient(t, pool, workers, 4, nil)
	got := waitState(t, pool, res.Job.ID, "completed", 25*time.Second)
	took := time.Since(began)
	_, attempt, errs, snoozes := edgeJob(t, pool, res.Job.ID)
	w.mu.Lock()
	keys := append([]string(nil), w.keys...)
	w.mu.Unlock()
	if got != "completed" || len(keys) != 2 || keys[0] != keys[1] {
		t.Fatalf("after StopAndCancel and a new client: %s, provider keys %q; want completed under one key", got, keys)
	}
	if took > 10*time.Second || snoozes != 0 {
		t.Errorf("the new client completed the job after %s and %d snoozes: the stopped run's lease was not given up", took, snoozes)
	}
	if attempt != 1 || errs != 0 {
		t.Errorf("attempt %d, %d errors: the stop spent an attempt (fn's error did not reach River as it is)", attempt, errs)
	}
}

// TestRiverFnErrorWrappingLeaseLostIsFns: Work's doc: "fn's own error goes to River as it is,
// whatever it wraps". fn that fails with an error wrapping idem.ErrLeaseLost (an inner
// idem.DoLease of its own that lost its lease) while this job's lease holds: Work returns fn's
// error as it is, not a report that this job's lease was lost.
func TestRiverFnErrorWrappingLeaseLostIsFns(t *testing.T) {
	ctx := context.Background()
	pool := newPool(t)
	client := newClient(t, pool, nil)
	job := jobRow(t, client, ReceiptArgs{Order: 12})
	opts := idemriver.Options{DB: pool, Lease: 5 * time.Second}
	fnErr := fmt.Errorf("the provider's sub-job: %w", idem.ErrLeaseLost)
	err := idemriver.Work(ctx, job, opts, func(context.Context, idem.LeaseClaim) error { return fnErr })
	if err != fnErr {
		t.Errorf("Work returned %q; want fn's error as it is, %q (this job's lease was not lost)", err, fnErr)
	}
	// The lease was given up at once: a retry runs fn straight away.
	retry := *job
	retry.Attempt = 2
	ran := false
	if err := idemriver.Work(ctx, &retry, opts, func(context.Context, idem.LeaseClaim) error { ran = true; return nil }); err != nil || !ran {
		t.Fatalf("the retry: %v (ran %v), want fn run at once", err, ran)
	}
}

// TestRiverInsertInDoRollsBack: a job inserted with client.InsertTx on idem.Do's
// transaction commits with its unit of work or not at all: fn that fails enqueues nothing; fn
// whose transaction hit a serialization failure and ran again enqueues one job; a replay of the
// key enqueues nothing.
func TestRiverInsertInDoRollsBack(t *testing.T) {
	ctx := context.Background()
	pool := newPool(t)
	client := newClient(t, pool, nil)
	job := idem.Job{Principal: "p", Key: "k-fail", Action: "enqueue"}
	boom := errors.New("boom")
	if _, _, err := idem.Do(ctx, pool, job, idem.TxOptions{}, func(ctx context.Context, tx pgx.Tx) (int64, error) {
		if _, err := client.InsertTx(ctx, tx, ReceiptArgs{Order: 100}, nil); err != nil {
			return 0, err
		}
		return 0, boom
	}); !errors.Is(err, boom) {
		t.Fatalf("Do: %v", err)
	}
	if n := count(t, pool, `SELECT count(*) FROM river_job`); n != 0 {
		t.Fatalf("%d jobs after a unit of work that failed, want 0", n)
	}
	job.Key = "k-retry"
	tries := 0
	for i := 0; i < 2; i++ {
		id, replayed, err := idem.Do(ctx, pool, job, idem.TxOptions{}, func(ctx context.Context, tx pgx.Tx) (int64, error) {
			tries++
			res, err := client.InsertTx(ctx, tx, ReceiptArgs{Order: 101}, nil)
			if err != nil {
				return 0, err
			}
			if tries == 1 {
				_, err := tx.Exec(ctx, `DO $$ BEGIN RAISE EXCEPTION 'serialization' USING ERRCODE = '40001'; END $$`)
				return 0, err
			}
			return res.Job.ID, nil
		})
		if err != nil || replayed != (i == 1) {
			t.Fatalf("Do %d: %v, replayed %v", i+1, err, replayed)
		}
		if n := count(t, pool, `SELECT count(*) FROM river_job WHERE id = $1`, id); n != 1 {
			t.Fatalf("the job %d Do returned is not there", id)
		}
	}
	if n := count(t, pool, `SELECT count(*) FROM river_job WHERE args->>'order' = $1`, strconv.Itoa(101)); n != 1 || tries != 2 {
		t.Fatalf("%d jobs after a serialization failure, a retry and a replay (fn ran %d times); want 1", n, tries)
	}
}

// edgePanicWorker panics in its first run, after the provider took its call.
type edgePanicWorker struct {
	river.WorkerDefaults[ReceiptArgs]
	runs atomic.Int32
	mu   sync.Mutex
	keys []string
}

func (w *edgePanicWorker) Work(ctx context.Context, job *river.Job[ReceiptArgs]) error {
	claim, ok := idemriver.ClaimOf(ctx)
	if !ok {
		return errors.New("no claim")
	}
	w.mu.Lock()
	w.keys = append(w.keys, claim.ProviderKey)
	w.mu.Unlock()
	if w.runs.Add(1) == 1 {
		panic("the worker panics after the provider's call")
	}
	return nil
}

// TestRiverPanicGivesTheKeyUp: a worker under Middleware that panics after the provider's
// call: River recovers the panic and retries; the lease was given up with the panic (DoLease:
// "When fn panics, the heartbeat stops and the claim is given up before the panic goes on"),
// so the retry runs at once (not a lease later, not snoozed) under the same provider key.
func TestRiverPanicGivesTheKeyUp(t *testing.T) {
	pool := newPool(t)
	w := &edgePanicWorker{}
	workers := river.NewWorkers()
	river.AddWorker(workers, w)
	client := startedClient(t, pool, workers, 4, func(c *river.Config) {
		c.Middleware = []rivertype.Middleware{idemriver.Middleware(idemriver.Options{DB: pool, Lease: 30 * time.Second})}
	})
	began := time.Now()
	res, err := client.Insert(context.Background(), ReceiptArgs{Order: 21}, nil)
	if err != nil {
		t.Fatal(err)
	}
	got := waitState(t, pool, res.Job.ID, "completed", 25*time.Second)
	took := time.Since(began)
	_, attempt, errs, snoozes := edgeJob(t, pool, res.Job.ID)
	w.mu.Lock()
	keys := append([]string(nil), w.keys...)
	w.mu.Unlock()
	if got != "completed" || len(keys) != 2 || keys[0] != keys[1] || keys[0] == "" {
		t.Fatalf("a job whose first run panicked: %s, provider keys %q; want completed under one key", got, keys)
	}
	if took > 10*time.Second || snoozes != 0 || attempt != 2 || errs != 1 {
		t.Fatalf("completed after %s, %d snoozes, attempt %d, %d errors; want the retry at once (attempt 2, no snooze)",
			took, snoozes, attempt, errs)
	}
}

// TestRiverAsIdemApp: Work on a pool of a login role that is only a member of idem_app (the
// service's role): a locked key table snoozes (at most 5 s, fn not run), a failed run's retry
// runs at once under the same provider key, a completed job's later run replays without
// running fn, and another job's arguments under a shared key are cancelled with ErrMismatch.
func TestRiverAsIdemApp(t *testing.T) {
	ctx := context.Background()
	owner := newPool(t)
	app := idemtest.AppPool(t, owner)
	client := newClient(t, owner, nil)
	opts := idemriver.Options{DB: app, Lease: time.Minute}
	var keys []string
	runs := 0
	job := jobRow(t, client, ReceiptArgs{Order: 31})

	locker, err := owner.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := locker.Exec(ctx, `LOCK TABLE idem.idempotency_keys IN ACCESS EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	err = idemriver.Work(ctx, job, opts, func(context.Context, idem.LeaseClaim) error { runs++; return nil })
	_ = locker.Rollback(ctx)
	var snooze *river.JobSnoozeError
	if !errors.As(err, &snooze) || snooze.Duration > 5*time.Second || runs != 0 {
		t.Fatalf("idem_app under a locked key table: %v (runs %d), want a snooze of at most 5 s", err, runs)
	}

	boom := errors.New("boom")
	for i, want := range []error{boom, nil} {
		retry := *job
		retry.Attempt = i + 1
		err := idemriver.Work(ctx, &retry, opts, func(_ context.Context, c idem.LeaseClaim) error {
			runs++
			keys = append(keys, c.ProviderKey)
			return want
		})
		if !errors.Is(err, want) || (want == nil && err != nil) {
			t.Fatalf("idem_app run %d: %v, want %v", i+1, err, want)
		}
	}
	if len(keys) != 2 || keys[0] != keys[1] {
		t.Fatalf("idem_app: provider keys of a failed run and its retry %q, want one", keys)
	}
	later := *job
	later.Attempt = 3
	if err := idemriver.Work(ctx, &later, opts, func(context.Context, idem.LeaseClaim) error { runs++; return nil }); err != nil || runs != 2 {
		t.Fatalf("idem_app: a run after the result was stored: %v, runs %d; want nil without running", err, runs)
	}
	shared := opts
	shared.Key = func(*rivertype.JobRow) string { return "shared" }
	if err := idemriver.Work(ctx, jobRow(t, client, ReceiptArgs{Order: 40}), shared, func(context.Context, idem.LeaseClaim) error { return nil }); err != nil {
		t.Fatal(err)
	}
	err = idemriver.Work(ctx, jobRow(t, client, ReceiptArgs{Order: 41}), shared, func(context.Context, idem.LeaseClaim) error { runs++; return nil })
	var cancel *river.JobCancelError
	if !errors.As(err, &cancel) || !errors.Is(err, idem.ErrMismatch) || runs != 2 {
		t.Fatalf("idem_app: other arguments under a shared key: %v (runs %d), want a cancel with ErrMismatch", err, runs)
	}
}

// TestRiverExtensionBlockedNoTakeoverStores: the key's row is locked by another session (a
// maintenance query, FOR UPDATE) past the whole lease while fn works: no extension lands, the
// lease is lost by the worker's clock (fn's context ends with ErrLeaseLost), but no other run
// takes the key over. fn still returns nil: "when fn returned nil, no other run had taken the
// key over and the key had not expired ..., the result is stored all the same and the job
// completes". A later run of the job then replays without running fn.
func TestRiverExtensionBlockedNoTakeoverStores(t *testing.T) {
	ctx := context.Background()
	pool := newPool(t)
	client := newClient(t, pool, nil)
	job := jobRow(t, client, ReceiptArgs{Order: 51})
	key := idemriver.KeyOf(job)
	opts := idemriver.Options{DB: pool, Lease: time.Second}
	locker, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	released := make(chan struct{})
	var releasing atomic.Bool
	defer func() {
		if releasing.Load() {
			<-released // fn's goroutine rolls the lock back
			return
		}
		_ = locker.Rollback(ctx)
	}()
	runs := 0
	var cause error
	err = idemriver.Work(ctx, job, opts, func(ctx context.Context, _ idem.LeaseClaim) error {
		runs++
		if _, err := locker.Exec(ctx, `SELECT 1 FROM idem.idempotency_keys WHERE principal_id = 'river' AND key = $1 FOR UPDATE`, key); err != nil {
			return err
		}
		<-ctx.Done() // the lease is lost: no extension can land
		cause = context.Cause(ctx)
		releasing.Store(true)
		go func() {
			time.Sleep(300 * time.Millisecond)
			_ = locker.Rollback(context.Background())
			close(released)
		}()
		return nil // the work was done all the same
	})
	if !errors.Is(cause, idem.ErrLeaseLost) {
		t.Fatalf("fn's context ended with %v, want ErrLeaseLost", cause)
	}
	if err != nil {
		t.Fatalf("Work after a lost lease that no other run took over: %v; want nil (the result stored)", err)
	}
	if n := count(t, pool, `SELECT count(*) FROM idem.idempotency_keys WHERE principal_id = 'river' AND key = $1 AND state = 'c'`, key); n != 1 {
		t.Fatal("the key is not completed")
	}
	later := *job
	later.Attempt = 2
	if err := idemriver.Work(ctx, &later, opts, func(context.Context, idem.LeaseClaim) error { runs++; return nil }); err != nil || runs != 1 {
		t.Fatalf("a later run: %v, runs %d; want the stored result", err, runs)
	}
}

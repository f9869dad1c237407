package idemriver_test

// A review of small pools (these held when written): idemriver.Work and idem.DoLease on a
// small pool shared with River, on a role whose server-side timeouts (statement_timeout,
// idle_in_transaction_session_timeout) are set, with the key's row locked by other sessions.

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/idem/idemriver"
)

// smallPoolWith is a pool of n connections to big's database, with these runtime parameters
// (as a DBA's ALTER ROLE ... SET would give every session), closed when the test ends.
func smallPoolWith(t *testing.T, big *pgxpool.Pool, n int32, params map[string]string) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(big.Config().ConnString())
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = n
	for k, v := range params {
		cfg.ConnConfig.RuntimeParams[k] = v
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// TestRecordingThroughRowLockUnderStatementTimeout: the role has
// statement_timeout = 1s; when fn returns, another session holds the key's row FOR UPDATE for
// 2.5 s (less than the lease). go doc idem.DoLease: "The result is recorded through failures
// that pass (a lock timeout on the key's row, a broken connection) until the lease's
// AnswerDeadline". So Work returns nil and the key is completed, once.
func TestRecordingThroughRowLockUnderStatementTimeout(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	big := newPool(t)
	pool := smallPoolWith(t, big, 2, map[string]string{"statement_timeout": "1000"})
	client := newClient(t, big, nil)
	job := jobRow(t, client, ReceiptArgs{Order: 7001})
	key := idemriver.KeyOf(job)
	locker, err := big.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var released atomic.Bool
	gone := make(chan struct{})
	defer func() {
		if released.Load() {
			<-gone
			return
		}
		_ = locker.Rollback(ctx)
	}()
	started := time.Now()
	err = idemriver.Work(ctx, job, idemriver.Options{DB: pool, Lease: 5 * time.Second}, func(ctx context.Context, _ idem.LeaseClaim) error {
		if _, err := locker.Exec(ctx, `SELECT 1 FROM idem.idempotency_keys WHERE principal_id = 'river' AND key = $1 FOR UPDATE`, key); err != nil {
			return err
		}
		released.Store(true)
		go func() {
			time.Sleep(2500 * time.Millisecond)
			_ = locker.Rollback(context.Background())
			close(gone)
		}()
		return nil
	})
	t.Logf("Work: %v after %s", err, time.Since(started))
	if err != nil {
		t.Fatalf("Work: %v; want nil (the result recorded once the row lock goes, within the lease)", err)
	}
	if n := count(t, big, `SELECT count(*) FROM idem.idempotency_keys WHERE principal_id = 'river' AND key = $1 AND state = 'c'`, key); n != 1 {
		t.Fatal("the key is not completed")
	}
}

// sameKeyWorker runs under Middleware with a key shared by all its jobs.
type sameKeyWorker struct {
	river.WorkerDefaults[ReceiptArgs]
	runs   atomic.Int32
	active atomic.Int32
	over   atomic.Int32
	d      time.Duration
}

func (w *sameKeyWorker) Work(ctx context.Context, job *river.Job[ReceiptArgs]) error {
	w.runs.Add(1)
	if w.active.Add(1) > 1 {
		w.over.Add(1)
	}
	defer w.active.Add(-1)
	select {
	case <-time.After(w.d):
	case <-ctx.Done():
		return context.Cause(ctx)
	}
	return nil
}

// TestManyJobsOneKeyOnASharedPoolOfTwo: 8 jobs with one key (Options.Key) and the same
// arguments, River with 4 workers on a pool of 2 connections that it shares with idem: one
// run does the work, the others snooze and then replay its result; all complete, nothing
// deadlocks, the work runs once.
func TestManyJobsOneKeyOnASharedPoolOfTwo(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	big := newPool(t)
	pool := smallPoolWith(t, big, 2, nil)
	w := &sameKeyWorker{d: 1500 * time.Millisecond}
	workers := river.NewWorkers()
	river.AddWorker(workers, w)
	opts := idemriver.Options{DB: pool, Lease: 2 * time.Second, Snooze: 300 * time.Millisecond,
		Key: func(*rivertype.JobRow) string { return "order/1" }}
	client := startedClient(t, pool, workers, 4, func(c *river.Config) {
		c.Middleware = []rivertype.Middleware{idemriver.Middleware(opts)}
	})
	for range 8 {
		if _, err := client.Insert(ctx, ReceiptArgs{Order: 1}, nil); err != nil {
			t.Fatal(err)
		}
	}
	deadline := time.Now().Add(40 * time.Second)
	for count(t, big, `SELECT count(*) FROM river_job WHERE state = 'completed'`) < 8 {
		if time.Now().After(deadline) {
			var states string
			_ = big.QueryRow(ctx, `SELECT string_agg(id || ':' || state || ':' || attempt || ':' || coalesce(errors[array_length(errors,1)]->>'error',''), E'\n') FROM river_job`).Scan(&states)
			t.Fatalf("not all jobs completed; runs %d\n%s", w.runs.Load(), states)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if w.runs.Load() != 1 || w.over.Load() != 0 {
		t.Fatalf("the work ran %d times (%d at once); want once", w.runs.Load(), w.over.Load())
	}
}

// TestStepIdleInTransactionIsNotCommitUnknown: the role has
// idle_in_transaction_session_timeout = 300ms and a step's fn sits idle in its transaction
// longer (a slow call after its first statement): the server ends the session before the
// step's COMMIT. Step returns an error (not ErrCommitUnknown: the COMMIT could not be sent),
// nothing is recorded, Work returns fn's error (River retries), and the retry, which does not
// idle, runs the step once.
func TestStepIdleInTransactionIsNotCommitUnknown(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	big := newPool(t)
	pgExec(t, big, `CREATE TABLE review_effects (s text)`)
	pool := smallPoolWith(t, big, 2, map[string]string{"idle_in_transaction_session_timeout": "300"})
	client := newClient(t, big, nil)
	job := jobRow(t, client, ReceiptArgs{Order: 7002})
	opts := idemriver.Options{DB: pool, Lease: 3 * time.Second}
	run := func(idle time.Duration) (stepErr, workErr error) {
		workErr = idemriver.Work(ctx, job, opts, func(ctx context.Context, _ idem.LeaseClaim) error {
			_, stepErr = idem.Step(ctx, "write", func(ctx context.Context, tx pgx.Tx) (int, error) {
				if _, err := tx.Exec(ctx, `INSERT INTO review_effects VALUES ('x')`); err != nil {
					return 0, err
				}
				time.Sleep(idle)
				return 1, nil
			})
			return stepErr
		})
		return stepErr, workErr
	}
	stepErr, workErr := run(800 * time.Millisecond)
	t.Logf("first run: Work %v; Step %v", workErr, stepErr)
	var snooze *river.JobSnoozeError
	var cancel *river.JobCancelError
	if stepErr == nil || errors.Is(stepErr, idem.ErrCommitUnknown) || workErr != stepErr || errors.As(workErr, &snooze) || errors.As(workErr, &cancel) {
		t.Fatalf("first run: Work %v, Step %v; want fn's error as it is, not ErrCommitUnknown", workErr, stepErr)
	}
	if n := count(t, big, `SELECT count(*) FROM review_effects`); n != 0 {
		t.Fatalf("%d effects after the killed step", n)
	}
	retry := *job
	retry.Attempt = 2
	job = &retry
	if stepErr, workErr := run(0); stepErr != nil || workErr != nil {
		t.Fatalf("the retry: Work %v, Step %v", workErr, stepErr)
	}
	if n := count(t, big, `SELECT count(*) FROM review_effects`); n != 1 {
		t.Fatalf("%d effects, want 1", n)
	}
}

// TestOwnRowLockedShorterThanLeaseUnderStatementTimeout: statement_timeout
// = 1s on the role; another session holds the job's own key row FOR UPDATE for 2.2 s (more
// than two extension intervals, less than the 3 s lease) while fn works 4 s. The cut
// extensions are tried again; one lands once the lock goes; the lease is kept and the result
// stored.
func TestOwnRowLockedShorterThanLeaseUnderStatementTimeout(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	big := newPool(t)
	pool := smallPoolWith(t, big, 2, map[string]string{"statement_timeout": "1000"})
	client := newClient(t, big, nil)
	job := jobRow(t, client, ReceiptArgs{Order: 7003})
	key := idemriver.KeyOf(job)
	locker, err := big.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = locker.Rollback(ctx) }()
	var cause error
	err = idemriver.Work(ctx, job, idemriver.Options{DB: pool, Lease: 3 * time.Second}, func(ctx context.Context, _ idem.LeaseClaim) error {
		if _, err := locker.Exec(ctx, `SELECT 1 FROM idem.idempotency_keys WHERE principal_id = 'river' AND key = $1 FOR UPDATE`, key); err != nil {
			return err
		}
		select {
		case <-time.After(2200 * time.Millisecond):
		case <-ctx.Done():
			cause = context.Cause(ctx)
			return cause
		}
		if err := locker.Rollback(ctx); err != nil {
			return err
		}
		select {
		case <-time.After(1800 * time.Millisecond):
			return nil
		case <-ctx.Done():
			cause = context.Cause(ctx)
			return cause
		}
	})
	if err != nil || cause != nil {
		t.Fatalf("Work %v, fn's context %v; want the lease kept", err, cause)
	}
	if n := count(t, big, `SELECT count(*) FROM idem.idempotency_keys WHERE principal_id = 'river' AND key = $1 AND state = 'c'`, key); n != 1 {
		t.Fatal("the key is not completed")
	}
}

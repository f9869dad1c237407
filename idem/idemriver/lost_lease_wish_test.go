package idemriver_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/idem/idemriver"
)

// loseLease runs Work with an fn that locks the job's key row from another session (no
// extension lands), waits until its lease is lost, and returns ret(). The row lock is
// released 300 ms after fn returns. It returns fn's context's cause, the claim's provider key
// and Work's error.
func loseLease(t *testing.T, pool *pgxpool.Pool, job *rivertype.JobRow, opts idemriver.Options, ret func() error) (cause error, pk string, err error) {
	t.Helper()
	ctx := context.Background()
	locker, lerr := pool.Begin(ctx)
	if lerr != nil {
		t.Fatal(lerr)
	}
	released := make(chan struct{})
	err = idemriver.Work(ctx, job, opts, func(ctx context.Context, c idem.LeaseClaim) error {
		pk = c.ProviderKey
		if _, err := locker.Exec(ctx, `SELECT 1 FROM idem.idempotency_keys WHERE principal_id = $1 AND key = $2 FOR UPDATE`,
			c.Principal, c.Key); err != nil {
			return err
		}
		<-ctx.Done()
		cause = context.Cause(ctx)
		go func() {
			time.Sleep(300 * time.Millisecond)
			_ = locker.Rollback(context.Background())
			close(released)
		}()
		return ret()
	})
	select {
	case <-released:
	case <-time.After(5 * time.Second):
		_ = locker.Rollback(ctx)
	}
	return cause, pk, err
}

// TestWorkAfterALostLeaseKeepsFnsReasonAndWish: a worker whose lease was lost (its key's row
// locked, no extension landed) and which then returns its own error, a river.JobCancel or a
// river.JobSnooze: Work's error is idem.ErrLeaseLost and wraps fn's, so River records fn's
// reason and still cancels or snoozes the job (D243). The retry runs fn under the same
// provider key.
func TestWorkAfterALostLeaseKeepsFnsReasonAndWish(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	client := newClient(t, pool, nil)
	opts := idemriver.Options{DB: pool, Lease: time.Second}
	declined := errors.New("card permanently declined")
	for i, c := range []struct {
		name   string
		ret    func() error
		cancel bool
		snooze bool
	}{
		{"cancel", func() error { return river.JobCancel(declined) }, true, false},
		{"snooze", func() error { return river.JobSnooze(time.Minute) }, false, true},
		{"plain", func() error { return declined }, false, false},
	} {
		job := jobRow(t, client, ReceiptArgs{Order: int64(700 + i)})
		cause, pk, err := loseLease(t, pool, job, opts, c.ret)
		if !errors.Is(cause, idem.ErrLeaseLost) {
			t.Fatalf("%s: fn's context ended with %v; want the lease lost (the test did not hold the gap open)", c.name, cause)
		}
		var cancelErr *river.JobCancelError
		var snoozeErr *river.JobSnoozeError
		if !errors.Is(err, idem.ErrLeaseLost) || errors.As(err, &cancelErr) != c.cancel || errors.As(err, &snoozeErr) != c.snooze ||
			(!c.snooze && !errors.Is(err, declined)) {
			t.Errorf("%s after the lease was lost: Work returned %T %v; want ErrLeaseLost wrapping fn's own error (cancel %v, snooze %v)",
				c.name, err, err, c.cancel, c.snooze)
		}
		retry := *job
		retry.Attempt = 2
		var ran int
		var pk2 string
		if err := idemriver.Work(ctx, &retry, opts, func(_ context.Context, cl idem.LeaseClaim) error {
			ran++
			pk2 = cl.ProviderKey
			return nil
		}); err != nil || ran != 1 || pk2 != pk {
			t.Errorf("%s: the retry: %v, ran %d, same provider key %v; want one run under the same provider key", c.name, err, ran, pk2 == pk)
		}
	}
}

// lostLeaseWorker: its first run loses its lease (its key's row locked from another session),
// then returns what ret gives; later runs succeed.
type lostLeaseWorker struct {
	river.WorkerDefaults[ReceiptArgs]
	pool *pgxpool.Pool
	ret  func() error
	runs atomic.Int32
}

func (w *lostLeaseWorker) Work(ctx context.Context, job *river.Job[ReceiptArgs]) error {
	if w.runs.Add(1) > 1 {
		return nil
	}
	claim, _ := idemriver.ClaimOf(ctx)
	locker, err := w.pool.Begin(context.Background())
	if err != nil {
		return err
	}
	if _, err := locker.Exec(ctx, `SELECT 1 FROM idem.idempotency_keys WHERE principal_id = $1 AND key = $2 FOR UPDATE`,
		claim.Principal, claim.Key); err != nil {
		_ = locker.Rollback(context.Background())
		return err
	}
	<-ctx.Done()
	go func() { time.Sleep(300 * time.Millisecond); _ = locker.Rollback(context.Background()) }()
	return w.ret()
}

// TestLostLeaseWishUnderRiver: under River with Middleware and MaxAttempts 1, a worker that lost
// its lease and snoozes its job is run again (a snooze spends no attempt), and one that cancels
// its job has it cancelled with its own reason in River's errors. Before D243 both jobs were
// discarded, as an error on their last attempt.
func TestLostLeaseWishUnderRiver(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for _, c := range []struct {
		name, state, reason string
		ret                 func() error
	}{
		{"snooze", "completed", "", func() error { return river.JobSnooze(100 * time.Millisecond) }},
		{"cancel", "cancelled", "card permanently declined", func() error { return river.JobCancel(errors.New("card permanently declined")) }},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			pool := newPool(t)
			w := &lostLeaseWorker{pool: pool, ret: c.ret}
			workers := river.NewWorkers()
			river.AddWorker(workers, w)
			client := startedClient(t, pool, workers, 1, func(cfg *river.Config) {
				cfg.Middleware = []rivertype.Middleware{idemriver.Middleware(idemriver.Options{DB: pool, Lease: time.Second})}
			})
			res, err := client.Insert(ctx, ReceiptArgs{Order: 950}, &river.InsertOpts{MaxAttempts: 1})
			if err != nil {
				t.Fatal(err)
			}
			state := waitState(t, pool, res.Job.ID, c.state, 15*time.Second)
			var errs string
			if err := pool.QueryRow(ctx, `SELECT coalesce(errors::text, '') FROM river_job WHERE id = $1`, res.Job.ID).Scan(&errs); err != nil {
				t.Fatal(err)
			}
			if state != c.state || !strings.Contains(errs, c.reason) || !strings.Contains(errs, "lease lost") && c.reason != "" {
				t.Fatalf("a worker that lost its lease and returned a %s: the job ended %s after %d run(s), River's errors %s; want %s",
					c.name, state, w.runs.Load(), errs, c.state)
			}
		})
	}
}

// TestWorkTakesAPrincipalOfTheLongestLength: the longest Principal Middleware takes (255
// characters, 510 bytes) is one the SQL API takes too.
func TestWorkTakesAPrincipalOfTheLongestLength(t *testing.T) {
	t.Parallel()
	pool := newPool(t)
	client := newClient(t, pool, nil)
	opts := idemriver.Options{DB: pool, Principal: strings.Repeat("é", 255)}
	idemriver.Middleware(opts)
	var ran int
	if err := idemriver.Work(context.Background(), jobRow(t, client, ReceiptArgs{Order: 1}), opts,
		func(context.Context, idem.LeaseClaim) error { ran++; return nil }); err != nil || ran != 1 {
		t.Fatalf("a principal of 255 characters: %v, ran %d; want one run", err, ran)
	}
}

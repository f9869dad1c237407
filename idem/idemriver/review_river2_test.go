package idemriver_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/idem/idemriver"
)

// TestReviewRiverLeaseUnderASecondIsNotRetriedForever (D170): Options.Lease "At least a
// second." A Lease of 500 ms made every run fail before fn with an error that was neither a
// cancel nor idem.ErrInvalidArgument: River retried the job to MaxAttempts (about three weeks
// by default) and discarded it, the work never done. It is river.JobCancel of an error wrapping
// idem.ErrInvalidArgument now, as for a key or principal the SQL API refuses.
func TestReviewRiverLeaseUnderASecondIsNotRetriedForever(t *testing.T) {
	pool := newPool(t)
	client := newClient(t, pool, nil)
	job := jobRow(t, client, ReceiptArgs{Order: 1})
	var ran atomic.Int32
	err := idemriver.Work(context.Background(), job, idemriver.Options{DB: pool, Lease: 500 * time.Millisecond},
		func(context.Context, idem.LeaseClaim) error { ran.Add(1); return nil })
	var cancel *rivertype.JobCancelError
	if ran.Load() == 0 && !(errors.As(err, &cancel) && errors.Is(err, idem.ErrInvalidArgument)) {
		t.Fatalf("Lease 500ms: Work returned %v (fn ran %d); want fn run, or a JobCancel wrapping ErrInvalidArgument", err, ran.Load())
	}
}

// slowArgs is a job whose worker blocks until its context ends.
type slowArgs struct {
	N int `json:"n"`
}

func (slowArgs) Kind() string { return "review_slow" }

type slowWorker struct {
	river.WorkerDefaults[slowArgs]
	p       *provider
	started chan struct{}
	runs    atomic.Int32
}

func (w *slowWorker) Work(ctx context.Context, job *river.Job[slowArgs]) error {
	claim, ok := idemriver.ClaimOf(ctx)
	if !ok {
		return errors.New("no claim")
	}
	w.p.send(claim.ProviderKey)
	if w.runs.Add(1) == 1 {
		close(w.started)
		<-ctx.Done() // shut down in the middle of the work
		return context.Cause(ctx)
	}
	return nil
}

// TestReviewRiverStopAndCancelThenAnotherClient: a River client stopped with StopAndCancel while its
// job works (the worker's context cancelled); another client then runs the job. One effect
// at the provider, under one provider key, and the job completes.
func TestReviewRiverStopAndCancelThenAnotherClient(t *testing.T) {
	pool := newPool(t)
	p := newProvider()
	w := &slowWorker{p: p, started: make(chan struct{})}
	workers := river.NewWorkers()
	river.AddWorker(workers, w)
	mw := idemriver.Middleware(idemriver.Options{DB: pool, Lease: 2 * time.Second})
	c1 := newClient(t, pool, workers, mw)
	if _, err := c1.Insert(context.Background(), slowArgs{N: 1}, nil); err != nil {
		t.Fatal(err)
	}
	select {
	case <-w.started:
	case <-time.After(30 * time.Second):
		t.Fatal("the job never started")
	}
	sctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	_ = c1.StopAndCancel(sctx)
	cancel()
	_ = newClient(t, pool, workers, mw)
	waitFor(t, pool, `SELECT count(*) FROM river_job WHERE state = 'completed'`)
	effects, calls := p.figures()
	if effects != 1 || len(calls) != 1 {
		t.Fatalf("effects %d, calls %v; want one effect under one provider key", effects, calls)
	}
}

package idem_test

// Review of Do's contexts and concurrency.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// holdKey claims job's key (Do's claim, by hand) in a transaction of another "process" and
// keeps it open until release is called; the claim is then rolled back.
func holdKey(t *testing.T, url string, job idem.Job) (release func()) {
	t.Helper()
	var in []byte
	if job.Input != nil {
		in, _ = json.Marshal(job.Input)
	}
	fp := idem.ComputeFingerprint("DO", job.Action, in)
	c := idem.Claim{Principal: job.Principal, Key: job.Key, Action: job.Action, Fingerprint: fp.Sum, Fields: fp.Fields}
	conn := pgtest.Connect(t, url)
	tx, err := conn.Begin(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	d, err := idem.Begin(context.Background(), tx, c)
	if err != nil || d.Outcome != idem.Claimed {
		t.Fatalf("hold: %v %v", d.Outcome, err)
	}
	return func() { _ = tx.Rollback(context.Background()) }
}

func TestDoContexts(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, url := pgtest.NewPool(t, 4)
	count := effectCounter(t, pool)
	// The first Do on the pool checks the schema: done here, so that the cases below are not
	// that check.
	if _, _, err := idem.Do(ctx, pool, idem.Job{Principal: "p", Key: "warm", Action: "a"}, idem.TxOptions{},
		func(context.Context, pgx.Tx) (int, error) { return 0, nil }); err != nil {
		t.Fatal(err)
	}

	t.Run("canceled before", func(t *testing.T) {
		cctx, cancel := context.WithCancel(ctx)
		cancel()
		var ran bool
		_, _, err := idem.Do(cctx, pool, idem.Job{Principal: "p", Key: "pre", Action: "a"}, idem.TxOptions{},
			func(context.Context, pgx.Tx) (int, error) { ran = true; return 0, nil })
		_, _, errL := idem.DoLease(cctx, pool, idem.Job{Principal: "p", Key: "pre-l", Action: "a", Lease: time.Second},
			func(context.Context, idem.LeaseClaim) (int, error) { ran = true; return 0, nil })
		if ran || !errors.Is(err, context.Canceled) || !errors.Is(errL, context.Canceled) {
			t.Errorf("ran %v; Do %v; DoLease %v", ran, err, errL)
		}
	})

	t.Run("canceled during fn", func(t *testing.T) {
		cctx, cancel := context.WithCancel(ctx)
		job := idem.Job{Principal: "p", Key: "during", Action: "a"}
		v, replayed, err := idem.Do(cctx, pool, job, idem.TxOptions{}, func(ctx context.Context, tx pgx.Tx) (int, error) {
			if err := insertEffect(ctx, tx, "during"); err != nil {
				return 0, err
			}
			cancel()
			return 5, nil // ignores its context
		})
		t.Logf("Do: %d %v %v", v, replayed, err)
		if !errors.Is(err, context.Canceled) || count("during") != 0 {
			t.Errorf("Do %v, effects %d", err, count("during"))
		}
		v, replayed, err = idem.Do(ctx, pool, job, idem.TxOptions{}, func(ctx context.Context, tx pgx.Tx) (int, error) {
			return 6, insertEffect(ctx, tx, "during")
		})
		if err != nil || replayed || v != 6 || count("during") != 1 {
			t.Errorf("the run after: %d %v %v, effects %d", v, replayed, err, count("during"))
		}
	})

	t.Run("deadline shorter than the lock timeout, another process holds the key", func(t *testing.T) {
		job := idem.Job{Principal: "p", Key: "held", Action: "a", LockTimeout: 20 * time.Second}
		release := holdKey(t, url, job)
		defer release()
		dctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
		defer cancel()
		start := time.Now()
		var ran bool
		_, _, err := idem.Do(dctx, pool, job, idem.TxOptions{}, func(context.Context, pgx.Tx) (int, error) { ran = true; return 0, nil })
		took := time.Since(start)
		t.Logf("Do: %v after %s", err, took)
		if ran || took > 2*time.Second || !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("ran %v, err %v after %s", ran, err, took)
		}
		// The connection goes back to the pool once the canceled claim is cleaned up; on a
		// loaded machine (a CI run) that came more than 50 ms after Do returned.
		for deadline := time.Now().Add(5 * time.Second); pool.Stat().AcquiredConns() != 0 && time.Now().Before(deadline); {
			time.Sleep(10 * time.Millisecond)
		}
		if s := pool.Stat(); s.AcquiredConns() != 0 {
			t.Errorf("%d connections still acquired 5 s after Do returned", s.AcquiredConns())
		}
		// DoLease alike.
		ljob := job
		ljob.Key, ljob.Lease = "held-l", 5*time.Second
		release2 := holdKey(t, url, idem.Job{Principal: "p", Key: "held-l", Action: "a"})
		defer release2()
		dctx2, cancel2 := context.WithTimeout(ctx, 300*time.Millisecond)
		defer cancel2()
		start = time.Now()
		_, _, err = idem.DoLease(dctx2, pool, ljob, func(context.Context, idem.LeaseClaim) (int, error) { ran = true; return 0, nil })
		took = time.Since(start)
		t.Logf("DoLease: %v after %s", err, took)
		if ran || took > 2*time.Second || err == nil {
			t.Errorf("DoLease: ran %v, err %v after %s", ran, err, took)
		}
	})

	t.Run("deadline shorter than the lock timeout, this process holds the key", func(t *testing.T) {
		job := idem.Job{Principal: "p", Key: "held-here", Action: "a", LockTimeout: 20 * time.Second}
		inFn, done := make(chan struct{}), make(chan struct{})
		go func() {
			_, _, _ = idem.Do(ctx, pool, job, idem.TxOptions{}, func(context.Context, pgx.Tx) (int, error) {
				close(inFn)
				<-done
				return 1, nil
			})
		}()
		<-inFn
		dctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
		defer cancel()
		start := time.Now()
		_, _, err := idem.Do(dctx, pool, job, idem.TxOptions{}, func(context.Context, pgx.Tx) (int, error) { return 0, nil })
		took := time.Since(start)
		close(done)
		if took > 2*time.Second || !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("err %v after %s", err, took)
		}
	})
}

// TestDoManyGoroutinesOneJob: the same Job from many goroutines: one effect, every caller the
// same result; with the shared Gate, with one Gate each (as separate processes would be), and
// at REPEATABLE READ and SERIALIZABLE.
func TestDoManyGoroutinesOneJob(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, url := pgtest.NewPool(t, 8)
	count := effectCounter(t, pool)
	cases := []struct {
		name  string
		gates bool
		iso   pgx.TxIsoLevel
	}{
		{"shared gate", false, ""},
		{"a gate each", true, ""},
		{"a gate each, repeatable read", true, pgx.RepeatableRead},
		{"a gate each, serializable", true, pgx.Serializable},
	}
	for ci, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			key := fmt.Sprintf("many-%d", ci)
			const n = 12
			pools := []*pgxpool.Pool{pool, reviewPool(t, url, 4), reviewPool(t, url, 4)}
			var wg sync.WaitGroup
			var runs atomic.Int32
			results := make([]int64, n)
			errs := make([]error, n)
			start := make(chan struct{})
			for i := range n {
				wg.Add(1)
				go func() {
					defer wg.Done()
					job := idem.Job{Principal: "p", Key: key, Action: "a", Input: map[string]int{"x": 1}}
					if c.gates {
						job.Gate = idem.NewGate(idem.GateOptions{})
					}
					<-start
					results[i], _, errs[i] = idem.Do(ctx, pools[i%len(pools)], job, idem.TxOptions{TxOptions: pgx.TxOptions{IsoLevel: c.iso}},
						func(ctx context.Context, tx pgx.Tx) (int64, error) {
							runs.Add(1)
							var id int64
							err := tx.QueryRow(ctx, `INSERT INTO rv_effects (k) VALUES ($1) RETURNING id`, key).Scan(&id)
							time.Sleep(50 * time.Millisecond)
							return id, err
						})
				}()
			}
			close(start)
			wg.Wait()
			for i := range n {
				if errs[i] != nil || results[i] != results[0] {
					t.Errorf("caller %d: %d %v (first %d)", i, results[i], errs[i], results[0])
				}
			}
			if count(key) != 1 {
				t.Errorf("%d effects, fn ran %d", count(key), runs.Load())
			}
		})
	}
}

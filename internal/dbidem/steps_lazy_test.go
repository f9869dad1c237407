package dbidem_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/internal/dbidem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// keylessSteps is the Steps of a request without a key (no claim, no lease) on pool.
func keylessSteps(ctx context.Context, db dbidem.Acquirer) context.Context {
	return dbidem.WithSteps(ctx, dbidem.NewSteps(db, nil, dbidem.Decision{}, nil, dbidem.TxOptions{}))
}

// TestStepConnKeepsToTheStepsContext: a step's tx.Conn() takes its connection on the step's
// context, as its statements do, and is nil when none could be had before that context ended.
// The first build of the lazy acquisition (D188) returned nil once the context had ended even
// with connections free; the second waited for one whatever the context, so a step whose
// caller held the pool's only connection waited for it forever.
func TestStepConnKeepsToTheStepsContext(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 1)
	// With a connection free, Conn has one, whatever fn did before.
	var free *pgx.Conn
	if _, err := dbidem.Step(keylessSteps(context.Background(), pool), "free", func(ctx context.Context, tx pgx.Tx) (int, error) {
		free = tx.Conn()
		return 1, nil
	}); err != nil || free == nil {
		t.Fatalf("tx.Conn() with a connection free: %v, err %v", free, err)
	}
	// The pool's only connection is held by the step's caller, which waits for the step.
	held, err := pool.Acquire(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer held.Release()
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	done := make(chan *pgx.Conn, 1)
	go func() {
		_, _ = dbidem.Step(keylessSteps(ctx, pool), "busy", func(ctx context.Context, tx pgx.Tx) (int, error) {
			done <- tx.Conn()
			return 1, nil
		})
	}()
	select {
	case c := <-done:
		if c != nil {
			t.Fatalf("tx.Conn() on a pool whose only connection is held: %v, want nil once the step's context ended", c)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("tx.Conn() still waited 5 s for a connection after the step's context ended at 200 ms")
	}
}

// TestStepWithEndedContextDoesNotCallOut: a Step whose context had ended (the lease's context
// ended by Shutdown's deadline, say) failed at its Acquire, before fn, and the provider was not
// called. The first build of the lazy acquisition (D188) ran fn, its outside call with it, and
// only fn's first statement failed.
func TestStepWithEndedContextDoesNotCallOut(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 2)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	var calls atomic.Int32
	_, err := dbidem.Step(keylessSteps(ctx, pool), "s", func(ctx context.Context, tx pgx.Tx) (int, error) {
		calls.Add(1) // the provider
		_, err := tx.Exec(ctx, `SELECT 1`)
		return 1, err
	})
	if err == nil || calls.Load() != 0 {
		t.Fatalf("a Step on an ended context: err %v, fn (its outside call) ran %d times; want an error before fn", err, calls.Load())
	}
}

// TestLazyStepsLeakNoConnection: steps of every shape (no statement, Conn only, Prepare only,
// a nested Begin first, LargeObjects first, a panic before and after the first statement, an
// error, a deadlock retried, a context that ends before or during fn) leave no connection
// acquired.
func TestLazyStepsLeakNoConnection(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 3)
	type shape func(ctx context.Context, tx pgx.Tx, cancel context.CancelFunc) (int, error)
	var deadlocks atomic.Int32
	shapes := map[string]shape{
		"none": func(ctx context.Context, tx pgx.Tx, _ context.CancelFunc) (int, error) { return 1, nil },
		"conn": func(ctx context.Context, tx pgx.Tx, _ context.CancelFunc) (int, error) {
			_, err := tx.Conn().Exec(ctx, `SELECT 1`)
			return 1, err
		},
		"prepare": func(ctx context.Context, tx pgx.Tx, _ context.CancelFunc) (int, error) {
			_, err := tx.Prepare(ctx, "", `SELECT 1`)
			return 1, err
		},
		"nested": func(ctx context.Context, tx pgx.Tx, _ context.CancelFunc) (int, error) {
			n, err := tx.Begin(ctx)
			if err != nil {
				return 0, err
			}
			if _, err := n.Exec(ctx, `SELECT 1`); err != nil {
				return 0, err
			}
			return 1, n.Commit(ctx)
		},
		"lo": func(ctx context.Context, tx pgx.Tx, _ context.CancelFunc) (int, error) {
			lo := tx.LargeObjects()
			oid, err := lo.Create(ctx, 0)
			if err != nil {
				return 0, err
			}
			return 1, lo.Unlink(ctx, oid)
		},
		"error": func(ctx context.Context, tx pgx.Tx, _ context.CancelFunc) (int, error) {
			_, _ = tx.Exec(ctx, `SELECT 1`)
			return 0, errors.New("boom")
		},
		"panic-before": func(ctx context.Context, tx pgx.Tx, _ context.CancelFunc) (int, error) { panic("before") },
		"panic-after": func(ctx context.Context, tx pgx.Tx, _ context.CancelFunc) (int, error) {
			_, _ = tx.Exec(ctx, `SELECT 1`)
			panic("after")
		},
		"deadlock": func(ctx context.Context, tx pgx.Tx, _ context.CancelFunc) (int, error) {
			if deadlocks.Add(1)%2 == 1 {
				_, err := tx.Exec(ctx, `DO $$ BEGIN RAISE EXCEPTION 'deadlock detected' USING ERRCODE = '40P01'; END $$`)
				return 0, err
			}
			_, err := tx.Exec(ctx, `SELECT 1`)
			return 1, err
		},
		"cancel-before": func(ctx context.Context, tx pgx.Tx, cancel context.CancelFunc) (int, error) {
			cancel()
			_, err := tx.Exec(ctx, `SELECT 1`)
			return 1, err
		},
		"cancel-during": func(ctx context.Context, tx pgx.Tx, cancel context.CancelFunc) (int, error) {
			go func() { time.Sleep(20 * time.Millisecond); cancel() }()
			_, err := tx.Exec(ctx, `SELECT pg_sleep(0.2)`)
			return 1, err
		},
	}
	var wg sync.WaitGroup
	for i := 0; i < 10; i++ {
		for name, fn := range shapes {
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer func() { _ = recover() }()
				ctx, cancel := context.WithCancel(context.Background())
				defer cancel()
				_, _ = dbidem.Step(keylessSteps(ctx, pool), fmt.Sprintf("%s-%d", name, i), func(ctx context.Context, tx pgx.Tx) (int, error) {
					return fn(ctx, tx, cancel)
				})
			}()
		}
	}
	wg.Wait()
	deadline := time.Now().Add(5 * time.Second)
	for pool.Stat().AcquiredConns() != 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if n := pool.Stat().AcquiredConns(); n != 0 {
		t.Fatalf("%d connections still acquired after every step ended", n)
	}
	// And the pool still works for a step.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := dbidem.Step(keylessSteps(ctx, pool), "last", func(ctx context.Context, tx pgx.Tx) (int, error) {
		var n int
		return n, tx.QueryRow(ctx, `SELECT 1`).Scan(&n)
	}); err != nil {
		t.Fatal(err)
	}
}

package idem_test

// Review of what fn may do inside Do: fail, panic, end its transaction, nest, run again.

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestDoFnPanics: a panic in fn goes on to the caller, the work rolls back, the key stays
// claimable at once (the Gate's flight is released), and a later Do runs fn.
func TestDoFnPanics(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	count := effectCounter(t, pool)
	job := idem.Job{Principal: "alice", Key: "panic", Action: "a"}
	var recovered any
	func() {
		defer func() { recovered = recover() }()
		_, _, _ = idem.Do(ctx, pool, job, idem.TxOptions{}, func(ctx context.Context, tx pgx.Tx) (int, error) {
			if err := insertEffect(ctx, tx, "panic"); err != nil {
				return 0, err
			}
			panic("fn panics")
		})
	}()
	if recovered == nil {
		t.Fatal("the panic did not reach the caller")
	}
	start := time.Now()
	v, replayed, err := idem.Do(ctx, pool, job, idem.TxOptions{}, func(ctx context.Context, tx pgx.Tx) (int, error) {
		return 2, insertEffect(ctx, tx, "panic")
	})
	if err != nil || replayed || v != 2 || count("panic") != 1 || time.Since(start) > time.Second {
		t.Errorf("after the panic: %d %v %v, effects %d, took %s", v, replayed, err, count("panic"), time.Since(start))
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND state LIKE 'idle in transaction%'`); n != 0 {
		t.Errorf("%d connections idle in transaction after the panic", n)
	}
}

// TestDoFnErrorWrappingSentinels: fn's own error that wraps a sentinel of the package goes
// back as it is, fn runs once, nothing is stored, and the key stays claimable.
func TestDoFnErrorWrappingSentinels(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	count := effectCounter(t, pool)
	for i, sentinel := range []error{idem.ErrInProgress, idem.ErrMismatch, idem.ErrClaimLost, idem.ErrCommitUnknown,
		idem.ErrStoreBusy, idem.ErrLeaseLost, idem.ErrInvalidArgument, context.DeadlineExceeded} {
		key := fmt.Sprintf("sentinel-%d", i)
		job := idem.Job{Principal: "alice", Key: key, Action: "a"}
		var runs atomic.Int32
		mine := fmt.Errorf("my work failed: %w", sentinel)
		start := time.Now()
		_, _, err := idem.Do(ctx, pool, job, idem.TxOptions{}, func(ctx context.Context, tx pgx.Tx) (int, error) {
			runs.Add(1)
			if err := insertEffect(ctx, tx, key); err != nil {
				return 0, err
			}
			return 0, mine
		})
		if err != mine || runs.Load() != 1 || count(key) != 0 || time.Since(start) > time.Second {
			t.Errorf("%v: err %v (same: %v), fn ran %d, effects %d, took %s", sentinel, err, err == mine, runs.Load(), count(key), time.Since(start))
		}
		v, _, err := idem.Do(ctx, pool, job, idem.TxOptions{}, func(ctx context.Context, tx pgx.Tx) (int, error) {
			runs.Add(1)
			return 1, insertEffect(ctx, tx, key)
		})
		if err != nil || v != 1 || count(key) != 1 {
			t.Errorf("%v: the run after: %d %v effects %d", sentinel, v, err, count(key))
		}
		// DoLease alike.
		ljob := idem.Job{Principal: "alice", Key: key + "-lease", Action: "a", Lease: 5 * time.Second}
		_, _, err = idem.DoLease(ctx, pool, ljob, func(context.Context, idem.LeaseClaim) (int, error) { return 0, mine })
		if err != mine {
			t.Errorf("%v: DoLease returned %v", sentinel, err)
		}
		v, _, err = idem.DoLease(ctx, pool, ljob, func(context.Context, idem.LeaseClaim) (int, error) { return 1, nil })
		if err != nil || v != 1 {
			t.Errorf("%v: DoLease's run after: %d %v", sentinel, v, err)
		}
	}
}

// TestDoFnEndsTheTransactionItself: tx.Commit and tx.Rollback are refused (ErrTxOwned); a fn
// that ignores that and returns nil commits once. A fn that sent ROLLBACK (or COMMIT) as SQL
// ended the claim's transaction: its later statements autocommitted outside the key, Do
// returned ErrClaimLost, and the next Do did the effect again. Every statement after it, and
// Do, now return ErrTxOwned, and nothing is committed.
func TestDoFnEndsTheTransactionItself(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	count := effectCounter(t, pool)
	job := idem.Job{Principal: "alice", Key: "owned", Action: "a"}
	var cerr, rerr error
	_, _, err := idem.Do(ctx, pool, job, idem.TxOptions{}, func(ctx context.Context, tx pgx.Tx) (int, error) {
		if err := insertEffect(ctx, tx, "owned"); err != nil {
			return 0, err
		}
		cerr, rerr = tx.Commit(ctx), tx.Rollback(ctx)
		return 1, nil
	})
	if err != nil || cerr == nil || rerr == nil || count("owned") != 1 {
		t.Errorf("Commit %v, Rollback %v, Do %v, effects %d", cerr, rerr, err, count("owned"))
	}

	for _, stmt := range []string{"ROLLBACK", "COMMIT"} {
		key := "sql-" + stmt
		job := idem.Job{Principal: "alice", Key: key, Action: "a"}
		var runs int
		fn := func(ctx context.Context, tx pgx.Tx) (int, error) {
			runs++
			_, err := tx.Exec(ctx, stmt) // a script that ends its transaction
			t.Logf("%s: %v", stmt, err)
			return 1, insertEffect(ctx, tx, key)
		}
		v, _, err1 := idem.Do(ctx, pool, job, idem.TxOptions{}, fn)
		afterFirst := count(key)
		_, _, err2 := idem.Do(ctx, pool, job, idem.TxOptions{}, fn)
		t.Logf("%s: first %d %v, effects %d; second %v; effects %d, fn ran %d", stmt, v, err1, afterFirst, err2, count(key), runs)
		if !errors.Is(err1, idem.ErrTxOwned) || afterFirst != 0 || !errors.Is(err2, idem.ErrTxOwned) || count(key) != 0 {
			t.Errorf("%s in fn: Do %v with %d effect(s) committed; after a retry (%v) %d effects; want ErrTxOwned both times and nothing committed",
				stmt, err1, afterFirst, err2, count(key))
		}
	}
}

// TestDoFnNestedTransactions: savepoints through tx.Begin: a nested rollback undoes its
// part only; a nested commit keeps it; an unfinished nested transaction commits with the
// unit.
func TestDoFnNestedTransactions(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	count := effectCounter(t, pool)
	job := idem.Job{Principal: "alice", Key: "nested", Action: "a"}
	_, _, err := idem.Do(ctx, pool, job, idem.TxOptions{}, func(ctx context.Context, tx pgx.Tx) (int, error) {
		n1, err := tx.Begin(ctx)
		if err != nil {
			return 0, err
		}
		if err := insertEffect(ctx, n1, "nested-rolled-back"); err != nil {
			return 0, err
		}
		if err := n1.Rollback(ctx); err != nil {
			return 0, err
		}
		n2, err := tx.Begin(ctx)
		if err != nil {
			return 0, err
		}
		if err := insertEffect(ctx, n2, "nested-committed"); err != nil {
			return 0, err
		}
		if err := n2.Commit(ctx); err != nil {
			return 0, err
		}
		n3, err := tx.Begin(ctx)
		if err != nil {
			return 0, err
		}
		// a failed statement in a savepoint, rolled back: the unit goes on
		if _, err := n3.Exec(ctx, `SELECT 1/0`); err == nil {
			return 0, errors.New("no error")
		}
		if err := n3.Rollback(ctx); err != nil {
			return 0, err
		}
		n4, _ := tx.Begin(ctx)
		if err := insertEffect(ctx, n4, "nested-open"); err != nil {
			return 0, err
		}
		return 1, nil
	})
	if err != nil || count("nested-rolled-back") != 0 || count("nested-committed") != 1 || count("nested-open") != 1 {
		t.Errorf("Do %v; rolled back %d, committed %d, left open %d", err, count("nested-rolled-back"), count("nested-committed"), count("nested-open"))
	}
	v, replayed, err := idem.Do(ctx, pool, job, idem.TxOptions{}, func(context.Context, pgx.Tx) (int, error) { return 9, nil })
	if err != nil || !replayed || v != 1 {
		t.Errorf("replay: %d %v %v", v, replayed, err)
	}
}

// TestDoSerializationFailureRunsFnAgain: at REPEATABLE READ a serialization failure of fn's
// statement runs fn again in the same Do call, so fn's outside-visible work (a channel send)
// happens twice while Do returns one success and its effect commits once. Do's doc said "runs
// fn at most once"; it says now that fn runs again with its transaction.
func TestDoSerializationFailureRunsFnAgain(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	pgtest.Exec(t, pool, `CREATE TABLE rv_ser (id int PRIMARY KEY, v int NOT NULL); INSERT INTO rv_ser VALUES (1, 0)`)
	job := idem.Job{Principal: "alice", Key: "ser", Action: "a"}
	sent := make(chan int, 10)
	var runs atomic.Int32
	v, replayed, err := idem.Do(ctx, pool, job, idem.TxOptions{TxOptions: pgx.TxOptions{IsoLevel: pgx.RepeatableRead}},
		func(ctx context.Context, tx pgx.Tx) (int, error) {
			n := runs.Add(1)
			var v int
			if err := tx.QueryRow(ctx, `SELECT v FROM rv_ser WHERE id = 1`).Scan(&v); err != nil {
				return 0, err
			}
			if n == 1 { // a concurrent writer commits between fn's read and its write
				if _, err := pool.Exec(ctx, `UPDATE rv_ser SET v = v + 100 WHERE id = 1`); err != nil {
					return 0, err
				}
			}
			sent <- v // outside-visible work
			_, err := tx.Exec(ctx, `UPDATE rv_ser SET v = v + 1 WHERE id = 1`)
			return v, err
		})
	close(sent)
	var outside []int
	for x := range sent {
		outside = append(outside, x)
	}
	t.Logf("Do: %d %v %v; fn ran %d times; outside sends %v", v, replayed, err, runs.Load(), outside)
	if err != nil {
		t.Fatalf("Do: %v", err)
	}
	if runs.Load() != 2 || len(outside) != 2 {
		t.Errorf("fn ran %d times in one Do (outside sends %v); want twice: the serialization failure runs it again", runs.Load(), outside)
	}
	if n := pgtest.Count(t, pool, `SELECT v FROM rv_ser WHERE id = 1`); n != 101 {
		t.Errorf("v = %d; want 101: the concurrent writer's 100 and the effect once", n)
	}
}

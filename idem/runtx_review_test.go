package idem_test

// Review of RunTx with Tx.Claim, CompleteOnCommit and FinalOnCommit, and of Begin by hand.

import (
	"context"
	"errors"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

func txClaim(key string) idem.Claim {
	fp := idem.ComputeFingerprint("POST", "/review", []byte(`{"a":1}`))
	return idem.Claim{Principal: "alice", Key: key, Action: "POST /review", Fingerprint: fp.Sum, Fields: fp.Fields}
}

// TestRunTxFailedStatementThenComplete: "A COMMIT that PostgreSQL answers with ROLLBACK (fn
// left the transaction failed: an error of its statements it did not return) committed
// nothing: RunTx returns pgx.ErrTxCommitRollback." With a pending completion (the usual case
// with a claim), and in Do, it returned a raw 25P02 (the completion's preparation refused in
// the aborted transaction).
func TestRunTxFailedStatementThenComplete(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	count := effectCounter(t, pool)
	err := idem.RunTx(ctx, pool, idem.TxOptions{}, func(tx *idem.Tx) error {
		d, err := tx.Claim(ctx, txClaim("failed-stmt"))
		if err != nil || d.Outcome != idem.Claimed {
			return errors.Join(err, errors.New(string(d.Outcome)))
		}
		if err := insertEffect(ctx, tx, "failed-stmt"); err != nil {
			return err
		}
		_, _ = tx.Exec(ctx, `SELECT 1/0`) // an error it did not return
		tx.CompleteOnCommit(idem.Response{Status: 201, Body: []byte(`{}`)})
		return nil
	})
	t.Logf("RunTx: %v", err)
	if !errors.Is(err, pgx.ErrTxCommitRollback) || count("failed-stmt") != 0 {
		t.Errorf("RunTx: %v (effects %d), want pgx.ErrTxCommitRollback", err, count("failed-stmt"))
	}
	_, _, err = idem.Do(ctx, pool, idem.Job{Principal: "alice", Key: "failed-stmt-do", Action: "a"}, idem.TxOptions{},
		func(ctx context.Context, tx pgx.Tx) (int, error) {
			_, _ = tx.Exec(ctx, `SELECT 1/0`)
			return 1, nil
		})
	t.Logf("Do: %v", err)
	if !errors.Is(err, pgx.ErrTxCommitRollback) {
		t.Errorf("Do: %v, want pgx.ErrTxCommitRollback", err)
	}
}

// TestRunTxFinalOnCommitOfAReplay: FinalOnCommit "stores r as the final answer to this
// transaction's claim". Called on a claim that was not Claimed (a replay), the work is rolled
// back to the savepoint, nothing is stored, and RunTx returns nil.
func TestRunTxFinalOnCommitOfAReplay(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	count := effectCounter(t, pool)
	c := txClaim("final-replay")
	if err := idem.RunTx(ctx, pool, idem.TxOptions{}, func(tx *idem.Tx) error {
		if _, err := tx.Claim(ctx, c); err != nil {
			return err
		}
		tx.CompleteOnCommit(idem.Response{Status: 201, Body: []byte(`{"first":true}`)})
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	var outcome idem.Outcome
	err := idem.RunTx(ctx, pool, idem.TxOptions{}, func(tx *idem.Tx) error {
		d, err := tx.Claim(ctx, c)
		if err != nil {
			return err
		}
		outcome = d.Outcome
		if err := insertEffect(ctx, tx, "final-replay"); err != nil {
			return err
		}
		tx.FinalOnCommit(idem.Response{Status: http.StatusNotFound, Body: []byte(`{"final":true}`)})
		return nil
	})
	t.Logf("outcome %s, RunTx %v, effects %d", outcome, err, count("final-replay"))
	err2 := idem.RunTx(ctx, pool, idem.TxOptions{}, func(tx *idem.Tx) error {
		d, err := tx.Claim(ctx, c)
		if err != nil {
			return err
		}
		outcome = d.Outcome
		if err := insertEffect(ctx, tx, "complete-replay"); err != nil {
			return err
		}
		tx.CompleteOnCommit(idem.Response{Status: 201, Body: []byte(`{"second":true}`)})
		return nil
	})
	t.Logf("CompleteOnCommit on a replay: RunTx %v, effects %d", err2, count("complete-replay"))
}

// TestRunTxDeadlockRerunsFn: two units that deadlock: one runs again (TxOptions.MaxAttempts),
// both commit, each effect once.
func TestRunTxDeadlockRerunsFn(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 6)
	pgtest.Exec(t, pool, `CREATE TABLE rv_dl (id int PRIMARY KEY, v int NOT NULL); INSERT INTO rv_dl VALUES (1, 0), (2, 0)`)
	count := effectCounter(t, pool)
	var runs atomic.Int32
	first := make(chan struct{}, 2)
	var barrier sync.WaitGroup
	barrier.Add(2)
	unit := func(key string, a, b int) error {
		var once sync.Once
		return idem.RunTx(ctx, pool, idem.TxOptions{}, func(tx *idem.Tx) error {
			runs.Add(1)
			if _, err := tx.Claim(ctx, txClaim(key)); err != nil {
				return err
			}
			if _, err := tx.Exec(ctx, `UPDATE rv_dl SET v = v + 1 WHERE id = $1`, a); err != nil {
				return err
			}
			once.Do(func() { barrier.Done(); barrier.Wait() })
			if _, err := tx.Exec(ctx, `UPDATE rv_dl SET v = v + 1 WHERE id = $1`, b); err != nil {
				return err
			}
			if err := insertEffect(ctx, tx, key); err != nil {
				return err
			}
			tx.CompleteOnCommit(idem.Response{Status: 200, Body: []byte(`1`)})
			first <- struct{}{}
			return nil
		})
	}
	var wg sync.WaitGroup
	errs := make([]error, 2)
	wg.Add(2)
	go func() { defer wg.Done(); errs[0] = unit("dl-a", 1, 2) }()
	go func() { defer wg.Done(); errs[1] = unit("dl-b", 2, 1) }()
	wg.Wait()
	t.Logf("errs %v; fn ran %d", errs, runs.Load())
	if errs[0] != nil || errs[1] != nil || count("dl-a") != 1 || count("dl-b") != 1 {
		t.Errorf("errs %v; effects %d %d", errs, count("dl-a"), count("dl-b"))
	}
	if n := pgtest.Count(t, pool, `SELECT sum(v) FROM rv_dl`); n != 4 {
		t.Errorf("sum %d, want 4", n)
	}
}

// TestBeginOnThePool: a transactional claim by Begin outside a transaction commits on its own
// without its completion: refused (ErrClaimNotCompleted), nothing kept.
func TestBeginOnThePool(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	d, err := idem.Begin(ctx, pool, txClaim("begin-pool"))
	t.Logf("Begin on the pool: %v %v", d.Outcome, err)
	if !errors.Is(err, idem.ErrClaimNotCompleted) {
		t.Errorf("Begin on the pool: %v %v", d.Outcome, err)
	}
	if _, ok, _ := idem.ReadKey(ctx, pool, "alice", "begin-pool"); ok {
		t.Error("the key was kept")
	}
	// Commit of a pgx transaction of one's own without the completion.
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := idem.Begin(ctx, tx, txClaim("begin-tx")); err != nil {
		t.Fatal(err)
	}
	err = tx.Commit(ctx)
	t.Logf("own Commit without completion: %v (ErrClaimNotCompleted: %v)", err, errors.Is(err, idem.ErrClaimNotCompleted))
}

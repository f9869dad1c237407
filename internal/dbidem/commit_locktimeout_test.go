package dbidem_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/internal/dbidem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestDoCommitLockTimeoutIsTheWorks: Do's fn writes a row whose deferred foreign key is checked
// at COMMIT against a parent row another transaction holds, with a lock_timeout in force: the
// COMMIT fails 55P03. It was taken for a lock on the key table: fn ran four times and Do
// returned ErrStoreBusy. It is the work's failure, run again as a statement's lock timeout is.
func TestDoCommitLockTimeoutIsTheWorks(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, url := pgtest.NewPool(t, 4)
	pgtest.Exec(t, pool, `CREATE TABLE parents (id int PRIMARY KEY)`)
	pgtest.Exec(t, pool, `CREATE TABLE children (id serial PRIMARY KEY,
		parent int REFERENCES parents (id) DEFERRABLE INITIALLY DEFERRED)`)
	pgtest.Exec(t, pool, `INSERT INTO parents VALUES (1)`)
	locker := pgtest.Connect(t, url)
	ltx, err := locker.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ltx.Exec(ctx, `SELECT * FROM parents WHERE id = 1 FOR UPDATE`); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = ltx.Commit(ctx) }() // held through every run of fn
	var runs atomic.Int32
	_, _, err = dbidem.Do(ctx, pool, dbidem.Job{Principal: "alice", Key: "deferred", Action: "insert"}, dbidem.TxOptions{},
		func(ctx context.Context, tx pgx.Tx) (int, error) {
			runs.Add(1)
			if _, err := tx.Exec(ctx, `SET LOCAL lock_timeout = '100ms'`); err != nil {
				return 0, err
			}
			_, err := tx.Exec(ctx, `INSERT INTO children (parent) VALUES (1)`)
			return 1, err
		})
	t.Logf("Do: err %v; fn ran %d times", err, runs.Load())
	if runs.Load() > dbidem.DefaultMaxAttempts || errors.Is(err, dbidem.ErrStoreBusy) || !dbidem.IsWorkLockTimeout(err) {
		t.Fatalf("a lock timeout of fn's deferred constraint at COMMIT: fn ran %d times, Do returned %v; "+
			"want at most %d runs and no ErrStoreBusy (the key table was never locked)", runs.Load(), err, dbidem.DefaultMaxAttempts)
	}
}

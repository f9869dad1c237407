package tests

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgidem/pgidem/internal/pgtest"
)

type querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

type decision struct {
	Outcome string
	Attempt int
	Status  *int
	Body    []byte
}

func sum(s string) []byte { h := sha256.Sum256([]byte(s)); return h[:] }

// begin calls idem_begin with a 200 ms lock timeout unless lockTimeout says otherwise.
func begin(ctx context.Context, q querier, key, body string, lockTimeout string) (decision, error) {
	var d decision
	err := q.QueryRow(ctx, `SELECT outcome, attempt, response_status, response_body
		FROM idem.idem_begin(p_principal => 'p', p_key => $1, p_action => 'POST /t',
		                     p_request_sha256 => $2, p_lock_timeout => $3::interval)`,
		key, sum(body), lockTimeout).Scan(&d.Outcome, &d.Attempt, &d.Status, &d.Body)
	return d, err
}

// beginTx begins a transaction on conn and fails the test when it cannot.
func beginTx(t *testing.T, conn *pgx.Conn, opts pgx.TxOptions) pgx.Tx {
	t.Helper()
	tx, err := conn.BeginTx(context.Background(), opts)
	if err != nil {
		t.Fatal(err)
	}
	return tx
}

func sqlstate(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code
	}
	return ""
}

func TestSameKeyTwoTransactions(t *testing.T) {
	t.Parallel()
	for _, firstCommits := range []bool{true, false} {
		t.Run(fmt.Sprintf("first_commits=%v", firstCommits), func(t *testing.T) {
			t.Parallel()
			url := pgtest.NewDB(t)
			ctx := context.Background()
			a, b, obs := pgtest.Connect(t, url), pgtest.Connect(t, url), pgtest.Connect(t, url)
			pgtest.Exec(t, obs, `CREATE TABLE effects (key text)`)

			txA, err := a.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if d, err := begin(ctx, txA, "k", "body", "10s"); err != nil || d.Outcome != "claimed" {
				t.Fatalf("A: %+v %v", d, err)
			}
			pgtest.Exec(t, txA, `INSERT INTO effects VALUES ('k')`)

			type result struct {
				d   decision
				err error
			}
			done := make(chan result, 1)
			go func() {
				tx, err := b.Begin(ctx)
				if err != nil {
					done <- result{err: err}
					return
				}
				d, err := begin(ctx, tx, "k", "body", "10s")
				if err == nil && d.Outcome == "claimed" {
					_, err = tx.Exec(ctx, `INSERT INTO effects VALUES ('k')`)
					if err == nil {
						_, err = tx.Exec(ctx, `SELECT idem.idem_complete('p', 'k', $1, 201, '{}', 'second')`, d.Attempt)
					}
				}
				if err == nil {
					err = tx.Commit(ctx)
				}
				done <- result{d, err}
			}()
			pgtest.WaitUntilBlocked(t, obs, b.PgConn().PID())
			select {
			case r := <-done:
				t.Fatalf("B answered while A held the key: %+v", r)
			default:
			}

			if firstCommits {
				pgtest.Exec(t, txA, `SELECT idem.idem_complete('p', 'k', attempt, 201, '{}', 'first') FROM idem.idempotency_keys WHERE principal_id = 'p' AND key = 'k'`)
				if err := txA.Commit(ctx); err != nil {
					t.Fatal(err)
				}
				r := <-done
				if r.err != nil || r.d.Outcome != "replay" || string(r.d.Body) != "first" {
					t.Fatalf("B after A committed: %+v %v, want replay of first", r.d, r.err)
				}
			} else {
				if err := txA.Rollback(ctx); err != nil {
					t.Fatal(err)
				}
				r := <-done
				if r.err != nil || r.d.Outcome != "claimed" {
					t.Fatalf("B after A rolled back: %+v %v, want claimed", r.d, r.err)
				}
			}
			if n := pgtest.Count(t, obs, `SELECT count(*) FROM effects`); n != 1 {
				t.Fatalf("%d effects, want 1", n)
			}
			if n := pgtest.Count(t, obs, `SELECT count(*) FROM idem.idempotency_keys WHERE state = 'c'`); n != 1 {
				t.Fatalf("%d completed keys, want 1", n)
			}
		})
	}
}

func TestLockTimeout(t *testing.T) {
	t.Parallel()
	url := pgtest.NewDB(t)
	ctx := context.Background()
	a, b := pgtest.Connect(t, url), pgtest.Connect(t, url)
	pgtest.Exec(t, a, `CREATE TABLE effects (who text)`)

	txA := beginTx(t, a, pgx.TxOptions{})
	if d, err := begin(ctx, txA, "k", "body", "10s"); err != nil || d.Outcome != "claimed" {
		t.Fatalf("A: %+v %v", d, err)
	}
	txB := beginTx(t, b, pgx.TxOptions{})
	pgtest.Exec(t, txB, `INSERT INTO effects VALUES ('B before')`)
	pgtest.Exec(t, txB, `SET LOCAL lock_timeout = '7s'`)
	_, err := begin(ctx, txB, "k", "body", "200ms")
	if got := sqlstate(err); got != "55P03" {
		t.Fatalf("B: %v (SQLSTATE %q), want 55P03", err, got)
	}
	if _, err := txB.Exec(ctx, `SELECT 1`); sqlstate(err) != "25P02" {
		t.Fatalf("B's transaction should be aborted, got %v", err)
	}
	_ = txB.Rollback(ctx)
	pgtest.Exec(t, txA, `SELECT idem.idem_complete('p', 'k', attempt, 200, '{}', NULL) FROM idem.idempotency_keys WHERE principal_id = 'p' AND key = 'k'`)
	if err := txA.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if n := pgtest.Count(t, a, `SELECT count(*) FROM effects`); n != 0 {
		t.Fatalf("B's effect survived: %d rows", n)
	}
	if n := pgtest.Count(t, a, `SELECT count(*) FROM idem.idempotency_keys`); n != 1 {
		t.Fatalf("%d key rows, want 1", n)
	}

	// p_lock_timeout holds only for the call: the caller's own setting is back afterwards.
	txC := beginTx(t, b, pgx.TxOptions{})
	pgtest.Exec(t, txC, `SET LOCAL lock_timeout = '7s'`)
	if _, err := begin(ctx, txC, "k2", "body", "200ms"); err != nil {
		t.Fatal(err)
	}
	var lt string
	if err := txC.QueryRow(ctx, `SHOW lock_timeout`).Scan(&lt); err != nil || lt != "7s" {
		t.Fatalf("lock_timeout after the call = %q (%v), want the caller's 7s", lt, err)
	}
	_ = txC.Rollback(ctx)
}

// TestManyCallersPerKey: 64 callers on each of 50 keys; each claimer writes one effect row in
// its own transaction. Exactly one effect and one completed key per key; every caller sees
// the claimer's response.
func TestManyCallersPerKey(t *testing.T) {
	t.Parallel()
	const keys, callers = 50, 64
	pool, _ := pgtest.NewPool(t, 48)
	ctx := context.Background()
	pgtest.Exec(t, pool, `CREATE TABLE effects (key text, caller int)`)

	var wg sync.WaitGroup
	start := make(chan struct{})
	var inProgress atomic.Int64
	errs := make(chan error, keys*callers)
	bodies := make([][]string, keys)
	for k := range keys {
		bodies[k] = make([]string, callers)
		for c := range callers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				key := fmt.Sprintf("key-%d", k)
				for try := 0; ; try++ {
					var body string
					err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
						d, err := begin(ctx, tx, key, "same body", "2s")
						if err != nil {
							return err
						}
						switch d.Outcome {
						case "claimed":
							if _, err := tx.Exec(ctx, `INSERT INTO effects VALUES ($1, $2)`, key, c); err != nil {
								return err
							}
							body = fmt.Sprintf("done by %d", c)
							_, err = tx.Exec(ctx, `SELECT idem.idem_complete('p', $1, $2, 201, '{}', $3::bytea)`, key, d.Attempt, []byte(body))
							return err
						case "replay":
							body = string(d.Body)
							return nil
						}
						return fmt.Errorf("unexpected outcome %q", d.Outcome)
					})
					if sqlstate(err) == "55P03" && try < 20 {
						inProgress.Add(1)
						continue
					}
					if err != nil {
						errs <- err
					}
					bodies[k][c] = body
					return
				}
			}()
		}
	}
	close(start)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM effects`); n != keys {
		t.Fatalf("%d effect rows, want %d", n, keys)
	}
	if n := pgtest.Count(t, pool, `SELECT count(DISTINCT key) FROM effects`); n != keys {
		t.Fatalf("effects on %d distinct keys, want %d", n, keys)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem.idempotency_keys WHERE state = 'c'`); n != keys {
		t.Fatalf("%d completed key rows, want %d", n, keys)
	}
	for k := range keys {
		var claimer int
		if err := pool.QueryRow(ctx, `SELECT caller FROM effects WHERE key = $1`, fmt.Sprintf("key-%d", k)).Scan(&claimer); err != nil {
			t.Fatal(err)
		}
		want := fmt.Sprintf("done by %d", claimer)
		for c, got := range bodies[k] {
			if got != want {
				t.Fatalf("key %d caller %d saw %q, want %q", k, c, got, want)
			}
		}
	}
	t.Logf("%d calls, %d lock timeouts retried", keys*callers, inProgress.Load())
}

func TestRepeatableReadGets40001(t *testing.T) {
	t.Parallel()
	url := pgtest.NewDB(t)
	ctx := context.Background()
	a, b, obs := pgtest.Connect(t, url), pgtest.Connect(t, url), pgtest.Connect(t, url)

	txA := beginTx(t, a, pgx.TxOptions{})
	if d, err := begin(ctx, txA, "k", "body", "10s"); err != nil || d.Outcome != "claimed" {
		t.Fatalf("A: %+v %v", d, err)
	}
	txB, err := b.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
	if err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, txB, `SELECT 1`) // takes B's snapshot before A commits
	done := make(chan error, 1)
	go func() { _, err := begin(ctx, txB, "k", "body", "10s"); done <- err }()
	pgtest.WaitUntilBlocked(t, obs, b.PgConn().PID())
	pgtest.Exec(t, txA, `SELECT idem.idem_complete('p', 'k', attempt, 201, '{}', 'first') FROM idem.idempotency_keys WHERE principal_id = 'p' AND key = 'k'`)
	if err := txA.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-done; sqlstate(err) != "40001" {
		t.Fatalf("REPEATABLE READ caller: %v, want SQLSTATE 40001", err)
	}
	_ = txB.Rollback(ctx)

	txB = beginTx(t, b, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
	d, err := begin(ctx, txB, "k", "body", "10s")
	if err != nil || d.Outcome != "replay" || string(d.Body) != "first" {
		t.Fatalf("retry: %+v %v, want replay of first", d, err)
	}
	_ = txB.Rollback(ctx)
}

// TestCommitWithoutCompletionRefused commits a transactional claim for real.
func TestCommitWithoutCompletionRefused(t *testing.T) {
	t.Parallel()
	conn := pgtest.Connect(t, pgtest.NewDB(t))
	ctx := context.Background()
	pgtest.Exec(t, conn, `CREATE TABLE effects (key text)`)
	tx := beginTx(t, conn, pgx.TxOptions{})
	if d, err := begin(ctx, tx, "k", "body", "1s"); err != nil || d.Outcome != "claimed" {
		t.Fatalf("%+v %v", d, err)
	}
	pgtest.Exec(t, tx, `INSERT INTO effects VALUES ('k')`)
	err := tx.Commit(ctx)
	if sqlstate(err) != "23503" {
		t.Fatalf("COMMIT of an uncompleted claim: %v, want SQLSTATE 23503", err)
	}
	if n := pgtest.Count(t, conn, `SELECT count(*) FROM effects`) + pgtest.Count(t, conn, `SELECT count(*) FROM idem.idempotency_keys`); n != 0 {
		t.Fatalf("%d rows survived the refused commit", n)
	}
}

// TestConcurrentCleanup: two cleaners and live claims at once; every expired row is deleted
// exactly once and no live row is touched.
func TestConcurrentCleanup(t *testing.T) {
	t.Parallel()
	const expired, live = 3000, 500
	pool, _ := pgtest.NewPool(t, 8)
	ctx := context.Background()
	pgtest.InsertExpired(t, pool, "p", expired)

	var wg sync.WaitGroup
	start := make(chan struct{})
	var deleted atomic.Int64
	errs := make(chan error, 16)
	for range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			for {
				var n int
				if err := pool.QueryRow(ctx, `SELECT idem.idem_cleanup(100)`).Scan(&n); err != nil {
					errs <- err
					return
				}
				deleted.Add(int64(n))
				if n < 100 {
					return
				}
			}
		}()
	}
	for w := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			for i := w; i < live; i += 4 {
				err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
					key := fmt.Sprintf("live-%d", i)
					d, err := begin(ctx, tx, key, "b", "2s")
					if err != nil {
						return err
					}
					_, err = tx.Exec(ctx, `SELECT idem.idem_complete('p', $1, $2, 200, '{}', NULL)`, key, d.Attempt)
					return err
				})
				if err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	close(start)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if got := deleted.Load(); got != expired {
		t.Fatalf("the cleaners reported %d deletions, want %d", got, expired)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem.idempotency_keys WHERE key LIKE 'old-%'`); n != 0 {
		t.Fatalf("%d expired rows left", n)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem.idempotency_keys WHERE key LIKE 'live-%' AND state = 'c'`); n != live {
		t.Fatalf("%d live rows, want %d", n, live)
	}
}

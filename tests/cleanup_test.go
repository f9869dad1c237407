package tests

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestCleanupAcrossRelations: the one cleanup path over two relations of the key table's
// shape (as on a Citus node with two local shards), with two cleaners at once: every
// expired row is deleted exactly once, and no live row is touched.
func TestCleanupAcrossRelations(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 6)
	ctx := context.Background()
	pgtest.Exec(t, pool, `CREATE TABLE idem.keys_shard_2 (LIKE idem.idempotency_keys INCLUDING ALL)`)
	pgtest.InsertExpired(t, pool, "a", 2000)
	pgtest.Exec(t, pool, `INSERT INTO idem.keys_shard_2 SELECT * FROM idem.idempotency_keys`)
	pgtest.Exec(t, pool, `UPDATE idem.keys_shard_2 SET principal_id = 'b'`)
	pgtest.InsertExpired(t, pool, "c", 1500)
	for _, rel := range []string{"idem.idempotency_keys", "idem.keys_shard_2"} {
		pgtest.Exec(t, pool, `INSERT INTO `+rel+` (expires_at, attempt, action_hash, state, principal_id, key, request_sha256,
			response_status, response_headers)
			SELECT now() + interval '1 hour', nextval('idem.token_seq'), 0, 'c', 'live', 'live-' || i, sha256(i::text::bytea), 200, '{}'
			  FROM generate_series(1, 300) AS i`)
	}
	var deleted atomic.Int64
	var wg sync.WaitGroup
	start := make(chan struct{})
	for range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			for {
				var n int
				if err := pool.QueryRow(ctx, `SELECT idem.cleanup_relations(ARRAY['idem.idempotency_keys', 'idem.keys_shard_2']::regclass[], 250)`).Scan(&n); err != nil {
					t.Error(err)
					return
				}
				deleted.Add(int64(n))
				if n < 250 {
					return
				}
			}
		}()
	}
	close(start)
	wg.Wait()
	if got := deleted.Load(); got != 5500 {
		t.Fatalf("the cleaners reported %d deletions, want 5500 (each expired row once)", got)
	}
	for _, rel := range []string{"idem.idempotency_keys", "idem.keys_shard_2"} {
		if n := pgtest.Count(t, pool, `SELECT count(*) FROM `+rel+` WHERE expires_at <= now()`); n != 0 {
			t.Fatalf("%s: %d expired rows left", rel, n)
		}
		if n := pgtest.Count(t, pool, `SELECT count(*) FROM `+rel+` WHERE principal_id = 'live'`); n != 300 {
			t.Fatalf("%s: %d live rows, want 300", rel, n)
		}
	}
}

// TestCleanupSkipsLockedRows: an expired row that another session holds (a request is
// re-claiming it, say) is skipped: the cleaner returns at once, having deleted the others,
// instead of waiting for the lock.
func TestCleanupSkipsLockedRows(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 4)
	ctx := context.Background()
	pgtest.InsertExpired(t, pool, "p", 50)
	holder, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = holder.Rollback(ctx) }()
	pgtest.Exec(t, holder, `SELECT 1 FROM idem.idempotency_keys WHERE key = 'old-7' FOR UPDATE`)
	cleaner := pgtest.Connect(t, pgtest.URLOf(t, pool))
	pgtest.Exec(t, cleaner, `SET lock_timeout = '30s'`)
	began := time.Now()
	var n int
	if err := cleaner.QueryRow(ctx, `SELECT idem.idem_cleanup(1000)`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if took := time.Since(began); n != 49 || took > time.Second {
		t.Fatalf("the cleaner deleted %d rows in %s; want the 49 unlocked ones, promptly", n, took)
	}
	_ = holder.Rollback(ctx)
	if err := cleaner.QueryRow(ctx, `SELECT idem.idem_cleanup(1000)`).Scan(&n); err != nil || n != 1 {
		t.Fatalf("once released, the last row: %d %v", n, err)
	}
}

// TestLockTimeoutArgument: p_lock_timeout is the call's own bound on waiting for a holder of
// the key: 200ms gives up well before the 2 s default, and 5 s outlasts a holder that
// commits after 3 s (longer than the default) and then replays its answer.
func TestLockTimeoutArgument(t *testing.T) {
	t.Parallel()
	url := pgtest.NewDB(t)
	ctx := context.Background()
	a, b := pgtest.Connect(t, url), pgtest.Connect(t, url)
	txA, err := a.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if d, err := begin(ctx, txA, "k", "body", "10s"); err != nil || d.Outcome != "claimed" {
		t.Fatalf("A: %+v %v", d, err)
	}
	began := time.Now()
	_, err = begin(ctx, b, "k", "body", "200ms")
	if took := time.Since(began); sqlstate(err) != "55P03" || took > time.Second {
		t.Fatalf("200ms: %v after %s, want 55P03 well before the 2 s default", err, took)
	}
	done := make(chan decision, 1)
	errs := make(chan error, 1)
	go func() {
		d, err := begin(ctx, b, "k", "body", "5s")
		done <- d
		errs <- err
	}()
	pgtest.WaitUntilBlocked(t, a, b.PgConn().PID())
	time.Sleep(3 * time.Second)
	pgtest.Exec(t, txA, `SELECT idem.idem_complete('p', 'k', attempt, 201, '{}', 'first') FROM idem.idempotency_keys WHERE key = 'k'`)
	if err := txA.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	d, err := <-done, <-errs
	if err != nil || d.Outcome != "replay" || string(d.Body) != "first" {
		t.Fatalf("5s: %+v %v, want the replay after 3 s", d, err)
	}
}

// TestCleanupFansOutOnACoordinator: on a Citus coordinator (here a stand-in with two workers,
// pgtest.CitusStandIn), idem_cleanup deletes from the workers: at most one batch per call,
// shared between them and taken from the one that has more when the other is drained, a count
// below the batch size only once both are drained, and no live key touched. CALL
// idem_cleanup_all cleans the whole cluster.
func TestCleanupFansOutOnACoordinator(t *testing.T) {
	t.Parallel()
	conn := pgtest.Connect(t, pgtest.NewDB(t))
	pgtest.CitusStandIn(t, conn)
	pgtest.InsertKeys(t, conn, "idem.keys_w1", "a", "old", 2000, true)
	pgtest.InsertKeys(t, conn, "idem.keys_w2", "b", "old", 700, true)
	for _, rel := range []string{"idem.keys_w1", "idem.keys_w2"} {
		pgtest.InsertKeys(t, conn, rel, "live", "live", 300, false)
	}
	var batches []int
	for {
		n := pgtest.Count(t, conn, `SELECT idem.idem_cleanup(1000)`)
		batches = append(batches, n)
		if n < 1000 || len(batches) > 5 {
			break
		}
	}
	if fmt.Sprint(batches) != "[1000 1000 700]" {
		t.Fatalf("batches %v, want [1000 1000 700]: one batch per call until both workers are drained", batches)
	}
	for _, rel := range []string{"idem.keys_w1", "idem.keys_w2"} {
		if n := pgtest.Count(t, conn, `SELECT count(*) FROM `+rel+` WHERE expires_at <= now()`); n != 0 {
			t.Fatalf("%s: %d expired keys left", rel, n)
		}
		if n := pgtest.Count(t, conn, `SELECT count(*) FROM `+rel+` WHERE principal_id = 'live'`); n != 300 {
			t.Fatalf("%s: %d live keys, want 300", rel, n)
		}
	}

	pgtest.InsertKeys(t, conn, "idem.keys_w1", "a", "again", 1234, true)
	pgtest.InsertKeys(t, conn, "idem.keys_w2", "b", "again", 56, true)
	var deleted int
	if err := conn.QueryRow(context.Background(), `CALL idem.idem_cleanup_all(100, NULL)`).Scan(&deleted); err != nil || deleted != 1290 {
		t.Fatalf("CALL idem.idem_cleanup_all on the coordinator: %d deleted, %v; want 1290", deleted, err)
	}
}

// TestCleanupWalksTheIndex: a batch reads the oldest expired rows from the expires_at index
// however stale the statistics are. Here the table was analyzed while it held only live keys
// (as before a backlog grew), so the planner expects almost no expired row. It then scanned and sorted
// every expired row to pick a batch of 1000, or walked every expired row of the index to
// find the batch's rows for the DELETE: a backlog cost its square.
func TestCleanupWalksTheIndex(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 2)
	ctx := context.Background()
	pgtest.Exec(t, pool, `ALTER TABLE idem.idempotency_keys SET (autovacuum_enabled = off)`)
	pgtest.InsertKeys(t, pool, "idem.idempotency_keys", "live", "live-", 2000, false)
	pgtest.Exec(t, pool, `VACUUM ANALYZE idem.idempotency_keys`)
	pgtest.InsertExpired(t, pool, "a", 20_000)
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	var n, seq, fetched int
	if err := tx.QueryRow(ctx, `SELECT idem.idem_cleanup(1000)`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if err := tx.QueryRow(ctx, `SELECT seq_scan, idx_tup_fetch FROM pg_stat_xact_user_tables
		 WHERE relid = 'idem.idempotency_keys'::regclass`).Scan(&seq, &fetched); err != nil {
		t.Fatal(err)
	}
	if n != 1000 {
		t.Fatalf("idem_cleanup(1000) deleted %d rows, want 1000", n)
	}
	if seq != 0 || fetched > 1000 {
		t.Fatalf("a cleanup batch of 1000 scanned the key table %d times sequentially and fetched %d rows by index; want 0 and at most 1000",
			seq, fetched)
	}
}

// TestCleanupWorkersOnACoordinator: on a Citus coordinator (the stand-in, whose two "workers"
// run the command a coordinator sends them in sessions of their own, at once),
// idem_cleanup_workers has every worker clean its own keys batch after batch until it is
// drained, in one call: it reports the total and done, touches no live key, and the next call
// finds nothing. Paced to a small duty with a short time, each worker stops at the time,
// having deleted a small part, and says it is not done; the next calls finish the work.
func TestCleanupWorkersOnACoordinator(t *testing.T) {
	t.Parallel()
	conn := pgtest.Connect(t, pgtest.NewDB(t))
	pgtest.CitusStandIn(t, conn)
	pgtest.InsertKeys(t, conn, "idem.keys_w1", "a", "old", 2000, true)
	pgtest.InsertKeys(t, conn, "idem.keys_w2", "b", "old", 750, true)
	for _, rel := range []string{"idem.keys_w1", "idem.keys_w2"} {
		pgtest.InsertKeys(t, conn, rel, "live", "live", 300, false)
	}
	pass := func(args string) (int64, bool) {
		t.Helper()
		var n int64
		var done bool
		if err := conn.QueryRow(context.Background(), `SELECT deleted, done FROM idem.idem_cleanup_workers(`+args+`)`).Scan(&n, &done); err != nil {
			t.Fatalf("idem_cleanup_workers(%s): %v", args, err)
		}
		return n, done
	}
	if n, done := pass(`100, 1, '1 minute'`); n != 2750 || !done {
		t.Fatalf("one pass: %d deleted, done %v; want 2750, done", n, done)
	}
	for _, rel := range []string{"idem.keys_w1", "idem.keys_w2"} {
		if n := pgtest.Count(t, conn, `SELECT count(*) FROM `+rel+` WHERE expires_at <= now()`); n != 0 {
			t.Fatalf("%s: %d expired keys left", rel, n)
		}
		if n := pgtest.Count(t, conn, `SELECT count(*) FROM `+rel+` WHERE principal_id = 'live'`); n != 300 {
			t.Fatalf("%s: %d live keys, want 300", rel, n)
		}
	}
	if n, done := pass(`100`); n != 0 || !done {
		t.Fatalf("a pass with nothing to do: %d deleted, done %v", n, done)
	}

	// 200 batches of 100 on each worker; at a duty of 0.01 each batch is followed by a pause
	// of 99 times its length, so 300 ms hold a few batches, far from all of them (at full
	// speed they take about a second; at this duty, minutes).
	pgtest.InsertKeys(t, conn, "idem.keys_w1", "a", "more", 20_000, true)
	pgtest.InsertKeys(t, conn, "idem.keys_w2", "b", "more", 20_000, true)
	began := time.Now()
	n, done := pass(`100, 0.01, '300 milliseconds'`)
	if took := time.Since(began); n < 200 || n > 4000 || done || took > 10*time.Second {
		t.Fatalf("a paced pass of 300 ms: %d deleted (want at least a batch on each worker, at most a tenth), done %v, in %v", n, done, took)
	}
	var total int64
	for i := 0; i < 10 && !done; i++ {
		var m int64
		m, done = pass(`5000, 1, '1 minute'`)
		total += m
	}
	if total+n != 40_000 || !done {
		t.Fatalf("the passes after it deleted %d, done %v; want the %d left", total, done, 40_000-n)
	}
}

// TestCleanupWorkersOnPlainPostgres: where there are no workers to ask, idem_cleanup_workers
// returns no row and deletes nothing (the caller cleans with idem_cleanup); the procedure a
// worker runs for it, cleanup_node, cleans the node's own keys batch after batch, each
// committed, and stops at its time after at least one batch.
func TestCleanupWorkersOnPlainPostgres(t *testing.T) {
	t.Parallel()
	conn := pgtest.Connect(t, pgtest.NewDB(t))
	pgtest.InsertExpired(t, conn, "p", 1050)
	if n := pgtest.Count(t, conn, `SELECT count(*) FROM idem.idem_cleanup_workers()`); n != 0 {
		t.Fatalf("idem_cleanup_workers on plain PostgreSQL: %d rows, want none", n)
	}
	if n := pgtest.Count(t, conn, `SELECT count(*) FROM idem.idempotency_keys`); n != 1050 {
		t.Fatalf("%d keys left, want the 1050: nothing deleted", n)
	}
	var result string
	if err := conn.QueryRow(context.Background(), `CALL idem.cleanup_node(100, 1, 0.000001, NULL)`).Scan(&result); err != nil || result != "0:100:false" {
		t.Fatalf("cleanup_node with no time: %q %v, want one batch, not drained (0:100:false)", result, err)
	}
	if err := conn.QueryRow(context.Background(), `CALL idem.cleanup_node(100, 0.5, 60, NULL)`).Scan(&result); err != nil || result != "0:950:true" {
		t.Fatalf("cleanup_node: %q %v, want the other 950, drained (0:950:true)", result, err)
	}
	if n := pgtest.Count(t, conn, `SELECT count(*) FROM idem.idempotency_keys`); n != 0 {
		t.Fatalf("%d keys left", n)
	}
	if _, err := conn.Exec(context.Background(), `BEGIN; CALL idem.cleanup_node(100, 1, 1, NULL)`); sqlstate(err) != "2D000" {
		t.Fatalf("cleanup_node inside a transaction block: %v, want 2D000 (it cannot commit its batches there)", err)
	}
}

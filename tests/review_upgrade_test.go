package tests

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgidem/pgidem/internal/pgtest"
	idemsql "github.com/pgidem/pgidem/sql"
)

// TestSwapWaitsOnAReferencedTableHoldingTheKeyTable (review finding): migration 003's swap
// asks for the key table's ACCESS EXCLUSIVE lock with a 200 ms lock timeout, and then restores
// the session's lock_timeout (none) for the rest of the transaction. With a foreign key from
// the key table to another table (the reference server's principals, which 003 explicitly
// carries over, or any user's), `DROP TABLE idem.idempotency_keys` must take ACCESS EXCLUSIVE
// on the referenced table too (to drop the foreign key's triggers there). So any transaction
// that merely read principals (a report, `pg_dump -t principals`, an idle-in-transaction
// session) makes the swap wait, without a bound, while it holds the key table locked: every
// claim of the previous release waits out its lock timeout and fails, and every new reader of
// principals queues behind the DROP, for as long as that unrelated transaction lasts. The
// issue asks for a swap "in a lock whose length does not grow" and "the longest request of
// the old release during migrate <= 1 s".
//
// The gap is held by a real lock: an open transaction that read principals.
func TestSwapWaitsOnAReferencedTableHoldingTheKeyTable(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url, conn := at010(t)
	pgtest.Exec(t, conn, `INSERT INTO principals VALUES ('p_alice', 'alice')`)

	// A reader of principals, in an open transaction. It holds nothing on the key table.
	reader := pgtest.Connect(t, url)
	pgtest.Exec(t, reader, `BEGIN`)
	pgtest.Exec(t, reader, `SELECT count(*) FROM principals`)
	ended := false
	endReader := func() {
		if !ended {
			ended = true
			pgtest.Exec(t, reader, `COMMIT`)
		}
	}
	defer endReader()

	migrator := pgtest.Connect(t, url)
	var pid uint32
	if err := migrator.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- idemsql.Migrate(ctx, migrator, idemsql.Options{}) }()

	// The migrate reaches the swap and then waits on principals, holding the key table.
	pgtest.WaitFor(t, conn, `SELECT count(*) FROM pg_locks WHERE pid = $1 AND NOT granted
		AND relation = 'principals'::regclass`, pid)
	held := pgtest.Count(t, conn, `SELECT count(*) FROM pg_locks WHERE pid = $1 AND granted
		AND relation = 'idem.idempotency_keys'::regclass AND mode = 'AccessExclusiveLock'`, pid)
	t.Logf("the migrate waits on principals; it holds ACCESS EXCLUSIVE on idem.idempotency_keys: %v", held > 0)

	// The previous release's lease claim of a new key (it commits on its own).
	began := time.Now()
	_, err := conn.Exec(ctx, `SELECT outcome FROM idem.idem_begin('p_alice', 'k-during-swap', 'POST /v1/jobs',
		sha256('job'), p_lease => '1 minute')`)
	took := time.Since(began)
	var pgErr *pgconn.PgError
	code := ""
	if errors.As(err, &pgErr) {
		code = pgErr.Code
	}
	t.Logf("0.1.0 claim during the swap: %v after %v", err, took.Round(time.Millisecond))

	// An unkeyed read of principals (any request that reads or references them).
	ctxRead, cancel := context.WithTimeout(ctx, 3*time.Second)
	began = time.Now()
	_, rerr := pgtest.Connect(t, url).Exec(ctxRead, `SELECT count(*) FROM principals`)
	cancel()
	readTook := time.Since(began)
	t.Logf("an unkeyed read of principals during the swap: %v after %v", rerr, readTook.Round(time.Millisecond))

	endReader()
	if err := <-done; err != nil {
		t.Fatalf("migrate after the reader ended: %v", err)
	}

	if err != nil || took > time.Second {
		t.Errorf("a claim of the previous release during the swap: error %v (SQLSTATE %q) after %v; want an answer within 1 s "+
			"(the swap holds the key table while it waits, without a lock timeout, on a transaction that only read principals)",
			err, code, took.Round(time.Millisecond))
	}
	if rerr != nil || readTook > time.Second {
		t.Errorf("an unkeyed read of principals during the swap: %v after %v; want it unaffected", rerr, readTook.Round(time.Millisecond))
	}
}

// TestSQLBundleBesideAMigrate (review finding): sql/idem.sql decides whether the online
// rebuild of 003 is due (schema version 1 or 2) before it takes tern's advisory lock, and does
// not look again once it holds it (RebuildOnline does: "another migrate swapped meanwhile").
// When another migrate (`server migrate`, idemsql.Migrate) swaps the tables while the bundle
// waits for the lock, the bundle then runs the 0.1.0 conversion against the new table and
// stops with an error, though Migrate, tern and the bundle are documented to "take turns on
// tern's advisory lock" and the bundle "can be run again". The gap is held by the advisory
// lock itself, taken by the session that then runs the other migrate.
func TestSQLBundleBesideAMigrate(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url, conn := at010(t)
	// The other migrate's session holds tern's lock first.
	other := pgtest.Connect(t, url)
	pgtest.Exec(t, other, `SELECT pg_advisory_lock($1)`, idemsql.TernLock)

	type result struct {
		out []byte
		err error
	}
	psql := make(chan result, 1)
	cmd := psqlCommand(t, url, "-v", "ON_ERROR_STOP=1", "-f", bundle)
	go func() {
		out, err := cmd.CombinedOutput()
		psql <- result{out, err}
	}()
	// The bundle has found the rebuild due and waits for the lock.
	pgtest.WaitFor(t, conn, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted`)

	if err := idemsql.Migrate(ctx, other, idemsql.Options{}); err != nil {
		t.Fatalf("the other migrate: %v", err)
	}
	pgtest.Exec(t, other, `SELECT pg_advisory_unlock($1)`, idemsql.TernLock)

	r := <-psql
	if r.err != nil {
		t.Fatalf("psql -f sql/idem.sql beside a migrate that swapped while it waited for the lock: %v\n%s", r.err, lastLines(string(r.out), 6))
	}
}

// TestOnlineRebuildKeepsChangesDuringAPausedBackfill (review, passes: pins the online 003
// rebuild): the backfill is held mid-way by a real row lock (a FOR UPDATE on a row in the
// middle of the key order, where a batch's FOR KEY SHARE waits) while release 0.1.0 changes
// rows on both sides of the cursor: a lease claim completed, an expired key claimed again (a
// token above every other), principals deleted with their keys by the ledger's ON DELETE
// CASCADE, expired keys cleaned up, new keys claimed. Once the backfill ends, the new table is
// exactly the conversion of the old one, also when the migrate was killed mid-backfill and run
// again, and after the swap the sequence starts above every 0.1.0 token.
func TestOnlineRebuildKeepsChangesDuringAPausedBackfill(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url, conn := at010(t)
	pgtest.Exec(t, conn, `INSERT INTO principals VALUES ('p_a', 'a'), ('p_a2', 'a2'), ('p_b', 'b'), ('p_c', 'c'), ('p_d', 'd')`)
	pgtest.Exec(t, conn, `INSERT INTO idem.idempotency_keys (principal_id, key, state, attempt, created_at, expires_at,
		action, request_sha256, completed_at, response_status, response_headers, response_body)
		SELECT p, 'k-' || lpad(g::text, 4, '0'), 'completed', 1, now(), now() + interval '1 day', 'POST /x',
		       sha256(g::text::bytea), now(), 201, '{"Content-Type": "application/json"}', convert_to(g::text, 'UTF8')
		  FROM unnest(ARRAY['p_a', 'p_a2', 'p_b', 'p_c', 'p_d']) AS p, generate_series(1, 300) AS g`)
	pgtest.Exec(t, conn, `INSERT INTO idem.idempotency_keys (principal_id, key, state, attempt, created_at, expires_at,
		action, request_sha256, completed_at, response_status, response_headers, response_body)
		SELECT p, k, 'completed', 1, now() - interval '2 days', now() - interval '1 day', 'POST /x', sha256('old'), now() - interval '2 days',
		       201, '{}', 'old'
		  FROM (VALUES ('p_a', 'exp-a'), ('p_a', 'exp2-a'), ('p_d', 'exp-d'), ('p_d', 'exp2-d')) AS v(p, k)`)
	for _, sql := range []string{
		`SELECT idem.idem_begin('p_a', 'lease-a', 'POST /x', sha256('lease'), p_lease => '10 minutes')`,
		`SELECT idem.idem_begin('p_d', 'lease-d', 'POST /x', sha256('lease'), p_lease => '10 minutes')`,
	} {
		pgtest.Exec(t, conn, sql)
	}

	blocker := pgtest.Connect(t, url)
	pgtest.Exec(t, blocker, `BEGIN`)
	pgtest.Exec(t, blocker, `SELECT 1 FROM idem.idempotency_keys WHERE principal_id = 'p_b' AND key = 'k-0150' FOR UPDATE`)

	data, err := idemsql.TemplateData(idemsql.Options{})
	if err != nil {
		t.Fatal(err)
	}
	rebuilder := pgtest.Connect(t, url)
	var pid uint32
	if err := rebuilder.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- idemsql.RebuildOnline(ctx, rebuilder, data, 100) }()
	pgtest.WaitFor(t, conn, `SELECT count(*) FROM pg_stat_activity WHERE pid = $1 AND wait_event IN ('transactionid', 'tuple')`, pid)
	copied := pgtest.Count(t, conn, `SELECT count(*) FROM idem.idempotency_keys_v3`)
	t.Logf("the backfill is paused with %d rows copied", copied)

	for _, sql := range []string{
		// behind the cursor (copied already)
		`SELECT idem.idem_complete('p_a', 'lease-a', 1, 201, '{"Location": ["/a", "/b"]}', 'done-a')`,
		`SELECT idem.idem_begin('p_a', 'exp-a', 'POST /x', sha256('again'), p_lease => '10 minutes')`,
		`DELETE FROM principals WHERE id = 'p_a2'`,
		`SELECT idem.idem_begin('p_a', 'new-a', 'POST /x', sha256('new'), p_lease => '10 minutes')`,
		// ahead of the cursor
		`SELECT idem.idem_complete('p_d', 'lease-d', 1, 200, '{}', 'done-d')`,
		`SELECT idem.idem_begin('p_d', 'exp-d', 'POST /x', sha256('again'), p_lease => '10 minutes')`,
		`SELECT idem.idem_begin('p_d', 'exp-d', 'POST /x', sha256('again'), p_lease => '10 minutes')`,
		`DELETE FROM principals WHERE id = 'p_c'`,
		`SELECT idem.idem_begin('p_d', 'new-d', 'POST /x', sha256('new'), p_lease => '10 minutes')`,
		// both sides
		`SELECT idem.idem_cleanup(100)`,
	} {
		pgtest.Exec(t, conn, sql)
	}
	// The migrate is killed mid-backfill, and run again.
	pgtest.Exec(t, conn, `SELECT pg_terminate_backend($1)`, pid)
	if err := <-done; err == nil {
		t.Fatal("the killed rebuild reported success")
	}
	pgtest.Exec(t, blocker, `COMMIT`)
	pgtest.Exec(t, conn, `SELECT idem.idem_begin('p_d', 'after-kill', 'POST /x', sha256('new'), p_lease => '10 minutes')`)
	rebuilder = pgtest.Connect(t, url)
	if err := idemsql.RebuildOnline(ctx, rebuilder, data, 100); err != nil {
		t.Fatal(err)
	}

	diff := pgtest.Count(t, conn, `SELECT count(*) FROM (
		(SELECT * FROM idem.idempotency_keys_v3 EXCEPT ALL SELECT (idem.v3_row(k)).* FROM idem.idempotency_keys AS k)
		UNION ALL
		(SELECT (idem.v3_row(k)).* FROM idem.idempotency_keys AS k EXCEPT ALL SELECT * FROM idem.idempotency_keys_v3)) AS d`)
	rows := pgtest.Count(t, conn, `SELECT count(*) FROM idem.idempotency_keys`)
	if diff != 0 || rows != 3*300+7 {
		t.Fatalf("after the backfill: %d rows differ between the new table and the old one's conversion; %d rows in the old table", diff, rows)
	}
	maxOld := pgtest.Count(t, conn, `SELECT max(attempt) FROM idem.idempotency_keys`)
	if err := idemsql.Migrate(ctx, rebuilder, idemsql.Options{}); err != nil {
		t.Fatal(err)
	}
	next := pgtest.Count(t, conn, `SELECT nextval('idem.token_seq')`)
	if maxOld < 2 || next <= maxOld {
		t.Fatalf("the sequence starts at %d, the largest 0.1.0 token was %d", next, maxOld)
	}
}

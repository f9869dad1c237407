package tests

// A review of the SQL API as a non-Go service calls it: each test asserts what docs/sql-api.md
// promises, calling the functions directly as a login role that is only a member of idem_app
// (or idem_operator).

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgidem/pgidem/internal/pgtest"
)

func sqlCode(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code
	}
	if err == nil {
		return "ok"
	}
	return "?" + err.Error()
}

// appAndAdmin connects to a fresh migrated database as a login role in idem_app, and returns that
// connection and the superuser's (to look at the table).
func appAndAdmin(t *testing.T) (app *pgx.Conn, admin *pgx.Conn, url string) {
	t.Helper()
	url = pgtest.NewDB(t)
	admin = pgtest.Connect(t, url)
	app = pgtest.Connect(t, pgtest.LoginRole(t, url, "idem_app"))
	return app, admin, url
}

// claimPastItsTTL begins a transaction on app, claims alice's key k1 in it with a TTL of 10 ms
// (transactional), and lets the TTL pass: the work takes longer than the TTL, as in
// docs/sql-api.md's example (a TTL of one second and work of 1.2 seconds). It returns the
// transaction, rolled back at the test's end, and the claim's token.
func claimPastItsTTL(t *testing.T, app *pgx.Conn) (pgx.Tx, int64) {
	t.Helper()
	ctx := context.Background()
	tx, err := app.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	var outcome string
	var token int64
	if err := tx.QueryRow(ctx, `SELECT outcome, attempt FROM idem.idem_begin(p_principal => 'alice', p_key => 'k1',
		p_action => 'POST /v1/transfers', p_request_sha256 => sha256('t'), p_ttl => '10 milliseconds')`).Scan(&outcome, &token); err != nil || outcome != "claimed" {
		t.Fatalf("claim: %q %v", outcome, err)
	}
	time.Sleep(50 * time.Millisecond)
	return tx, token
}

// TestCleanupInAClaimsOwnTransactionKeepsTheClaim: a transactional claim cannot be committed
// without its completion (the database refuses the COMMIT), and docs/sql-api.md ("How long a
// key lives"): "while the work runs the key is held whatever its age (a transactional claim
// until its transaction ends ...)".
// idem_cleanup called in the claim's own transaction, once the claim's TTL had run out,
// deleted the claim's own uncompleted row (SKIP LOCKED skips only rows that *others* hold):
// the commit guard then had no row to check, the COMMIT succeeded with the effect and no key,
// and the client's retry claimed the key again and repeated the effect.
func TestCleanupInAClaimsOwnTransactionKeepsTheClaim(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	app, _, _ := appAndAdmin(t)
	tx, _ := claimPastItsTTL(t, app)
	var deleted int
	if err := tx.QueryRow(ctx, `SELECT idem.idem_cleanup()`).Scan(&deleted); err != nil || deleted != 0 {
		t.Errorf("idem_cleanup in the claim's own transaction: %d deleted, %v; want 0", deleted, err)
	}
	commitErr := tx.Commit(ctx)
	if sqlCode(commitErr) != "23503" {
		// The client's retry, in a transaction of its own (rolled back here).
		var retry string
		rtx, err := app.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := rtx.QueryRow(ctx, `SELECT outcome FROM idem.idem_begin(p_principal => 'alice', p_key => 'k1',
			p_action => 'POST /v1/transfers', p_request_sha256 => sha256('t'))`).Scan(&retry); err != nil {
			t.Fatalf("deleted %d, commit %v, retry: %v", deleted, commitErr, err)
		}
		_ = rtx.Rollback(ctx)
		t.Errorf("idem_cleanup in the claim's own transaction deleted %d row(s) (its own uncompleted claim); "+
			"COMMIT without idem_complete gave %v (want 23503); the client's retry is then %q (the effect runs twice)",
			deleted, commitErr, retry)
	}
}

// TestSecondBeginInAClaimsOwnTransactionAfterItsTTL: the same promise. In the claim's own
// transaction, once its TTL had run out, idem_begin for the same request took the
// transaction's own uncompleted claim for an expired key and claimed it again; with p_lease the
// row became a lease claim, which the commit guard lets commit: an effect committed beside a
// key that had no answer. docs/sql-api.md: a transaction's own uncommitted claim answers
// in_progress, whatever its age; another request under the key, mismatch; and
// idem_save_final of another request returns false.
func TestSecondBeginInAClaimsOwnTransactionAfterItsTTL(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	app, _, _ := appAndAdmin(t)
	tx, first := claimPastItsTTL(t, app)
	var outcome string
	var second int64
	if err := tx.QueryRow(ctx, `SELECT outcome, attempt FROM idem.idem_begin(p_principal => 'alice', p_key => 'k1',
		p_action => 'POST /v1/transfers', p_request_sha256 => sha256('t'), p_lease => '1 hour')`).Scan(&outcome, &second); err != nil {
		t.Fatal(err)
	}
	if outcome != "in_progress" || second != first {
		t.Errorf("second idem_begin in the claim's own transaction: %q (token %d, first %d), want in_progress with the first token", outcome, second, first)
	}
	if err := tx.QueryRow(ctx, `SELECT outcome, attempt FROM idem.idem_begin(p_principal => 'alice', p_key => 'k1',
		p_action => 'POST /v1/transfers', p_request_sha256 => sha256('other'), p_lease => '1 hour')`).Scan(&outcome, &second); err != nil {
		t.Fatal(err)
	}
	if outcome != "mismatch" || second != first {
		t.Errorf("another request in the claim's own transaction: %q (token %d, first %d), want mismatch", outcome, second, first)
	}
	var stored bool
	if err := tx.QueryRow(ctx, `SELECT idem.idem_save_final('alice', 'k1', 'POST /v1/transfers', sha256('other'), NULL, 409, '{}', 'no')`).Scan(&stored); err != nil || stored {
		t.Errorf("idem_save_final of another request in the claim's own transaction: %v %v, want false", stored, err)
	}
	commitErr := tx.Commit(ctx)
	if sqlCode(commitErr) != "23503" {
		t.Errorf("COMMIT without an answer: %v (want 23503)", commitErr)
	}
}

// TestReleaseStuckOfAnExpiredKey: docs/sql-api.md, idem_release_stuck: "a claim taken over
// since, a completed key, a released or absent one raise 55000 and nothing changes"; and "An
// expired key ... is absent". A lease claim whose key expired (TTL past the lease's end) was
// released without an error, and its row changed (new token, generation).
func TestReleaseStuckOfAnExpiredKey(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	app, _, url := appAndAdmin(t)
	ops := pgtest.Connect(t, pgtest.LoginRole(t, url, "idem_operator"))
	var token int64
	if err := app.QueryRow(ctx, `SELECT attempt FROM idem.idem_begin(p_principal => 'bob', p_key => 'job', p_action => 'POST /jobs',
		p_request_sha256 => sha256('job'), p_lease => '10 milliseconds', p_ttl => '10 milliseconds')`).Scan(&token); err != nil {
		t.Fatal(err)
	}
	time.Sleep(60 * time.Millisecond)
	var expired bool
	if err := ops.QueryRow(ctx, `SELECT expired FROM idem.idem_key('bob', 'job')`).Scan(&expired); err != nil || !expired {
		t.Fatalf("the key should be expired: %v %v", expired, err)
	}
	_, err := ops.Exec(ctx, `SELECT idem.idem_release_stuck('bob', 'job', $1, 'test')`, token)
	var after int64
	if err2 := ops.QueryRow(ctx, `SELECT attempt FROM idem.idem_key('bob', 'job')`).Scan(&after); err2 != nil {
		t.Fatal(err2)
	}
	if sqlCode(err) != "55000" || after != token {
		t.Errorf("idem_release_stuck of an expired (absent) key: %v (want 55000), token %d -> %d (want unchanged)", err, token, after)
	}
}

// TestBadInputAsTheRolesStoresNothing: docs/sql-api.md, "SQLSTATEs": 22004 for a NULL
// required argument, 22023 for an out-of-range one, "Bad input never writes anything". As
// idem_app (and idem_operator for its functions), every argument position.
func TestBadInputAsTheRolesStoresNothing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	app, admin, url := appAndAdmin(t)
	ops := pgtest.Connect(t, pgtest.LoginRole(t, url, "idem_operator"))
	// A lease claim to aim the token-taking functions at.
	var tok int64
	if err := app.QueryRow(ctx, `SELECT attempt FROM idem.idem_begin('p', 'live', 'a', sha256('x'), p_lease => '1 hour')`).Scan(&tok); err != nil {
		t.Fatal(err)
	}
	long := strings.Repeat("k", 256)
	sf := func(args string) string { return `SELECT idem.idem_save_final(` + args + `)` }
	cases := []struct {
		who  *pgx.Conn
		sql  string
		want string
	}{
		// idem_save_final, each argument.
		{app, sf(`NULL, 'sf', 'a', sha256('x'), NULL, 422, '{}', 'b'`), "22004"},
		{app, sf(`'p', NULL, 'a', sha256('x'), NULL, 422, '{}', 'b'`), "22004"},
		{app, sf(`'p', 'sf', NULL, sha256('x'), NULL, 422, '{}', 'b'`), "22004"},
		{app, sf(`'p', 'sf', 'a', NULL, NULL, 422, '{}', 'b'`), "22004"},
		{app, sf(`'p', 'sf', 'a', sha256('x'), NULL, NULL, '{}', 'b'`), "22004"},
		{app, sf(`'p', 'sf', 'a', sha256('x'), NULL, 422, NULL, 'b'`), "22004"},
		{app, sf(`'', 'sf', 'a', sha256('x'), NULL, 422, '{}', 'b'`), "22023"},
		{app, sf(`'p', '', 'a', sha256('x'), NULL, 422, '{}', 'b'`), "22023"},
		{app, sf(`'p', 'a b', 'a', sha256('x'), NULL, 422, '{}', 'b'`), "22023"},
		{app, sf(`'p', 'é', 'a', sha256('x'), NULL, 422, '{}', 'b'`), "22023"},
		{app, sf(`'p', '` + long + `', 'a', sha256('x'), NULL, 422, '{}', 'b'`), "22023"},
		{app, sf(`'` + long + `', 'sf', 'a', sha256('x'), NULL, 422, '{}', 'b'`), "22023"},
		{app, sf(`'p', 'sf', '', sha256('x'), NULL, 422, '{}', 'b'`), "22023"},
		{app, sf(`'p', 'sf', repeat('a', 1001), sha256('x'), NULL, 422, '{}', 'b'`), "22023"},
		{app, sf(`'p', 'sf', 'a', 'short', NULL, 422, '{}', 'b'`), "22023"},
		{app, sf(`'p', 'sf', 'a', sha256('x'), '0', 422, '{}', 'b'`), "22023"},
		{app, sf(`'p', 'sf', 'a', sha256('x'), '-1 day', 422, '{}', 'b'`), "22023"},
		{app, sf(`'p', 'sf', 'a', sha256('x'), '1 mon -29 days', 422, '{}', 'b'`), "22023"},
		{app, sf(`'p', 'sf', 'a', sha256('x'), '1 day -1 second', 422, '{}', 'b'`), "22023"},
		{app, sf(`'p', 'sf', 'a', sha256('x'), '3601 days', 422, '{}', 'b'`), "22023"},
		{app, sf(`'p', 'sf', 'a', sha256('x'), NULL, 99, '{}', 'b'`), "22023"},
		{app, sf(`'p', 'sf', 'a', sha256('x'), NULL, 600, '{}', 'b'`), "22023"},
		{app, sf(`'p', 'sf', 'a', sha256('x'), NULL, -1, '{}', 'b'`), "22023"},
		{app, sf(`'p', 'sf', 'a', sha256('x'), NULL, 422, '[]', 'b'`), "22023"},
		{app, sf(`'p', 'sf', 'a', sha256('x'), NULL, 422, 'null', 'b'`), "22023"},
		{app, sf(`'p', 'sf', 'a', sha256('x'), NULL, 422, '"x"', 'b'`), "22023"},
		{app, sf(`'p', 'sf', 'a', sha256('x'), NULL, 422, '{"a":1}', 'b'`), "22023"},
		{app, sf(`'p', 'sf', 'a', sha256('x'), NULL, 422, '{"a":null}', 'b'`), "22023"},
		{app, sf(`'p', 'sf', 'a', sha256('x'), NULL, 422, '{"a":{"b":"c"}}', 'b'`), "22023"},
		{app, sf(`'p', 'sf', 'a', sha256('x'), NULL, 422, '{"a":["b"]}', 'b'`), "22023"},
		{app, sf(`'p', 'sf', 'a', sha256('x'), NULL, 422, '{}', 'b', '[]'`), "22023"},
		{app, sf(`'p', 'sf', 'a', sha256('x'), NULL, 422, '{}', 'b', '"x"'`), "22023"},
		{app, sf(`'p', 'sf', 'a', sha256('x'), NULL, 422, '{}', 'b', '{"a":1}'`), "22023"},
		{app, sf(`'p', 'sf', 'a', sha256('x'), NULL, 422, '{}', 'b', '{"a":null}'`), "22023"},
		{app, sf(`'p', 'sf', 'a', sha256('x'), NULL, 422, '{}', 'b', '{"a":"0123"}'`), "22023"},
		{app, sf(`'p', 'sf', 'a', sha256('x'), NULL, 422, '{}', 'b', '{"a":"0123456789abcdeZ"}'`), "22023"},
		{app, sf(`'p', 'sf', 'a', sha256('x'), NULL, 422, '{}', 'b', '{"a":" 0123456789abcdef"}'`), "22023"},
		{app, sf(`'p', 'sf', 'a', sha256('x'), NULL, 422, '{}', 'b', '{"a":{"x":"0123456789abcdef"}}'`), "22023"},
		{app, sf(`'p', 'sf', 'a', sha256('x'), NULL, 422, '{}', 'b', NULL, 'other'`), "22023"},
		{app, sf(`'p', 'sf', 'a', sha256('x'), NULL, 422, '{}', 'b', NULL, ''`), "22023"},
		{app, sf(`'p', 'sf', 'a', sha256('x'), NULL, 422, '{}', 'b', NULL, 'too_large'`), "22023"},
		// idem_complete.
		{app, `SELECT idem.idem_complete(NULL, 'live', ` + fmt.Sprint(tok) + `, 200, '{}', 'b')`, "22004"},
		{app, `SELECT idem.idem_complete('p', NULL, ` + fmt.Sprint(tok) + `, 200, '{}', 'b')`, "22004"},
		{app, `SELECT idem.idem_complete('p', 'live', NULL, 200, '{}', 'b')`, "22004"},
		{app, `SELECT idem.idem_complete('p', 'live', ` + fmt.Sprint(tok) + `, NULL, '{}', 'b')`, "22004"},
		{app, `SELECT idem.idem_complete('p', 'live', ` + fmt.Sprint(tok) + `, 200, NULL, 'b')`, "22004"},
		{app, `SELECT idem.idem_complete('p', 'live', ` + fmt.Sprint(tok) + `, 700, '{}', 'b')`, "22023"},
		{app, `SELECT idem.idem_complete('p', 'live', ` + fmt.Sprint(tok) + `, 200, '[1]', 'b')`, "22023"},
		{app, `SELECT idem.idem_complete('p', 'live', ` + fmt.Sprint(tok) + `, 200, '{"a":true}', 'b')`, "22023"},
		{app, `SELECT idem.idem_complete('p', 'live', ` + fmt.Sprint(tok) + `, 200, '{}', 'b', NULL, 'one_time_secret')`, "22023"},
		{app, `SELECT idem.idem_complete('p', 'live', ` + fmt.Sprint(tok) + `, 200, '{}', NULL, NULL, 'nope')`, "22023"},
		{app, `SELECT idem.idem_complete('p', 'live', -1, 200, '{}', 'b')`, "55000"},
		{app, `SELECT idem.idem_complete('', 'live', ` + fmt.Sprint(tok) + `, 200, '{}', 'b')`, "22023"},
		// idem_release, idem_yield, idem_extend, idem_step, idem_recovery.
		{app, `SELECT idem.idem_release(NULL, 'live', ` + fmt.Sprint(tok) + `)`, "22004"},
		{app, `SELECT idem.idem_release('p', NULL, ` + fmt.Sprint(tok) + `)`, "22004"},
		{app, `SELECT idem.idem_release('p', 'live', NULL)`, "22004"},
		{app, `SELECT idem.idem_release('p', 'li ve', ` + fmt.Sprint(tok) + `)`, "22023"},
		{app, `SELECT idem.idem_yield('p', 'live', NULL)`, "22004"},
		{app, `SELECT idem.idem_yield(NULL, 'live', ` + fmt.Sprint(tok) + `)`, "22004"},
		{app, `SELECT idem.idem_yield('p', '', ` + fmt.Sprint(tok) + `)`, "22023"},
		{app, `SELECT idem.idem_extend('p', 'live', ` + fmt.Sprint(tok) + `, NULL)`, "22004"},
		{app, `SELECT idem.idem_extend('p', 'live', NULL, '1 minute')`, "22004"},
		{app, `SELECT idem.idem_extend('p', 'live', ` + fmt.Sprint(tok) + `, '0')`, "22023"},
		{app, `SELECT idem.idem_extend('p', 'live', ` + fmt.Sprint(tok) + `, '-1 minute')`, "22023"},
		{app, `SELECT idem.idem_extend('p', 'live', ` + fmt.Sprint(tok) + `, '1 mon -29 days')`, "22023"},
		{app, `SELECT idem.idem_extend('p', 'live', ` + fmt.Sprint(tok) + `, '11 years')`, "22023"},
		{app, `SELECT idem.idem_extend('', 'live', ` + fmt.Sprint(tok) + `, '1 minute')`, "22023"},
		{app, `SELECT idem.idem_step('p', 'live', ` + fmt.Sprint(tok) + `, NULL)`, "22004"},
		{app, `SELECT idem.idem_step('p', 'live', NULL, 's')`, "22004"},
		{app, `SELECT idem.idem_step('p', 'live', ` + fmt.Sprint(tok) + `, '')`, "22023"},
		{app, `SELECT idem.idem_step('p', 'live', ` + fmt.Sprint(tok) + `, repeat('s', 256))`, "22023"},
		{app, `SELECT idem.idem_step('p', 'live', ` + fmt.Sprint(tok) + `, 's', to_jsonb(repeat('x', 9000)))`, "22023"},
		{app, `SELECT idem.idem_step(NULL, 'live', ` + fmt.Sprint(tok) + `, 's')`, "22004"},
		{app, `SELECT * FROM idem.idem_recovery('p', 'live', NULL)`, "22004"},
		{app, `SELECT * FROM idem.idem_recovery('p', 'a b', ` + fmt.Sprint(tok) + `)`, "22023"},
		// idem_begin_steps.
		{app, `SELECT * FROM idem.idem_begin_steps(NULL, 'bs', 'a', sha256('x'))`, "22004"},
		{app, `SELECT * FROM idem.idem_begin_steps('p', 'bs', 'a', sha256('x'), p_lease => '0')`, "22023"},
		{app, `SELECT * FROM idem.idem_begin_steps('p', 'bs', 'a', sha256('x'), p_lock_timeout => '-1 s')`, "22023"},
		{app, `SELECT * FROM idem.idem_begin_steps('p', 'bs', 'a', sha256('x'), p_request_fields => '[1]')`, "22023"},
		// Cleanup.
		{app, `SELECT idem.idem_cleanup(NULL)`, "22004"},
		{app, `SELECT idem.idem_cleanup(0)`, "22023"},
		{app, `SELECT idem.idem_cleanup(-5)`, "22023"},
		{app, `CALL idem.idem_cleanup_all(0)`, "22023"},
		{app, `CALL idem.idem_cleanup_all(NULL)`, "22004"},
		{app, `SELECT * FROM idem.idem_cleanup_workers(0)`, "22023"},
		{app, `SELECT * FROM idem.idem_cleanup_workers(10, 0)`, "22023"},
		{app, `SELECT * FROM idem.idem_cleanup_workers(10, 'NaN')`, "22023"},
		{app, `SELECT * FROM idem.idem_cleanup_workers(10, 1, '2 hours')`, "22023"},
		{app, `SELECT * FROM idem.idem_cleanup_workers(10, 1, NULL)`, "22004"},
		// Operators.
		{app, `SELECT * FROM idem.idem_key(NULL, 'k')`, "22004"},
		{app, `SELECT * FROM idem.idem_key('p', 'a b')`, "22023"},
		{ops, `SELECT idem.idem_key_body('p', NULL)`, "22004"},
		{ops, `SELECT * FROM idem.idem_stuck(NULL)`, "22004"},
		{ops, `SELECT * FROM idem.idem_stuck('-1 s')`, "22023"},
		{ops, `SELECT * FROM idem.idem_stuck('1 day -25 hours')`, "22023"},
		{ops, `SELECT * FROM idem.idem_stuck('11 years')`, "22023"},
		{ops, `SELECT * FROM idem.idem_stuck('0', 0)`, "22023"},
		{ops, `SELECT * FROM idem.idem_stuck('0', 10001)`, "22023"},
		{ops, `SELECT idem.idem_release_stuck('p', 'live', NULL)`, "22004"},
		{ops, `SELECT idem.idem_release_stuck('p', 'live', ` + fmt.Sprint(tok) + `, repeat('r', 1001))`, "22023"},
		{ops, `SELECT idem.idem_release_stuck('', 'live', ` + fmt.Sprint(tok) + `)`, "22023"},
		// Role boundaries.
		{app, `SELECT idem.idem_key_body('p', 'live')`, "42501"},
		{app, `SELECT * FROM idem.idem_stuck()`, "42501"},
		{app, `SELECT idem.idem_release_stuck('p', 'live', ` + fmt.Sprint(tok) + `)`, "42501"},
		{app, `SELECT idem.installation_secret_values()`, "42501"},
		{app, `SELECT idem.provider_key_prefixes()`, "42501"},
		{app, `SELECT last_value FROM idem.installation_secret_1_1`, "42501"},
		{app, `SELECT pg_sequence_last_value('idem.installation_secret_1_1')`, "42501"},
		{app, `SELECT nextval('idem.token_seq')`, "42501"},
		{app, `SELECT * FROM idem.installation_secrets`, "42501"},
		{app, `SELECT * FROM idem.schema_version`, "42501"},
		{app, `CALL idem.idem_new_installation_secret()`, "42501"},
		{app, `CALL idem.cleanup_node(1, 1, 1)`, "42501"},
		{app, `SELECT idem.cleanup_relations(ARRAY['idem.idempotency_keys'::regclass], 10)`, "42501"},
		{app, `CREATE TABLE idem.x (a int)`, "42501"},
		{app, `CREATE SCHEMA zz`, "42501"},
		{app, `CREATE TABLE public.x (a int)`, "42501"},
		{ops, `SELECT * FROM idem.idem_begin('p', 'o', 'a', sha256('x'))`, "42501"},
		{ops, `SELECT idem.idem_cleanup()`, "42501"},
		{ops, `SELECT idem.idem_complete('p', 'live', ` + fmt.Sprint(tok) + `, 200, '{}', 'b')`, "42501"},
	}
	var before string
	snap := `SELECT coalesce(string_agg(format('%s/%s/%s/%s/%s/%s', principal_id, key, state, attempt, lease_expires_at, response_status), ',' ORDER BY principal_id, key), '') FROM idem.idempotency_keys`
	if err := admin.QueryRow(ctx, snap).Scan(&before); err != nil {
		t.Fatal(err)
	}
	for _, c := range cases {
		_, err := c.who.Exec(ctx, c.sql)
		if got := sqlCode(err); got != c.want {
			t.Errorf("%s\n  got %s (%v), want %s", c.sql, got, err, c.want)
		}
		var after string
		if err := admin.QueryRow(ctx, snap).Scan(&after); err != nil {
			t.Fatal(err)
		}
		if after != before {
			t.Errorf("%s\n  changed the table: %s -> %s", c.sql, before, after)
			before = after
		}
	}
}

// TestSaveFinalUnderRepeatableRead: docs/sql-api.md, "SQLSTATEs": under REPEATABLE READ, a
// save_final whose key was answered by another transaction after the snapshot raises 40001
// (the docs named idem_begin only), and the answer stored first stays.
func TestSaveFinalUnderRepeatableRead(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	app, _, url := appAndAdmin(t)
	other := pgtest.Connect(t, pgtest.LoginRole(t, url, "idem_app"))
	tx, err := app.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	pgtest.Exec(t, tx, `SELECT 1`)
	var stored bool
	if err := other.QueryRow(ctx, `SELECT idem.idem_save_final('p', 'rr', 'POST /x', sha256('x'), NULL, 404, '{}', 'gone')`).Scan(&stored); err != nil || !stored {
		t.Fatalf("first save_final: %v %v", stored, err)
	}
	err = tx.QueryRow(ctx, `SELECT idem.idem_save_final('p', 'rr', 'POST /x', sha256('x'), NULL, 410, '{}', 'other')`).Scan(&stored)
	if sqlCode(err) != "40001" {
		t.Errorf("idem_save_final under REPEATABLE READ on a key answered after the snapshot: %v, want 40001", err)
	}
	var status int
	if err := other.QueryRow(ctx, `SELECT response_status FROM idem.idem_key('p', 'rr')`).Scan(&status); err != nil || status != 404 {
		t.Errorf("the first answer: %d %v, want 404", status, err)
	}
}

// TestCleanupSkipsAHeldReclaim: docs/sql-api.md: cleanup skips rows locked by others and never
// removes a row whose lease still runs; a re-claim of an expired key holds the row. Two real
// connections: a transactional re-claim of an expired key is held open while another session
// cleans up; the cleanup must neither wait nor delete it, and the claim then completes.
func TestCleanupSkipsAHeldReclaim(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	app, admin, url := appAndAdmin(t)
	cleaner := pgtest.Connect(t, pgtest.LoginRole(t, url, "idem_app"))
	pgtest.InsertExpired(t, admin, "p", 3) // old-1 .. old-3, expired a day ago
	tx, err := app.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	var outcome string
	var tok int64
	if err := tx.QueryRow(ctx, `SELECT outcome, attempt FROM idem.idem_begin('p', 'old-2', 'POST /x', sha256('new'))`).Scan(&outcome, &tok); err != nil || outcome != "claimed" {
		t.Fatalf("re-claim: %q %v", outcome, err)
	}
	start := time.Now()
	var deleted int
	if err := cleaner.QueryRow(ctx, `SELECT idem.idem_cleanup(10)`).Scan(&deleted); err != nil {
		t.Fatal(err)
	}
	if deleted != 2 || time.Since(start) > time.Second {
		t.Errorf("cleanup beside a held re-claim: deleted %d (want 2) in %v", deleted, time.Since(start))
	}
	pgtest.Exec(t, tx, `SELECT idem.idem_complete('p', 'old-2', $1, 201, '{}', 'ok')`, tok)
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	var body string
	if err := cleaner.QueryRow(ctx, `SELECT outcome || ':' || convert_from(response_body, 'UTF8') FROM idem.idem_begin('p', 'old-2', 'POST /x', sha256('new'))`).Scan(&body); err != nil || body != "replay:ok" {
		t.Errorf("after the held re-claim committed: %q %v, want replay:ok", body, err)
	}
}

// TestLifecycleFencingAsTheApp: complete after release, release after complete, a yielded or
// released holder's calls, a token of another generation; inside a savepoint rolled back.
// docs/sql-api.md, "Who may do what to a lease claim".
func TestLifecycleFencingAsTheApp(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	app, _, _ := appAndAdmin(t)
	claim := func(key string) int64 {
		var tok int64
		if err := app.QueryRow(ctx, `SELECT attempt FROM idem.idem_begin('p', $1, 'POST /x', sha256('x'), p_lease => '1 hour')`, key).Scan(&tok); err != nil {
			t.Fatal(err)
		}
		return tok
	}
	expect := func(sql, want string, args ...any) {
		t.Helper()
		var got string
		err := app.QueryRow(ctx, `SELECT coalesce((`+sql+`)::text, 'null')`, args...).Scan(&got)
		if err != nil {
			got = sqlCode(err)
		}
		if got != want {
			t.Errorf("%s %v: got %s, want %s", sql, args, got, want)
		}
	}
	a := claim("a")
	expect(`SELECT idem.idem_release('p', 'a', $1)`, "true", a)
	expect(`SELECT idem.idem_complete('p', 'a', $1, 200, '{}', 'x')`, "55000", a)
	expect(`SELECT idem.idem_extend('p', 'a', $1, '1 hour')`, "55000", a)
	expect(`SELECT idem.idem_step('p', 'a', $1, 's')`, "55000", a)
	expect(`SELECT recovery_point FROM idem.idem_recovery('p', 'a', $1)`, "55000", a)
	expect(`SELECT idem.idem_yield('p', 'a', $1)`, "false", a)
	expect(`SELECT idem.idem_release('p', 'a', $1)`, "false", a)
	a2 := claim("a") // a new generation
	if a2 == a {
		t.Fatalf("same token after release")
	}
	expect(`SELECT idem.idem_complete('p', 'a', $1, 200, '{}', 'x')`, "55000", a)
	expect(`SELECT idem.idem_complete('p', 'a', $1, 200, '{}', 'x')`, "", a2)
	expect(`SELECT idem.idem_release('p', 'a', $1)`, "false", a2)
	expect(`SELECT idem.idem_yield('p', 'a', $1)`, "false", a2)
	expect(`SELECT idem.idem_save_final('p', 'a', 'POST /x', sha256('x'), NULL, 422, '{}', 'no')`, "false")

	b := claim("b")
	expect(`SELECT idem.idem_yield('p', 'b', $1)`, "true", b)
	expect(`SELECT idem.idem_complete('p', 'b', $1, 200, '{}', 'x')`, "55000", b)
	expect(`SELECT idem.idem_release('p', 'b', $1)`, "false", b)
	expect(`SELECT idem.idem_step('p', 'b', $1, 's')`, "55000", b)

	// A savepoint rolled back undoes a release.
	c := claim("c")
	tx, err := app.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, tx, `SAVEPOINT s`)
	pgtest.Exec(t, tx, `SELECT idem.idem_release('p', 'c', $1)`, c)
	pgtest.Exec(t, tx, `ROLLBACK TO SAVEPOINT s`)
	if _, err := tx.Exec(ctx, `SELECT idem.idem_complete('p', 'c', $1, 201, '{}', 'done')`, c); err != nil {
		t.Fatal(err)
	}
	// An aborted transaction stores nothing.
	if _, err := tx.Exec(ctx, `SELECT 1/0`); err == nil {
		t.Fatal("no error")
	}
	if _, err := tx.Exec(ctx, `SELECT idem.idem_complete('p', 'c', $1, 201, '{}', 'x')`, c); sqlCode(err) != "25P02" {
		t.Errorf("in an aborted transaction: %v", err)
	}
	_ = tx.Rollback(ctx)
	expect(`SELECT idem.idem_complete('p', 'c', $1, 201, '{}', 'y')`, "", c)
	var body string
	if err := app.QueryRow(ctx, `SELECT convert_from(response_body, 'UTF8') FROM idem.idem_begin('p', 'c', 'POST /x', sha256('x'))`).Scan(&body); err != nil || body != "y" {
		t.Errorf("replay: %q %v", body, err)
	}
}

// TestSaveFinalOfAnotherRequestInAClaimsOwnTransaction: once a transactional claim's TTL had
// run out, idem_save_final of another request in the claim's own transaction took the claim
// for an expired key, overwrote it with the other request's answer and cleared the commit
// guard: the transaction committed its work under another request's answer. It returns false
// now, and the COMMIT without the claim's own answer is refused.
func TestSaveFinalOfAnotherRequestInAClaimsOwnTransaction(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	app, _, _ := appAndAdmin(t)
	tx, _ := claimPastItsTTL(t, app)
	var stored bool
	if err := tx.QueryRow(ctx, `SELECT idem.idem_save_final('alice', 'k1', 'POST /v1/transfers', sha256('other'), NULL, 409, '{}', 'no')`).Scan(&stored); err != nil || stored {
		t.Errorf("idem_save_final of another request in the claim's own transaction: %v %v, want false", stored, err)
	}
	if err := tx.Commit(ctx); sqlCode(err) != "23503" {
		t.Errorf("COMMIT without the claim's answer: %v (want 23503)", err)
	}
}

package tests

// A DBA's and a non-Go service's fresh look at the SQL API (topic "DBA"): how the functions
// behave when they are called from SQL the way another language or a stored procedure calls
// them: arguments that carry a collation, principals and keys at their bounds in characters
// and bytes, calls inside a PL/pgSQL block with an EXCEPTION handler, cursors over the
// operators' functions, and what the operators' view says inside a claim's own transaction.

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/internal/pgtest"
)

// dbaScans reads how many sequential and index scans of the key table this transaction did.
func dbaScans(t *testing.T, tx pgx.Tx) (seq, idx int64) {
	t.Helper()
	if err := tx.QueryRow(context.Background(), `SELECT coalesce(seq_scan, 0), coalesce(idx_scan, 0)
		FROM pg_stat_xact_user_tables WHERE relid = 'idem.idempotency_keys'::regclass`).Scan(&seq, &idx); err != nil {
		t.Fatal(err)
	}
	return seq, idx
}

// TestSQLArgumentCollationKeepsThePrimaryKey: docs/sql-api.md, idem_begin, "Behaviour": "A
// fresh key costs one read of the primary key that finds nothing and one INSERT"; the API
// "answers the same whatever the caller's session settings", pins search_path and qualifies
// every name, so that nothing the caller brings changes what the functions run. A PL/pgSQL
// function's text parameters take the collation of the call's arguments, and in the
// functions' queries a non-default implicit collation wins over the key table's default one:
// a service whose own table declares its id columns COLLATE "C" (a common choice for keys)
// and passes them to idem_begin made `k.principal_id = p_principal AND k.key = p_key` a
// comparison in "C", which the primary key (default collation) cannot serve: every claim read
// the whole key table until D233, which compares in the default collation.
func TestSQLArgumentCollationKeepsThePrimaryKey(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	app, admin, _ := dbaApp(t)
	pgtest.InsertKeys(t, admin, "idem.idempotency_keys", "alice", "old", 50000, false)
	pgtest.Exec(t, admin, `ANALYZE idem.idempotency_keys`)
	var collate string
	if err := admin.QueryRow(ctx, `SELECT datcollate FROM pg_database WHERE datname = current_database()`).Scan(&collate); err == nil {
		t.Logf("the database's default collation: %s", collate)
	}
	// The service's own table: its ids COLLATE "C".
	pgtest.Exec(t, admin, `CREATE TABLE public.inbox (principal text COLLATE "C" NOT NULL, idem_key text COLLATE "C" NOT NULL,
		body bytea NOT NULL); GRANT SELECT ON public.inbox TO PUBLIC`)
	pgtest.Exec(t, admin, `INSERT INTO public.inbox VALUES ('alice', 'from-inbox-1', 'b1'), ('alice', 'from-inbox-2', 'b2')`)

	claim := func(label, sql string) (seq, idx int64, took time.Duration) {
		t.Helper()
		tx, err := app.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx)
		s0, i0 := dbaScans(t, tx)
		began := time.Now()
		var outcome string
		if err := tx.QueryRow(ctx, sql).Scan(&outcome); err != nil {
			t.Fatalf("%s: %v", label, err)
		}
		took = time.Since(began)
		if outcome != "claimed" {
			t.Fatalf("%s: %s", label, outcome)
		}
		// The stats of this transaction's own scans (pg_stat_xact_*) are live.
		s1, i1 := dbaScans(t, tx)
		return s1 - s0, i1 - i0, took
	}
	// Warm up both compiled copies (plpgsql compiles one per input collation).
	claim("warm plain", `SELECT outcome FROM idem.idem_begin('alice', 'warm-1', 'POST /x', sha256('w'))`)
	claim("warm C", `SELECT b.outcome FROM public.inbox AS i, idem.idem_begin(i.principal, i.idem_key, 'POST /x', sha256(i.body)) AS b
		WHERE i.idem_key = 'from-inbox-2'`)

	seq, idx, plain := claim("plain", `SELECT outcome FROM idem.idem_begin('alice', 'fresh-1', 'POST /x', sha256('b'))`)
	t.Logf("plain arguments: %d sequential scans, %d index scans, %v", seq, idx, plain)
	if seq != 0 {
		t.Fatalf("control: a plain call did %d sequential scans of the key table", seq)
	}
	seq, idx, withC := claim("COLLATE C", `SELECT b.outcome FROM public.inbox AS i, idem.idem_begin(i.principal, i.idem_key, 'POST /x', sha256(i.body)) AS b
		WHERE i.idem_key = 'from-inbox-1'`)
	t.Logf("arguments from columns COLLATE \"C\": %d sequential scans, %d index scans, %v", seq, idx, withC)
	if seq != 0 {
		t.Errorf("a fresh claim whose principal and key come from a table's COLLATE \"C\" columns read the key table "+
			"(50,000 keys) by %d sequential scan(s) in %v (the same claim with plain arguments: %v, through the primary key): "+
			"the caller's collation reaches the functions' comparisons", seq, withC, plain)
	}

	// The same for a literal with a COLLATE clause, and for the operators' idem_key.
	tx, err := app.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	s0, _ := dbaScans(t, tx)
	var n int
	if err := tx.QueryRow(ctx, `SELECT count(*) FROM idem.idem_key(p_principal => 'alice', p_key => 'old-7' COLLATE "C")`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	s1, _ := dbaScans(t, tx)
	if n != 1 || s1-s0 != 0 {
		t.Errorf("idem_key with p_key COLLATE \"C\": %d row(s), %d sequential scan(s) of the key table; want 1 row through the primary key", n, s1-s0)
	}
}

// TestSQLNondeterministicCollationArgument: the same with a case-insensitive (nondeterministic)
// ICU collation on the service's column, a common replacement for citext. Keys are visible
// ASCII and case-sensitive ("K1" and "k1" are two keys). Until D233 every function raised 0A000
// (a regular expression under a nondeterministic collation); since, K1 is a key of its own.
func TestSQLNondeterministicCollationArgument(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	app, admin, _ := dbaApp(t)
	if _, err := admin.Exec(ctx, `CREATE COLLATION public.ci (provider = icu, locale = 'und-u-ks-level2', deterministic = false)`); err != nil {
		t.Fatalf("no ICU collation: %v", err)
	}
	pgtest.Exec(t, admin, `CREATE TABLE public.inbox (principal text COLLATE public.ci NOT NULL, idem_key text COLLATE public.ci NOT NULL);
		GRANT SELECT ON public.inbox TO PUBLIC; INSERT INTO public.inbox VALUES ('alice', 'K1')`)
	// k1 (lower case) is answered first, with plain arguments.
	tx, err := app.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var attempt int64
	if err := tx.QueryRow(ctx, `SELECT attempt FROM idem.idem_begin('alice', 'k1', 'POST /x', sha256('b'))`).Scan(&attempt); err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `SELECT idem.idem_complete('alice', 'k1', $1, 201, '{}', 'first')`, attempt); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	var outcome string
	var body []byte
	tx2, err := app.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx2.Rollback(ctx) // a claim without its completion: the commit guard would refuse it
	err = tx2.QueryRow(ctx, `SELECT b.outcome, b.response_body FROM public.inbox AS i,
		idem.idem_begin(i.principal, i.idem_key, 'POST /x', sha256('b')) AS b`).Scan(&outcome, &body)
	t.Logf("K1 from a case-insensitive column: outcome %q body %q err %v (SQLSTATE %s)", outcome, body, err, sqlCode(err))
	if err != nil || outcome != "claimed" {
		t.Errorf("key K1 (from a column of a case-insensitive collation): outcome %q, body %q, %v; want claimed, a key of its own", outcome, body, err)
	}
}

// TestSQLPrincipalAndKeyBounds: docs/sql-api.md: p_principal "1 to 255 characters", p_key
// "1 to 255 visible ASCII characters"; 22023 past them, nothing written. A principal of 255
// four-byte characters (1,020 bytes) goes through every function that takes it (claim,
// complete, replay, the operators' views, a lease's stuck release and its takeover, the
// provider key), and one of 256 is refused everywhere.
func TestSQLPrincipalAndKeyBounds(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	app, admin, url := dbaApp(t)
	ops := pgtest.Connect(t, pgtest.LoginRole(t, url, "idem_operator"))
	p255 := strings.Repeat("𝄞", 255)
	p256 := strings.Repeat("𝄞", 256)
	k255 := strings.Repeat("~", 255)
	k256 := strings.Repeat("~", 256)

	tx, err := app.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var outcome, pk string
	var attempt int64
	if err := tx.QueryRow(ctx, `SELECT outcome, attempt, provider_key FROM idem.idem_begin($1, $2, 'POST /x', sha256('b'))`, p255, k255).
		Scan(&outcome, &attempt, &pk); err != nil || outcome != "claimed" {
		t.Fatalf("255 characters: %q %v", outcome, err)
	}
	if _, err := tx.Exec(ctx, `SELECT idem.idem_complete($1, $2, $3, 201, '{}', 'first')`, p255, k255, attempt); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	var pk2 string
	var body []byte
	if err := app.QueryRow(ctx, `SELECT outcome, response_body, provider_key FROM idem.idem_begin($1, $2, 'POST /x', sha256('b'))`, p255, k255).
		Scan(&outcome, &body, &pk2); err != nil || outcome != "replay" || string(body) != "first" || pk2 != pk {
		t.Errorf("replay at 255/255: %q %q %v (provider key kept: %v)", outcome, body, err, pk2 == pk)
	}
	var state string
	if err := ops.QueryRow(ctx, `SELECT state FROM idem.idem_key($1, $2)`, p255, k255).Scan(&state); err != nil || state != "completed" {
		t.Errorf("idem_key at 255/255: %q %v", state, err)
	}
	var got []byte
	if err := ops.QueryRow(ctx, `SELECT idem.idem_key_body($1, $2)`, p255, k255).Scan(&got); err != nil || string(got) != "first" {
		t.Errorf("idem_key_body at 255/255: %q %v", got, err)
	}
	// A lease of the longest principal, released as stuck by an operator, taken over.
	if err := app.QueryRow(ctx, `SELECT attempt FROM idem.idem_begin($1, 'lease', 'POST /x', sha256('l'), p_lease => '1 hour')`, p255).Scan(&attempt); err != nil {
		t.Fatal(err)
	}
	var sp string
	var sa int64
	if err := ops.QueryRow(ctx, `SELECT principal_id, attempt FROM idem.idem_stuck() WHERE key = 'lease'`).Scan(&sp, &sa); err != nil || sp != p255 || sa != attempt {
		t.Errorf("idem_stuck: %d characters, token %d, %v", len([]rune(sp)), sa, err)
	}
	if _, err := ops.Exec(ctx, `SELECT idem.idem_release_stuck($1, 'lease', $2, $3)`, p255, attempt, strings.Repeat("é", 1000)); err != nil {
		t.Errorf("idem_release_stuck, a reason of 1000 two-byte characters: %v", err)
	}
	if err := app.QueryRow(ctx, `SELECT outcome FROM idem.idem_begin($1, 'lease', 'POST /x', sha256('l'), p_lease => '1 hour')`, p255).Scan(&outcome); err != nil || outcome != "claimed" {
		t.Errorf("takeover after the release: %q %v", outcome, err)
	}

	// 256: refused by every function, 22023, nothing written.
	before := pgtest.Count(t, admin, `SELECT count(*) FROM idem.idempotency_keys`)
	for _, c := range []struct {
		conn *pgx.Conn
		sql  string
		args []any
	}{
		{app, `SELECT * FROM idem.idem_begin($1, 'k', 'POST /x', sha256('b'))`, []any{p256}},
		{app, `SELECT * FROM idem.idem_begin('p', $1, 'POST /x', sha256('b'))`, []any{k256}},
		{app, `SELECT * FROM idem.idem_begin_steps($1, 'k', 'POST /x', sha256('b'), p_lease => '1 minute')`, []any{p256}},
		{app, `SELECT idem.idem_save_final($1, 'k', 'POST /x', sha256('b'), NULL, 422, '{}', 'x')`, []any{p256}},
		{app, `SELECT idem.idem_save_final('p', $1, 'POST /x', sha256('b'), NULL, 422, '{}', 'x')`, []any{k256}},
		{app, `SELECT idem.idem_complete($1, 'k', 1, 200, '{}', NULL)`, []any{p256}},
		{app, `SELECT idem.idem_release($1, 'k', 1)`, []any{p256}},
		{app, `SELECT idem.idem_yield($1, 'k', 1)`, []any{p256}},
		{app, `SELECT idem.idem_extend($1, 'k', 1, '1 minute')`, []any{p256}},
		{app, `SELECT idem.idem_step($1, 'k', 1, 's')`, []any{p256}},
		{app, `SELECT * FROM idem.idem_recovery($1, 'k', 1)`, []any{p256}},
		{app, `SELECT * FROM idem.idem_key($1, 'k')`, []any{p256}},
		{ops, `SELECT idem.idem_key_body($1, 'k')`, []any{p256}},
		{ops, `SELECT idem.idem_release_stuck($1, 'k', 1)`, []any{p256}},
	} {
		code := dbaCode(ctx, c.conn, c.sql, c.args...)
		if code != "22023" {
			t.Errorf("%s with %d characters: %s, want 22023", c.sql, 256, code)
		}
	}
	if after := pgtest.Count(t, admin, `SELECT count(*) FROM idem.idempotency_keys`); after != before {
		t.Errorf("refused calls wrote %d rows", after-before)
	}
}

// dbaCode runs sql in a transaction that it rolls back and returns its SQLSTATE ("ok" without error).
func dbaCode(ctx context.Context, c *pgx.Conn, sql string, args ...any) string {
	tx, err := c.Begin(ctx)
	if err != nil {
		return "begin: " + err.Error()
	}
	defer tx.Rollback(ctx)
	rows, err := tx.Query(ctx, sql, args...)
	if err == nil {
		for rows.Next() {
		}
		rows.Close()
		err = rows.Err()
	}
	return sqlCode(err)
}

// TestSQLClaimInsideAnExceptionBlock: a service's stored procedure wraps its work in a
// PL/pgSQL block with an EXCEPTION handler (a subtransaction). The work fails after the claim:
// the handler's rollback takes the claim with it, a claim of the same key in the same
// transaction claims again (a new token), and the answer committed then is what a retry
// replays; the token of the rolled-back claim is fenced off.
func TestSQLClaimInsideAnExceptionBlock(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	app, _, _ := dbaApp(t)
	var first, second int64
	if _, err := app.Exec(ctx, `CREATE TEMP TABLE tokens (n int, attempt bigint);
		DO $$
		DECLARE r record;
		BEGIN
			BEGIN
				SELECT * INTO r FROM idem.idem_begin('alice', 'k1', 'POST /x', sha256('b'));
				INSERT INTO tokens VALUES (1, r.attempt);
				PERFORM 1 / 0; -- the work fails
			EXCEPTION WHEN division_by_zero THEN
				INSERT INTO tokens VALUES (1, r.attempt);
			END;
			SELECT * INTO r FROM idem.idem_begin('alice', 'k1', 'POST /x', sha256('b'));
			IF r.outcome <> 'claimed' THEN
				RAISE EXCEPTION 'second claim: %', r.outcome;
			END IF;
			INSERT INTO tokens VALUES (2, r.attempt);
			PERFORM idem.idem_complete('alice', 'k1', r.attempt, 201, '{}', 'second');
		END $$`, pgx.QueryExecModeSimpleProtocol); err != nil {
		t.Fatal(err)
	}
	if err := app.QueryRow(ctx, `SELECT (SELECT attempt FROM tokens WHERE n = 1), (SELECT attempt FROM tokens WHERE n = 2)`).Scan(&first, &second); err != nil {
		t.Fatal(err)
	}
	if first == second {
		t.Errorf("the claim after the rolled-back one reused its token %d", first)
	}
	var outcome string
	var body []byte
	if err := app.QueryRow(ctx, `SELECT outcome, response_body FROM idem.idem_begin('alice', 'k1', 'POST /x', sha256('b'))`).Scan(&outcome, &body); err != nil ||
		outcome != "replay" || string(body) != "second" {
		t.Errorf("retry: %q %q %v", outcome, body, err)
	}
	if code := dbaCode(ctx, app, `SELECT idem.idem_complete('alice', 'k1', $1, 200, '{}', NULL)`, first); code != "55000" {
		t.Errorf("the rolled-back claim's token completing: %s, want 55000", code)
	}
}

// TestSQLCursorsOverTheOperatorsFunctions: an operator's psql session pages through the
// stuck claims with a cursor (FETCH 1 at a time, WITH HOLD across commits) and releases each
// with the token it read.
func TestSQLCursorsOverTheOperatorsFunctions(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	app, _, url := dbaApp(t)
	ops := pgtest.Connect(t, pgtest.LoginRole(t, url, "idem_operator"))
	for _, k := range []string{"a", "b", "c"} {
		pgtest.Exec(t, app, `SELECT * FROM idem.idem_begin('bob', $1, 'POST /payouts', sha256(convert_to($1, 'UTF8')), p_lease => '1 hour')`, k)
	}
	pgtest.Exec(t, ops, `BEGIN`)
	pgtest.Exec(t, ops, `DECLARE stuck CURSOR WITH HOLD FOR SELECT principal_id, key, attempt FROM idem.idem_stuck() ORDER BY key`)
	pgtest.Exec(t, ops, `COMMIT`)
	released := 0
	for {
		var p, k string
		var a int64
		err := ops.QueryRow(ctx, `FETCH NEXT FROM stuck`).Scan(&p, &k, &a)
		if err == pgx.ErrNoRows {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		if _, err := ops.Exec(ctx, `SELECT idem.idem_release_stuck($1, $2, $3, 'paged')`, p, k, a); err != nil {
			t.Errorf("release %s: %v", k, err)
		}
		released++
	}
	pgtest.Exec(t, ops, `CLOSE stuck`)
	if released != 3 {
		t.Errorf("released %d of 3", released)
	}
	if n := pgtest.Count(t, ops, `SELECT count(*) FROM idem.idem_stuck()`); n != 0 {
		t.Errorf("%d still listed as stuck", n)
	}
	var lt string
	if err := ops.QueryRow(ctx, `SHOW lock_timeout`).Scan(&lt); err != nil || lt != "0" {
		t.Errorf("the session's lock_timeout after the cursor: %q %v", lt, err)
	}
}

// TestSQLKeyStoryInsideItsOwnTransaction: docs/sql-api.md, "How long a key lives": "While the
// work runs the key is held whatever its age ... That holds inside the claim's own transaction
// too: there, once the claim's TTL has passed, a second idem_begin of the same request still
// answers in_progress ..., and idem_cleanup does not delete the claim". idem_key's `expired`
// is documented as "absent to the API, its next request claims it anew", and idem_summary's
// `expired` as "the keys that cleanup has not deleted yet (the backlog)". In the claim's own
// transaction past its TTL (a service debugging its slow transaction, as a DBA would), the
// operators' view should agree with idem_begin and idem_cleanup; until D233 idem_key called the
// claim expired and idem_summary and idem_health counted it in the backlog.
func TestSQLKeyStoryInsideItsOwnTransaction(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	app, _, _ := dbaApp(t)
	tx, err := app.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	var outcome string
	if err := tx.QueryRow(ctx, `SELECT outcome FROM idem.idem_begin('alice', 'slow', 'POST /x', sha256('b'), p_ttl => '50 milliseconds')`).Scan(&outcome); err != nil || outcome != "claimed" {
		t.Fatalf("%q %v", outcome, err)
	}
	time.Sleep(200 * time.Millisecond)
	if err := tx.QueryRow(ctx, `SELECT outcome FROM idem.idem_begin('alice', 'slow', 'POST /x', sha256('b'))`).Scan(&outcome); err != nil || outcome != "in_progress" {
		t.Fatalf("second idem_begin in the claim's transaction: %q %v (documented: in_progress)", outcome, err)
	}
	var deleted int
	if err := tx.QueryRow(ctx, `SELECT idem.idem_cleanup(1000)`).Scan(&deleted); err != nil || deleted != 0 {
		t.Fatalf("cleanup in the claim's transaction: %d %v (documented: not deleted)", deleted, err)
	}
	var expired bool
	if err := tx.QueryRow(ctx, `SELECT expired FROM idem.idem_key('alice', 'slow')`).Scan(&expired); err != nil {
		t.Fatal(err)
	}
	var summaryExpired int64
	if err := tx.QueryRow(ctx, `SELECT expired FROM idem.idem_summary()`).Scan(&summaryExpired); err != nil {
		t.Fatal(err)
	}
	var backlog int64
	if err := tx.QueryRow(ctx, `SELECT cleanup_backlog FROM idem.idem_health()`).Scan(&backlog); err != nil {
		t.Fatal(err)
	}
	if backlog != 0 {
		t.Errorf("idem_health counts %d keys in the cleanup backlog, where cleanup deletes none", backlog)
	}
	if expired || summaryExpired != 0 {
		t.Errorf("in the claim's own transaction past its TTL, where idem_begin answers in_progress and idem_cleanup keeps the claim: "+
			"idem_key says expired=%v (\"absent to the API, its next request claims it anew\"), idem_summary counts %d expired (\"the backlog\")",
			expired, summaryExpired)
	}
}

// TestSQLCleanupAllUnderAStatementTimeout: PostgreSQL counts statement_timeout per statement,
// and a CALL is one statement however many transactions the procedure commits: a role's or a
// database's statement_timeout bounds the whole of idem_cleanup_all, as docs/sql-api.md says
// (D233). Past it the procedure stops with 57014; every batch before it stays committed, and
// the next call goes on from there.
func TestSQLCleanupAllUnderAStatementTimeout(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	app, admin, _ := dbaApp(t)
	pgtest.InsertExpired(t, admin, "alice", 20000)
	if _, err := app.Exec(ctx, `SET statement_timeout = '300ms'`); err != nil {
		t.Fatal(err)
	}
	_, err := app.Exec(ctx, `CALL idem.idem_cleanup_all(1)`)
	if code := sqlCode(err); code != "57014" {
		t.Fatalf("CALL idem_cleanup_all(1) over 20,000 expired keys under a 300 ms statement_timeout: %v (SQLSTATE %q), want 57014", err, code)
	}
	left := pgtest.Count(t, admin, `SELECT count(*) FROM idem.idempotency_keys`)
	if left == 0 || left == 20000 {
		t.Fatalf("%d keys left after the cut call: want its committed batches deleted and the rest left", left)
	}
	if _, err := app.Exec(ctx, `SET statement_timeout = 0`); err != nil {
		t.Fatal(err)
	}
	var deleted int64
	if err := app.QueryRow(ctx, `CALL idem.idem_cleanup_all(5000)`).Scan(&deleted); err != nil || deleted != int64(left) {
		t.Fatalf("the next call: %d deleted, %v; want the %d left", deleted, err, left)
	}
}

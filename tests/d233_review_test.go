package tests

// An adversarial review of D233 (topic D233Review): every public function of schema idem that
// takes text, called with arguments that carry COLLATE "C" and a nondeterministic ICU
// collation, must answer as the plain call does and find keys through the primary key; the
// operators' view of a transactional claim inside its own transaction must agree with
// idem_begin and idem_cleanup.

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/internal/pgtest"
)

// d233Call runs one statement under a savepoint (an expected error does not end the
// transaction) and returns its rows as text, or "ERR <sqlstate>".
func d233Call(t *testing.T, tx pgx.Tx, sql string, args ...any) string {
	t.Helper()
	ctx := context.Background()
	if _, err := tx.Exec(ctx, "SAVEPOINT zz"); err != nil {
		t.Fatal(err)
	}
	rows, err := tx.Query(ctx, sql, args...)
	var out []string
	if err == nil {
		for rows.Next() {
			vals, verr := rows.Values()
			if verr != nil {
				err = verr
				break
			}
			parts := make([]string, len(vals))
			for i, v := range vals {
				if b, ok := v.([]byte); ok {
					v = string(b)
				}
				parts[i] = fmt.Sprint(v)
			}
			out = append(out, strings.Join(parts, "|"))
		}
		rows.Close()
		if err == nil {
			err = rows.Err()
		}
	}
	if err != nil {
		if _, rerr := tx.Exec(ctx, "ROLLBACK TO SAVEPOINT zz"); rerr != nil {
			t.Fatal(rerr)
		}
		return "ERR " + sqlCode(err)
	}
	if _, err := tx.Exec(ctx, "RELEASE SAVEPOINT zz"); err != nil {
		t.Fatal(err)
	}
	return strings.Join(out, ";")
}

func d233Int(t *testing.T, tx pgx.Tx, sql string) int64 {
	t.Helper()
	var n int64
	if err := tx.QueryRow(context.Background(), sql).Scan(&n); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	return n
}

// d233Scenario runs every text-taking function of the API with text arguments that carry col
// (" COLLATE ..." or ""), keys prefixed by pre, and returns what each answered (no tokens, no
// times) and the sequential scans of the key table each transaction made.
func d233Scenario(t *testing.T, conn *pgx.Conn, pre, col string) (log []string, seqs []int64) {
	t.Helper()
	ctx := context.Background()
	lit := func(s string) string { return "('" + s + "'" + col + ")" }
	P, A, A2 := lit("alice"), lit("POST /x"), lit("POST /y")
	K := func(n string) string { return lit(pre + "-" + n) }
	KU := func(n string) string { return lit(strings.ToUpper(pre + "-" + n)) }
	fields := `'{"amount":"0123456789abcdef0123", "Note":"fedcba9876543210"}'`
	fields2 := `'{"amount":"1123456789abcdef0123", "Note":"fedcba9876543210"}'`
	var txn pgx.Tx
	begin := func() {
		var err error
		if txn, err = conn.Begin(ctx); err != nil {
			t.Fatal(err)
		}
	}
	end := func(label string, commit bool) {
		seqs = append(seqs, d233Int(t, txn, `SELECT coalesce(seq_scan, 0) FROM pg_stat_xact_user_tables WHERE relid = 'idem.idempotency_keys'::regclass`))
		var err error
		if commit {
			err = txn.Commit(ctx)
		} else {
			err = txn.Rollback(ctx)
		}
		if err != nil {
			t.Fatalf("%s: %v", label, err)
		}
	}
	add := func(label, got string) { log = append(log, label+": "+got) }

	// A transactional claim, its recovery, its completion.
	begin()
	a := d233Int(t, txn, fmt.Sprintf(`SELECT attempt FROM idem.idem_begin(%s, %s, %s, sha256('b'), p_request_fields => %s)`, P, K("k1"), A, fields))
	add("recovery (transactional)", d233Call(t, txn, fmt.Sprintf(`SELECT * FROM idem.idem_recovery(%s, %s, %d)`, P, K("k1"), a)))
	add("complete", d233Call(t, txn, fmt.Sprintf(`SELECT idem.idem_complete(%s, %s, %d, 201, '{"Location":"/x/1"}', 'body1', %s, NULL)`, P, K("k1"), a, lit("res-1"))))
	add("complete again", d233Call(t, txn, fmt.Sprintf(`SELECT idem.idem_complete(%s, %s, %d, 201, '{}', 'x')`, P, K("k1"), a)))
	end("tx1", true)

	// Replays, mismatches, the operators' view, idem_save_final and its withheld reasons.
	begin()
	add("replay", d233Call(t, txn, fmt.Sprintf(`SELECT outcome, response_status, response_headers, response_body, resource_id, withheld, changed_fields
		FROM idem.idem_begin(%s, %s, %s, sha256('b'), p_request_fields => %s)`, P, K("k1"), A, fields)))
	add("mismatch body", d233Call(t, txn, fmt.Sprintf(`SELECT outcome, changed_fields FROM idem.idem_begin(%s, %s, %s, sha256('c'), p_request_fields => %s)`, P, K("k1"), A, fields2)))
	add("mismatch action", d233Call(t, txn, fmt.Sprintf(`SELECT outcome, changed_fields FROM idem.idem_begin(%s, %s, %s, sha256('b'))`, P, K("k1"), A2)))
	add("replay of the plain call's key", d233Call(t, txn, fmt.Sprintf(`SELECT outcome, response_body, provider_key FROM idem.idem_begin(%s, %s, %s, sha256('b'))`,
		P, lit("plain-k1"), A)))
	add("key", d233Call(t, txn, fmt.Sprintf(`SELECT state, expired, kept_until IS NOT NULL, action_hash, field_names, response_status, response_headers, resource_id, withheld, body_bytes
		FROM idem.idem_key(%s, %s)`, P, K("k1"))))
	add("key of the plain call's key", d233Call(t, txn, fmt.Sprintf(`SELECT state, action_hash FROM idem.idem_key(%s, %s)`, P, lit("plain-k1"))))
	add("key body", d233Call(t, txn, fmt.Sprintf(`SELECT idem.idem_key_body(%s, %s)`, P, K("k1"))))
	add("key, other case", d233Call(t, txn, fmt.Sprintf(`SELECT count(*) FROM idem.idem_key(%s, %s)`, P, KU("k1"))))
	add("key, principal in other case", d233Call(t, txn, fmt.Sprintf(`SELECT count(*) FROM idem.idem_key(%s, %s)`, lit("ALICE"), K("k1"))))
	add("key body, other case", d233Call(t, txn, fmt.Sprintf(`SELECT idem.idem_key_body(%s, %s) IS NULL`, P, KU("k1"))))
	add("save_final secret", d233Call(t, txn, fmt.Sprintf(`SELECT idem.idem_save_final(%s, %s, %s, sha256('s'), '1 hour', 400, '{}', NULL, NULL, %s, %s)`,
		P, K("k2"), A, lit("one_time_secret"), lit("res-2"))))
	add("save_final SECRET", d233Call(t, txn, fmt.Sprintf(`SELECT idem.idem_save_final(%s, %s, %s, sha256('s'), '1 hour', 400, '{}', NULL, NULL, %s)`,
		P, K("k2b"), A, lit("ONE_TIME_SECRET"))))
	add("save_final Too_Large", d233Call(t, txn, fmt.Sprintf(`SELECT idem.idem_save_final(%s, %s, %s, sha256('s'), '1 hour', 400, '{}', NULL, NULL, %s)`,
		P, K("k2c"), A, lit("Too_Large"))))
	add("replay withheld", d233Call(t, txn, fmt.Sprintf(`SELECT outcome, response_status, resource_id, withheld FROM idem.idem_begin(%s, %s, %s, sha256('s'))`, P, K("k2"), A)))
	add("save_final on a live key", d233Call(t, txn, fmt.Sprintf(`SELECT idem.idem_save_final(%s, %s, %s, sha256('b'), '1 hour', 400, '{}', 'x')`, P, K("k1"), A)))
	add("complete SECRET", d233Call(t, txn, fmt.Sprintf(`SELECT idem.idem_complete(%s, %s, 1, 200, '{}', NULL, NULL, %s)`, P, K("k1"), lit("ONE_TIME_SECRET"))))
	add("key invalid", d233Call(t, txn, fmt.Sprintf(`SELECT count(*) FROM idem.idem_key(%s, %s)`, P, lit("a b"))))
	add("begin invalid key", d233Call(t, txn, fmt.Sprintf(`SELECT outcome FROM idem.idem_begin(%s, %s, %s, sha256('b'))`, P, lit("é"), A)))
	end("tx2", true)

	// A lease claim, its steps, its extension, its yield and takeover, the operators' release,
	// a takeover again, its release.
	begin()
	b := d233Int(t, txn, fmt.Sprintf(`SELECT attempt FROM idem.idem_begin_steps(%s, %s, %s, sha256('l'), p_lease => '1 minute')`, P, K("k3"), A))
	end("tx3a", true)
	begin()
	add("step", d233Call(t, txn, fmt.Sprintf(`SELECT idem.idem_step(%s, %s, %d, %s, '{"x":1}')`, P, K("k3"), b, lit("s1"))))
	add("step again", d233Call(t, txn, fmt.Sprintf(`SELECT idem.idem_step(%s, %s, %d, %s, '{"x":2}')`, P, K("k3"), b, lit("s1"))))
	add("step other case", d233Call(t, txn, fmt.Sprintf(`SELECT idem.idem_step(%s, %s, %d, %s, '{"x":3}')`, P, K("k3"), b, lit("S1"))))
	add("extend", d233Call(t, txn, fmt.Sprintf(`SELECT idem.idem_extend(%s, %s, %d, '2 minutes') > now()`, P, K("k3"), b)))
	add("recovery", d233Call(t, txn, fmt.Sprintf(`SELECT * FROM idem.idem_recovery(%s, %s, %d)`, P, K("k3"), b)))
	add("recovery, other case", d233Call(t, txn, fmt.Sprintf(`SELECT * FROM idem.idem_recovery(%s, %s, %d)`, P, KU("k3"), b)))
	add("in progress", d233Call(t, txn, fmt.Sprintf(`SELECT outcome, retry_after > '1 minute' FROM idem.idem_begin(%s, %s, %s, sha256('l'), p_lease => '1 minute')`, P, K("k3"), A)))
	end("tx3b", true)
	begin()
	add("yield other case", d233Call(t, txn, fmt.Sprintf(`SELECT idem.idem_yield(%s, %s, %d)`, P, KU("k3"), b)))
	add("yield", d233Call(t, txn, fmt.Sprintf(`SELECT idem.idem_yield(%s, %s, %d)`, P, K("k3"), b)))
	c := d233Int(t, txn, fmt.Sprintf(`SELECT attempt FROM idem.idem_begin_steps(%s, %s, %s, sha256('l'), p_lease => '1 minute')`, P, K("k3"), A))
	add("takeover's steps", d233Call(t, txn, fmt.Sprintf(`SELECT recovery_point, recovery_saved FROM idem.idem_recovery(%s, %s, %d)`, P, K("k3"), c)))
	end("tx4", true)
	begin()
	add("release_stuck other case", d233Call(t, txn, fmt.Sprintf(`SELECT idem.idem_release_stuck(%s, %s, %d, %s)`, P, KU("k3"), c, lit("stuck"))))
	add("release_stuck", d233Call(t, txn, fmt.Sprintf(`SELECT idem.idem_release_stuck(%s, %s, %d, %s)`, P, K("k3"), c, lit("stuck"))))
	d := d233Int(t, txn, fmt.Sprintf(`SELECT attempt FROM idem.idem_begin(%s, %s, %s, sha256('l'), p_lease => '1 minute')`, P, K("k3"), A))
	add("release other case", d233Call(t, txn, fmt.Sprintf(`SELECT idem.idem_release(%s, %s, %d)`, P, KU("k3"), d)))
	add("extend other case", d233Call(t, txn, fmt.Sprintf(`SELECT idem.idem_extend(%s, %s, %d, '2 minutes')`, P, KU("k3"), d)))
	add("complete other case", d233Call(t, txn, fmt.Sprintf(`SELECT idem.idem_complete(%s, %s, %d, 200, '{}', 'x')`, P, KU("k3"), d)))
	add("release", d233Call(t, txn, fmt.Sprintf(`SELECT idem.idem_release(%s, %s, %d)`, P, K("k3"), d)))
	add("release again", d233Call(t, txn, fmt.Sprintf(`SELECT idem.idem_release(%s, %s, %d)`, P, K("k3"), d)))
	add("key released", d233Call(t, txn, fmt.Sprintf(`SELECT state, expired FROM idem.idem_key(%s, %s)`, P, K("k3"))))
	end("tx5", true)

	// Case: another key; a transactional claim refused by idem_release.
	begin()
	add("begin other case", d233Call(t, txn, fmt.Sprintf(`SELECT outcome FROM idem.idem_begin(%s, %s, %s, sha256('b'))`, P, KU("k1"), A)))
	e := d233Int(t, txn, fmt.Sprintf(`SELECT attempt FROM idem.idem_begin(%s, %s, %s, sha256('t'))`, P, K("k4"), A))
	add("release transactional", d233Call(t, txn, fmt.Sprintf(`SELECT idem.idem_release(%s, %s, %d)`, P, K("k4"), e)))
	add("in progress own", d233Call(t, txn, fmt.Sprintf(`SELECT outcome FROM idem.idem_begin(%s, %s, %s, sha256('t'))`, P, K("k4"), A)))
	add("save_final own", d233Call(t, txn, fmt.Sprintf(`SELECT idem.idem_save_final(%s, %s, %s, sha256('t'), '1 hour', 422, '{}', 'no')`, P, K("k4"), A)))
	add("key own", d233Call(t, txn, fmt.Sprintf(`SELECT state, response_status FROM idem.idem_key(%s, %s)`, P, K("k4"))))
	end("tx6", false)
	return log, seqs
}

// TestD233ReviewEveryFunctionInEveryCollation: D233 / docs/sql-api.md: the API "finds a key
// through the primary key whatever collation the caller's arguments carry ... the functions
// compare in the database's default collation, the key table's, so keys are case-sensitive and
// each call stays one read of the index". Every function that takes text, called with text
// arguments COLLATE "C" and COLLATE a case-insensitive ICU collation, answers as the plain call
// does and reads the key table (20,000 keys) only through its indexes.
func TestD233ReviewEveryFunctionInEveryCollation(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.NewDB(t)
	admin := pgtest.Connect(t, url)
	if _, err := admin.Exec(ctx, `CREATE COLLATION public.ci (provider = icu, locale = 'und-u-ks-level2', deterministic = false)`); err != nil {
		t.Fatalf("no ICU collation: %v", err)
	}
	pgtest.InsertKeys(t, admin, "idem.idempotency_keys", "alice", "old", 20000, false)
	pgtest.Exec(t, admin, `ANALYZE idem.idempotency_keys`)
	// The operators' functions are granted to idem_operator, the others to idem_app: a login
	// role in both.
	app := pgtest.Connect(t, pgtest.LoginRole(t, url, "idem_app"))
	var role string
	if err := app.QueryRow(ctx, `SELECT current_user`).Scan(&role); err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, admin, fmt.Sprintf(`GRANT idem_operator TO %q`, role))

	plain, plainSeqs := d233Scenario(t, app, "plain", "")
	for i, s := range plainSeqs {
		if s != 0 {
			t.Fatalf("control: transaction %d of plain calls did %d sequential scans of the key table", i+1, s)
		}
	}
	t.Logf("plain:\n%s", strings.Join(plain, "\n"))
	for _, v := range []struct{ pre, col string }{{"c", ` COLLATE "C"`}, {"ci", ` COLLATE public.ci`}, {"posix", ` COLLATE "POSIX"`}} {
		got, seqs := d233Scenario(t, app, v.pre, v.col)
		for i := range plain {
			if i >= len(got) || got[i] != plain[i] {
				g := "(none)"
				if i < len(got) {
					g = got[i]
				}
				t.Errorf("%s: %s, where the plain call answered %s", v.col, g, plain[i])
			}
		}
		for i, s := range seqs {
			if s != 0 {
				t.Errorf("%s: transaction %d did %d sequential scan(s) of the key table (20,000 keys)", v.col, i+1, s)
			}
		}
	}
}

// TestD233ReviewOwnClaimPastItsTTL: D233: "idem_key said expired ... They now use cleanup's
// rule: a transactional claim in progress (uncompleted) is never expired." In its own
// transaction, past its TTL, such a claim is in progress to idem_begin, kept by idem_cleanup,
// not expired to idem_key, idem_summary and idem_health. idem_release_stuck, asked about it by
// the same session, must not say it expired ("it is absent, and the next request claims it
// anew": idem_begin answers in_progress), but that it is not a lease claim (D233's first build
// said it expired).
func TestD233ReviewOwnClaimPastItsTTL(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.NewDB(t)
	admin := pgtest.Connect(t, url)
	tx, err := admin.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	a := d233Int(t, tx, `SELECT attempt FROM idem.idem_begin('alice', 'own', 'POST /x', sha256('b'), p_ttl => '1 millisecond')`)
	pgtest.Exec(t, tx, `SELECT pg_sleep(0.05)`)
	got := map[string]string{
		"idem_begin":      d233Call(t, tx, `SELECT outcome FROM idem.idem_begin('alice', 'own', 'POST /x', sha256('b'))`),
		"idem_key":        d233Call(t, tx, `SELECT state, expired FROM idem.idem_key('alice', 'own')`),
		"idem_summary":    d233Call(t, tx, `SELECT in_progress, expired FROM idem.idem_summary()`),
		"idem_health":     d233Call(t, tx, `SELECT cleanup_backlog FROM idem.idem_health()`),
		"idem_cleanup":    d233Call(t, tx, `SELECT idem.idem_cleanup(100)`),
		"idem_recovery":   d233Call(t, tx, fmt.Sprintf(`SELECT count(*) FROM idem.idem_recovery('alice', 'own', %d)`, a)),
		"idem_save_final": d233Call(t, tx, `SELECT idem.idem_save_final('alice', 'own', 'POST /y', sha256('z'), '1 hour', 422, '{}', 'no')`),
	}
	want := map[string]string{
		"idem_begin": "in_progress", "idem_key": "in_progress|false", "idem_summary": "1|0", "idem_health": "0",
		"idem_cleanup": "0", "idem_recovery": "1", "idem_save_final": "false",
	}
	for k, w := range want {
		if got[k] != w {
			t.Errorf("%s: %s, want %s", k, got[k], w)
		}
	}
	_, err = tx.Exec(ctx, "SAVEPOINT s")
	if err != nil {
		t.Fatal(err)
	}
	_, err = tx.Exec(ctx, fmt.Sprintf(`SELECT idem.idem_release_stuck('alice', 'own', %d, 'check')`, a))
	t.Logf("idem_release_stuck: %v", err)
	if err == nil || !strings.Contains(err.Error(), "not a lease claim") {
		t.Errorf("idem_release_stuck on a transactional claim in its own transaction, past its TTL: %v; "+
			"want 55000 \"the claim is not a lease claim\" (idem_begin answers in_progress, idem_key says not expired, cleanup keeps it)", err)
	}
}

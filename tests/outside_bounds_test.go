package tests

// Black-box probes of docs/sql-api.md, written from the docs alone, as the application role (and
// the operator role where the docs name it).

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/internal/pgtest"
)

// execState runs sql in its own transaction on conn and returns the SQLSTATE ("ok" when none).
func execState(t *testing.T, conn *pgx.Conn, sql string, args ...any) string {
	t.Helper()
	ctx := context.Background()
	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	rows, err := tx.Query(ctx, sql, args...)
	if err == nil {
		for rows.Next() {
		}
		rows.Close()
		err = rows.Err()
	}
	if err == nil {
		return "ok"
	}
	return sqlCode(err)
}

// TestOutsideArgumentRanges: docs/sql-api.md "SQLSTATEs": 22023 for "status outside 100 to
// 599; headers not an object of strings; field hashes not an object of hex digests; unknown
// p_withheld, or a body with it; batch size below 1; idem_stuck's age negative in any part or
// over 10 years; idem_release_stuck's reason over 1,000 characters", 22004 for a NULL version
// of idem_serves_version, and the bounds the docs give each argument (p_lock_timeout "at most
// 2,147,483.647 seconds", idem_stuck's p_limit "1 to 10,000", p_action "1 to 1000
// characters", a field hash's first 16 characters read, "what follows them is not read").
func TestOutsideArgumentRanges(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	app, admin, url, _ := appSession(t, false)
	op := pgtest.Connect(t, pgtest.LoginRole(t, url, "idem_operator"))
	_ = admin
	begin := func(key, extra string) string {
		return `SELECT * FROM idem.idem_begin(p_principal => 'p', p_key => '` + key + `', p_action => 'POST /x',
			p_request_sha256 => sha256('b'::bytea)` + extra + `)`
	}
	// a claimed transactional key completed with the given arguments
	complete := func(key, args string) string {
		return `WITH c AS (SELECT attempt FROM idem.idem_begin(p_principal => 'p', p_key => '` + key + `',
			p_action => 'POST /x', p_request_sha256 => sha256('b'::bytea)))
			SELECT idem.idem_complete(p_principal => 'p', p_key => '` + key + `', p_attempt => (SELECT attempt FROM c), ` + args + `) FROM c`
	}
	h16 := "0123456789abcdef"
	cases := []struct {
		conn *pgx.Conn
		sql  string
		want string
	}{
		{app, begin("lt-max", `, p_lock_timeout => '2147483.647 seconds'`), "ok"},
		{app, begin("lt-over", `, p_lock_timeout => '2147483.648 seconds'`), "22023"},
		{app, begin("act-1000", ``), "ok"},
		{app, strings.Replace(begin("act-1000e", ``), "'POST /x'", "'"+strings.Repeat("é", 1000)+"'", 1), "ok"},
		{app, strings.Replace(begin("act-1001", ``), "'POST /x'", "'"+strings.Repeat("a", 1001)+"'", 1), "22023"},
		{app, strings.Replace(begin("act-0", ``), "'POST /x'", "''", 1), "22023"},
		{app, begin("rf-16", `, p_request_fields => '{"a":"`+h16+`"}'`), "ok"},
		{app, begin("rf-16junk", `, p_request_fields => '{"a":"`+h16+`xx not read"}'`), "ok"},
		{app, begin("rf-64", `, p_request_fields => '{"a":"`+strings.Repeat(h16, 4)+`"}'`), "ok"},
		{app, begin("rf-15", `, p_request_fields => '{"a":"`+h16[:15]+`"}'`), "22023"},
		{app, begin("rf-num", `, p_request_fields => '{"a":1}'`), "22023"},
		{app, begin("rf-arr", `, p_request_fields => '[]'`), "22023"},
		{app, begin("rf-g", `, p_request_fields => '{"a":"`+h16[:15]+`g"}'`), "22023"},
		{app, begin("rf-sp", `, p_request_fields => '{"a":" `+h16[:15]+`"}'`), "22023"},
		{app, begin("rf-upper", `, p_request_fields => '{"a":"`+strings.ToUpper(h16)+`"}'`), "ok"},
		{app, complete("st-99", `p_status => 99, p_headers => '{}', p_body => NULL`), "22023"},
		{app, complete("st-100", `p_status => 100, p_headers => '{}', p_body => NULL`), "ok"},
		{app, complete("st-599", `p_status => 599, p_headers => '{}', p_body => NULL`), "ok"},
		{app, complete("st-600", `p_status => 600, p_headers => '{}', p_body => NULL`), "22023"},
		{app, complete("hd-num", `p_status => 200, p_headers => '{"a":1}', p_body => NULL`), "22023"},
		{app, complete("hd-arr", `p_status => 200, p_headers => '["a"]', p_body => NULL`), "22023"},
		{app, complete("hd-str", `p_status => 200, p_headers => '"a"', p_body => NULL`), "22023"},
		{app, complete("hd-null", `p_status => 200, p_headers => '{"a":null}', p_body => NULL`), "22023"},
		{app, complete("hd-obj", `p_status => 200, p_headers => '{"a":{}}', p_body => NULL`), "22023"},
		{app, complete("wh-bogus", `p_status => 200, p_headers => '{}', p_body => NULL, p_withheld => 'bogus'`), "22023"},
		{app, complete("wh-body", `p_status => 200, p_headers => '{}', p_body => 'x', p_withheld => 'too_large'`), "22023"},
		{app, complete("wh-ok", `p_status => 200, p_headers => '{}', p_body => NULL, p_withheld => 'one_time_secret'`), "ok"},
		{app, `SELECT idem.idem_cleanup(0)`, "22023"},
		{app, `SELECT idem.idem_cleanup(1)`, "ok"},
		{app, `SELECT idem.idem_serves_version(NULL)`, "22004"},
		{op, `SELECT * FROM idem.idem_stuck('-1 second')`, "22023"},
		{op, `SELECT * FROM idem.idem_stuck('1 day -1 second')`, "22023"},
		{op, `SELECT * FROM idem.idem_stuck('10 years')`, "ok"},
		{op, `SELECT * FROM idem.idem_stuck('10 years 1 second')`, "22023"},
		{op, `SELECT * FROM idem.idem_stuck('0', 0)`, "22023"},
		{op, `SELECT * FROM idem.idem_stuck('0', 1)`, "ok"},
		{op, `SELECT * FROM idem.idem_stuck('0', 10000)`, "ok"},
		{op, `SELECT * FROM idem.idem_stuck('0', 10001)`, "22023"},
		{app, `SELECT * FROM idem.idem_stuck()`, "42501"},
		{app, `SELECT idem.idem_key_body('p', 'k')`, "42501"},
		{app, `SELECT idem.idem_release_stuck('p', 'k', 1)`, "42501"},
		{op, begin("op-begin", ``), "42501"},
		{op, `SELECT idem.idem_cleanup()`, "42501"},
		{op, `SELECT * FROM idem.idem_defaults()`, "42501"},
		{app, `SELECT count(*) FROM idem.idempotency_keys`, "42501"},
		{op, `SELECT count(*) FROM idem.idempotency_keys`, "42501"},
	}
	for _, c := range cases {
		if got := execState(t, c.conn, c.sql); got != c.want {
			short := c.sql
			if len(short) > 220 {
				short = short[:220] + "..."
			}
			t.Errorf("%s\n  -> %s, want %s", short, got, c.want)
		}
	}
	// idem_serves_version: "true from the oldest version whose calls this release keeps working
	// (5, release 0.2.0's) up to its own".
	var own int
	if err := app.QueryRow(ctx, `SELECT schema_version FROM idem.idem_version()`).Scan(&own); err != nil {
		t.Fatal(err)
	}
	for v, want := range map[int]bool{4: false, 5: true, own: true, own + 1: false} {
		var got bool
		if err := app.QueryRow(ctx, `SELECT idem.idem_serves_version($1)`, v).Scan(&got); err != nil {
			t.Fatal(err)
		}
		if got != want {
			t.Errorf("idem_serves_version(%d) = %v, want %v (own %d)", v, got, want, own)
		}
	}
	// the release_stuck reason: 1,000 characters (two-byte ones) pass, 1,001 do not.
	var attempt int64
	if err := app.QueryRow(ctx, `SELECT attempt FROM idem.idem_begin('p', 'rs', 'POST /x', sha256('b'::bytea), p_lease => '1 hour')`).Scan(&attempt); err != nil {
		t.Fatal(err)
	}
	if got := execState(t, op, `SELECT idem.idem_release_stuck('p', 'rs', $1, $2)`, attempt, strings.Repeat("é", 1001)); got != "22023" {
		t.Errorf("release_stuck with a reason of 1001 characters: %s, want 22023", got)
	}
	if got := execState(t, op, `SELECT idem.idem_release_stuck('p', 'rs', $1, $2)`, attempt, strings.Repeat("é", 1000)); got != "ok" {
		t.Errorf("release_stuck with a reason of 1000 characters: %s, want ok", got)
	}
}

// TestOutsideFieldHashesOnEveryPath: docs/sql-api.md, p_request_fields: "Anything else
// (shorter, whitespace or another character among the first 16, not a string) raises 22023 on
// every path": a fresh key, a replay, a mismatch, a lease in progress, an expired key.
func TestOutsideFieldHashesOnEveryPath(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	app, _, _, _ := appSession(t, false)
	// completed key
	pgtest.Exec(t, app, `BEGIN`)
	var a int64
	if err := app.QueryRow(ctx, `SELECT attempt FROM idem.idem_begin('p', 'done', 'POST /x', sha256('b'::bytea))`).Scan(&a); err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, app, `SELECT idem.idem_complete('p', 'done', $1, 201, '{}', 'x')`, a)
	pgtest.Exec(t, app, `COMMIT`)
	// a lease in progress
	pgtest.Exec(t, app, `SELECT * FROM idem.idem_begin('p', 'lease', 'POST /x', sha256('b'::bytea), p_lease => '1 hour')`)
	// an expired key
	pgtest.Exec(t, app, `SELECT * FROM idem.idem_begin('p', 'old', 'POST /x', sha256('b'::bytea), p_ttl => '1 millisecond', p_lease => '1 millisecond')`)
	pgtest.Exec(t, app, `SELECT pg_sleep(0.05)`)
	for _, bad := range []string{`{"a":"0123"}`, `{"a":7}`, `{"a":" 123456789abcdef0"}`, `[1]`} {
		for _, c := range []struct{ key, sha string }{
			{"fresh", "b"}, {"done", "b"}, {"done", "other"}, {"lease", "b"}, {"lease", "other"}, {"old", "b"},
		} {
			got := execState(t, app, `SELECT * FROM idem.idem_begin('p', $1, 'POST /x', sha256($2::bytea), p_request_fields => $3::jsonb)`,
				c.key, c.sha, bad)
			if got != "22023" {
				t.Errorf("key %s (request %s), p_request_fields %s: %s, want 22023 on every path", c.key, c.sha, bad, got)
			}
		}
	}
}

// TestOutsideAnswerOutlivesShortTTLAgainstCleanup: docs/sql-api.md "How long a key lives": "An
// answer is replayable for at least the TTL after it was stored ... with p_ttl of one second and
// work of 1.2 seconds, a retry right after the answer still replays it", and idem_cleanup deletes
// only keys whose "TTL ran out, no lease on them still runs and no answer is still kept". A
// cleanup run right after such an answer must leave it; the replay must still come.
func TestOutsideAnswerOutlivesShortTTLAgainstCleanup(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	app, _, _, _ := appSession(t, false)
	for _, lease := range []string{"NULL", "'1 second'"} {
		key := "slow-" + strings.ReplaceAll(strings.Trim(lease, "'"), " ", "-")
		tx, err := app.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		var a int64
		if err := tx.QueryRow(ctx, `SELECT attempt FROM idem.idem_begin('p', $1, 'POST /x', sha256('b'::bytea), p_ttl => '1 second', p_lease => `+lease+`)`, key).Scan(&a); err != nil {
			t.Fatal(err)
		}
		if lease != "NULL" {
			if err := tx.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			tx, _ = app.Begin(ctx)
			pgtest.Exec(t, tx, `SELECT idem.idem_extend('p', $1, $2, '2 seconds')`, key, a)
		}
		pgtest.Exec(t, tx, `SELECT pg_sleep(1.3)`)
		pgtest.Exec(t, tx, `SELECT idem.idem_complete('p', $1, $2, 201, '{}', 'answer')`, key, a)
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		var deleted int
		if err := app.QueryRow(ctx, `SELECT idem.idem_cleanup()`).Scan(&deleted); err != nil {
			t.Fatal(err)
		}
		got, err := beginAs(ctx, app, "p", key, "POST /x", sum256("b"), "")
		if err != nil {
			t.Fatal(err)
		}
		if got.Outcome != "replay" || string(got.Body) != "answer" {
			t.Errorf("lease %s: right after the answer (cleanup deleted %d): %s %q; want the replay", lease, deleted, got.Outcome, got.Body)
		}
	}
}

// TestOutsideExpiredAnswerOfALongLease: docs/sql-api.md: "A completed key is expired once
// lease_expires_at, its answer's TTL, has passed ... a lease claim answered a minute before its
// lease's end is not kept that minute longer", and "An expired key ... is absent: it is claimed
// again (a new token), whatever the request"; idem_save_final "for a key nobody holds (absent,
// expired or released) inserts the answer"; idem_key says expired. The new claim's answer is then
// kept its own TTL (the row's expires_at moves with it, so cleanup leaves it).
func TestOutsideExpiredAnswerOfALongLease(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	app, admin, _, _ := appSession(t, false)
	var a int64
	var pk string
	if err := app.QueryRow(ctx, `SELECT attempt, provider_key FROM idem.idem_begin('p', 'k', 'POST /x', sha256('b'::bytea), p_ttl => '100 milliseconds', p_lease => '1 hour')`).Scan(&a, &pk); err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, app, `SELECT idem.idem_complete('p', 'k', $1, 201, '{}', 'first')`, a)
	pgtest.Exec(t, app, `SELECT pg_sleep(0.3)`)
	var expired bool
	if err := app.QueryRow(ctx, `SELECT expired FROM idem.idem_key('p', 'k')`).Scan(&expired); err != nil {
		t.Fatal(err)
	}
	if !expired {
		t.Errorf("idem_key: not expired 300 ms after an answer with a TTL of 100 ms")
	}
	// another request: claims it; idem_save_final of another request: stores.
	for _, c := range []struct{ sql, want string }{
		{`SELECT outcome FROM idem.idem_begin('p', 'k', 'POST /x', sha256('other'::bytea))`, "claimed"},
		{`SELECT outcome FROM idem.idem_begin('p', 'k', 'POST /x', sha256('b'::bytea))`, "claimed"},
		{`SELECT idem.idem_save_final('p', 'k', 'POST /x', sha256('other'::bytea), '1 hour', 422, '{}', 'no')::text`, "true"},
	} {
		tx, _ := app.Begin(ctx)
		var got string
		if err := tx.QueryRow(ctx, c.sql).Scan(&got); err != nil {
			t.Errorf("%s: %v", c.sql, err)
		} else if got != c.want {
			t.Errorf("%s: %s, want %s", c.sql, got, c.want)
		}
		tx.Rollback(ctx)
	}
	// the same request claims it anew, in a new generation, and keeps its answer a day.
	tx, _ := app.Begin(ctx)
	var b int64
	var pk2 string
	if err := tx.QueryRow(ctx, `SELECT attempt, provider_key FROM idem.idem_begin('p', 'k', 'POST /x', sha256('b'::bytea), p_ttl => '1 day')`).Scan(&b, &pk2); err != nil {
		t.Fatal(err)
	}
	if b <= a || pk2 == pk {
		t.Errorf("the claim of the expired key: token %d (was %d), provider key same=%v; want a new token and a new provider key", b, a, pk2 == pk)
	}
	pgtest.Exec(t, tx, `SELECT idem.idem_complete('p', 'k', $1, 201, '{}', 'second')`, b)
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	var soonest time.Duration
	if err := admin.QueryRow(ctx, `SELECT least(expires_at, lease_expires_at) - now() FROM idem.idempotency_keys WHERE key = 'k'`).Scan(&soonest); err != nil {
		t.Fatal(err)
	}
	if soonest < 23*time.Hour {
		t.Errorf("the new answer's row: expires_at/lease_expires_at in %v; want a day (cleanup reads expires_at)", soonest)
	}
	got, err := beginAs(ctx, app, "p", "k", "POST /x", sum256("b"), "")
	if err != nil || got.Outcome != "replay" || string(got.Body) != "second" {
		t.Errorf("replay: %+v %v", got, err)
	}
}

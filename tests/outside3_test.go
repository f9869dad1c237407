package tests

// The SQL API's promises from outside (docs/sql-api.md): called over pgx with named arguments,
// as login roles that are only members of idem_app or idem_operator.

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestOutsideLeaseAnswerExpiredEverywhere: D200 / docs/sql-api.md "How long a key lives":
// "A completed key is expired once lease_expires_at, its answer's TTL, has passed ... a lease
// claim answered a minute before its lease's end is not kept that minute longer", and
// "idem_begin, idem_save_final, idem_key (expired, kept_until) and idem_release_stuck's message
// use the rule". A lease claim of 1 minute with a 1 s TTL, answered at once: 1.3 s later the key
// is absent for every function: idem_key says expired, idem_save_final of another request
// stores its answer (a key nobody holds), and that answer replays.
func TestOutsideLeaseAnswerExpiredEverywhere(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.NewDB(t)
	app := pgtest.Connect(t, pgtest.LoginRole(t, db, "idem_app"))
	op := pgtest.Connect(t, pgtest.LoginRole(t, db, "idem_operator"))

	var token int64
	var outcome string
	if err := app.QueryRow(ctx, `SELECT outcome, attempt FROM idem.idem_begin(p_principal => 'alice', p_key => 'k',
		p_action => 'POST /v1/payouts', p_request_sha256 => $1, p_ttl => '1 second', p_lease => '1 minute')`, csFP("a")).
		Scan(&outcome, &token); err != nil || outcome != "claimed" {
		t.Fatalf("claim: %v %s", err, outcome)
	}
	if _, err := app.Exec(ctx, `SELECT idem.idem_complete(p_principal => 'alice', p_key => 'k', p_attempt => $1,
		p_status => 201, p_headers => '{}', p_body => 'done')`, token); err != nil {
		t.Fatal(err)
	}
	answered := time.Now()
	time.Sleep(1300 * time.Millisecond)

	var expired bool
	var keptUntil time.Time
	if err := op.QueryRow(ctx, `SELECT expired, kept_until FROM idem.idem_key(p_principal => 'alice', p_key => 'k')`).
		Scan(&expired, &keptUntil); err != nil {
		t.Fatal(err)
	}
	if !expired || keptUntil.After(answered.Add(1100*time.Millisecond)) {
		t.Errorf("idem_key: expired=%v kept_until=%s (answered %s, TTL 1 s)", expired, keptUntil, answered)
	}

	tx, err := app.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var stored bool
	if err := tx.QueryRow(ctx, `SELECT idem.idem_save_final(p_principal => 'alice', p_key => 'k', p_action => 'POST /v1/payouts',
		p_request_sha256 => $1, p_ttl => NULL, p_status => 422, p_headers => '{}', p_body => 'no')`, csFP("b")).Scan(&stored); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if !stored {
		t.Errorf("idem_save_final of another request on a key whose answer's TTL has passed: false, want true (the key is absent)")
	}
	var status *int32
	if err := app.QueryRow(ctx, `SELECT outcome, response_status FROM idem.idem_begin(p_principal => 'alice', p_key => 'k',
		p_action => 'POST /v1/payouts', p_request_sha256 => $1)`, csFP("b")).Scan(&outcome, &status); err != nil {
		t.Fatal(err)
	}
	if outcome != "replay" || status == nil || *status != 422 {
		t.Errorf("request b after its save_final: %s %v, want replay 422", outcome, status)
	}
}

// TestOutsideBeginStepsHonoursLockTimeout: docs/sql-api.md idem_begin_steps: "idem_begin
// with the same arguments, the same answers and the same errors"; idem_begin's p_lock_timeout:
// "how long to wait for a concurrent holder of the same key". A holder keeps a transactional
// claim uncommitted (a real row lock); idem_begin_steps with p_lock_timeout 300 ms raises 55P03
// after about 300 ms, not after the 2 s of its own SET clause; the caller's lock_timeout is
// back after a call that returns.
func TestOutsideBeginStepsHonoursLockTimeout(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.NewDB(t)
	appURL := pgtest.LoginRole(t, db, "idem_app")
	holder := pgtest.Connect(t, appURL)
	waiter := pgtest.Connect(t, appURL)

	htx, err := holder.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer htx.Rollback(ctx)
	var outcome string
	if err := htx.QueryRow(ctx, `SELECT outcome FROM idem.idem_begin(p_principal => 'alice', p_key => 'held',
		p_action => 'POST /v1/x', p_request_sha256 => $1)`, csFP("x")).Scan(&outcome); err != nil || outcome != "claimed" {
		t.Fatalf("holder: %v %s", err, outcome)
	}

	for _, fn := range []string{"idem_begin", "idem_begin_steps"} {
		wtx, err := waiter.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		_, err = wtx.Exec(ctx, `SELECT * FROM idem.`+fn+`(p_principal => 'alice', p_key => 'held',
			p_action => 'POST /v1/x', p_request_sha256 => $1, p_lock_timeout => '300 milliseconds')`, csFP("x"))
		took := time.Since(start)
		_ = wtx.Rollback(ctx)
		if csCode(err) != "55P03" || took > 1500*time.Millisecond || took < 250*time.Millisecond {
			t.Errorf("%s behind a holder, p_lock_timeout 300 ms: %s after %s, want 55P03 after about 300 ms", fn, csCode(err), took)
		}
	}

	// The caller's lock_timeout is back after a call that returned.
	for _, fn := range []string{"idem_begin", "idem_begin_steps"} {
		wtx, err := waiter.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := wtx.Exec(ctx, `SET LOCAL lock_timeout = '7s'`); err != nil {
			t.Fatal(err)
		}
		if _, err := wtx.Exec(ctx, `SELECT * FROM idem.`+fn+`(p_principal => 'alice', p_key => $2,
			p_action => 'POST /v1/x', p_request_sha256 => $1, p_lease => '1 minute', p_lock_timeout => '300 milliseconds')`,
			csFP("x"), "free-"+fn); err != nil {
			t.Fatal(err)
		}
		var lt string
		if err := wtx.QueryRow(ctx, `SHOW lock_timeout`).Scan(&lt); err != nil {
			t.Fatal(err)
		}
		_ = wtx.Rollback(ctx)
		if lt != "7s" {
			t.Errorf("%s: the caller's lock_timeout after the call is %q, want 7s", fn, lt)
		}
	}
}

// TestOutsideBeginStepsSameErrors: docs/sql-api.md idem_begin_steps: "the same answers and
// the same errors" as idem_begin; table "SQLSTATEs": 22004 for a NULL required argument, 22023
// for an argument out of range. Every bad argument, through both functions, as idem_app.
func TestOutsideBeginStepsSameErrors(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.NewDB(t)
	app := pgtest.Connect(t, pgtest.LoginRole(t, db, "idem_app"))
	fp := csFP("x")
	cases := []struct {
		name string
		args string
		vals []any
		want string
	}{
		{"null principal", `p_principal => NULL, p_key => 'k', p_action => 'a', p_request_sha256 => $1`, []any{fp}, "22004"},
		{"null key", `p_principal => 'p', p_key => NULL, p_action => 'a', p_request_sha256 => $1`, []any{fp}, "22004"},
		{"null action", `p_principal => 'p', p_key => 'k', p_action => NULL, p_request_sha256 => $1`, []any{fp}, "22004"},
		{"null fingerprint", `p_principal => 'p', p_key => 'k', p_action => 'a', p_request_sha256 => NULL`, nil, "22004"},
		{"empty principal", `p_principal => '', p_key => 'k', p_action => 'a', p_request_sha256 => $1`, []any{fp}, "22023"},
		{"256-char principal", `p_principal => repeat('p', 256), p_key => 'k', p_action => 'a', p_request_sha256 => $1`, []any{fp}, "22023"},
		{"key with space", `p_principal => 'p', p_key => 'a b', p_action => 'a', p_request_sha256 => $1`, []any{fp}, "22023"},
		{"key of 256", `p_principal => 'p', p_key => repeat('k', 256), p_action => 'a', p_request_sha256 => $1`, []any{fp}, "22023"},
		{"key non-ASCII", `p_principal => 'p', p_key => 'clé', p_action => 'a', p_request_sha256 => $1`, []any{fp}, "22023"},
		{"empty action", `p_principal => 'p', p_key => 'k', p_action => '', p_request_sha256 => $1`, []any{fp}, "22023"},
		{"action of 1001", `p_principal => 'p', p_key => 'k', p_action => repeat('a', 1001), p_request_sha256 => $1`, []any{fp}, "22023"},
		{"fingerprint of 31", `p_principal => 'p', p_key => 'k', p_action => 'a', p_request_sha256 => $1`, []any{fp[:31]}, "22023"},
		{"ttl zero", `p_principal => 'p', p_key => 'k', p_action => 'a', p_request_sha256 => $1, p_ttl => '0'`, []any{fp}, "22023"},
		{"ttl 3601 days", `p_principal => 'p', p_key => 'k', p_action => 'a', p_request_sha256 => $1, p_ttl => '3601 days'`, []any{fp}, "22023"},
		{"lease negative", `p_principal => 'p', p_key => 'k', p_action => 'a', p_request_sha256 => $1, p_lease => '-1 second'`, []any{fp}, "22023"},
		{"lock timeout zero", `p_principal => 'p', p_key => 'k', p_action => 'a', p_request_sha256 => $1, p_lock_timeout => '0'`, []any{fp}, "22023"},
		{"lock timeout too long", `p_principal => 'p', p_key => 'k', p_action => 'a', p_request_sha256 => $1, p_lock_timeout => '2147484 seconds'`, []any{fp}, "22023"},
		{"fields not hex", `p_principal => 'p', p_key => 'k', p_action => 'a', p_request_sha256 => $1, p_request_fields => '{"a":"zzzzzzzzzzzzzzzz"}'`, []any{fp}, "22023"},
		{"fields not object of strings", `p_principal => 'p', p_key => 'k', p_action => 'a', p_request_sha256 => $1, p_request_fields => '{"a":1}'`, []any{fp}, "22023"},
	}
	for _, c := range cases {
		var codes []string
		for _, fn := range []string{"idem_begin", "idem_begin_steps"} {
			_, err := app.Exec(ctx, `SELECT * FROM idem.`+fn+`(`+c.args+`)`, c.vals...)
			codes = append(codes, csCode(err))
		}
		if codes[0] != c.want || codes[1] != c.want {
			t.Errorf("%s: idem_begin %s, idem_begin_steps %s, want %s for both", c.name, codes[0], codes[1], c.want)
		}
	}
	if n := pgtest.Count(t, app, `SELECT count(*) FROM idem.idem_summary()`); n != 1 {
		t.Fatalf("summary rows %d", n)
	}
	var keys int64
	if err := app.QueryRow(ctx, `SELECT keys FROM idem.idem_summary()`).Scan(&keys); err != nil || keys != 0 {
		t.Errorf("bad input wrote %d keys (%v): \"Bad input never writes anything\"", keys, err)
	}
}

// TestOutsideRolesCallWhatTheyMay: idem_app holds exactly what an application needs to call
// the API; idem_operator what operators need (a summary, one key's story, a list of stuck
// claims, a fenced release). docs/sql-api.md: idem_app may not read bodies
// (idem_key_body), list stuck claims or release them; idem_operator may not claim, complete or
// clean up; a role in neither may call nothing, idem_defaults included.
func TestOutsideRolesCallWhatTheyMay(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.NewDB(t)
	owner := pgtest.Connect(t, db)
	pgtest.Exec(t, owner, `CREATE ROLE o3_nobody NOLOGIN`)
	t.Cleanup(func() {
		c, err := pgx.Connect(context.Background(), db)
		if err == nil {
			_, _ = c.Exec(context.Background(), `DROP OWNED BY o3_nobody; DROP ROLE o3_nobody`)
			c.Close(context.Background())
		}
	})
	roles := map[string]*pgx.Conn{
		"idem_app":      pgtest.Connect(t, pgtest.LoginRole(t, db, "idem_app")),
		"idem_operator": pgtest.Connect(t, pgtest.LoginRole(t, db, "idem_operator")),
		"none":          pgtest.Connect(t, pgtest.LoginRole(t, db, "o3_nobody")),
	}
	calls := []struct {
		sql     string
		allowed []string
	}{
		{`SELECT * FROM idem.idem_begin(p_principal => 'p', p_key => 'k', p_action => 'a', p_request_sha256 => sha256('x'), p_lease => '1 minute')`, []string{"idem_app"}},
		{`SELECT * FROM idem.idem_begin_steps(p_principal => 'p', p_key => 'k2', p_action => 'a', p_request_sha256 => sha256('x'), p_lease => '1 minute')`, []string{"idem_app"}},
		{`SELECT idem.idem_cleanup(p_batch_size => 10)`, []string{"idem_app"}},
		{`SELECT * FROM idem.idem_defaults()`, []string{"idem_app"}},
		{`SELECT * FROM idem.idem_version()`, []string{"idem_app", "idem_operator"}},
		{`SELECT idem.idem_serves_version(p_version => 5)`, []string{"idem_app", "idem_operator"}},
		{`SELECT * FROM idem.idem_summary()`, []string{"idem_app", "idem_operator"}},
		{`SELECT * FROM idem.idem_health()`, []string{"idem_app", "idem_operator"}},
		{`SELECT * FROM idem.idem_replication()`, []string{"idem_app", "idem_operator"}},
		{`SELECT * FROM idem.idem_key(p_principal => 'p', p_key => 'k')`, []string{"idem_app", "idem_operator"}},
		{`SELECT idem.idem_key_body(p_principal => 'p', p_key => 'k')`, []string{"idem_operator"}},
		{`SELECT * FROM idem.idem_stuck()`, []string{"idem_operator"}},
	}
	for _, c := range calls {
		for role, conn := range roles {
			_, err := conn.Exec(ctx, c.sql)
			allowed := false
			for _, r := range c.allowed {
				allowed = allowed || r == role
			}
			code := csCode(err)
			if allowed && code == "42501" {
				t.Errorf("%s may not call %s: %v (the docs say it may)", role, strings.Fields(c.sql)[3], err)
			}
			if !allowed && code != "42501" {
				t.Errorf("%s calls %q: %s, want 42501 permission denied", role, c.sql, code)
			}
		}
	}
}

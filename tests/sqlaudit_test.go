package tests

// An adversarial audit of docs/sql-api.md and docs/operations.md as promises to DBAs and
// operators calling the SQL API directly: each test checks one promise against a real
// PostgreSQL, as login roles that are only members of idem_app or idem_operator.
// TestAuditBaseBackupIsNotAStandby and TestAuditRecoverySQLStateIsDocumented failed before
// D167; two others are rewritten to what the docs now say.

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/internal/pgcluster"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// auditLeaseClaim claims principal/key as a lease of the given length through q and returns its
// token.
func auditLeaseClaim(t *testing.T, q pgtest.Querier, principal, key, body, lease string) int64 {
	t.Helper()
	var outcome string
	var token int64
	if err := q.QueryRow(context.Background(), `SELECT outcome, attempt FROM idem.idem_begin(p_principal => $1, p_key => $2,
		p_action => 'POST /v1/jobs', p_request_sha256 => sha256($3::bytea), p_lease => $4::interval)`,
		principal, key, []byte(body), lease).Scan(&outcome, &token); err != nil || outcome != "claimed" {
		t.Fatalf("lease claim of %s/%s: %q %v", principal, key, outcome, err)
	}
	return token
}

// TestAuditLockTimeoutIsTheCallersAfterACall: docs/sql-api.md: every function "sets its own
// lock_timeout (2 seconds; idem_begin takes a per-call p_lock_timeout), which holds only for
// the call: the caller's setting is back when it returns" (session value and SET LOCAL alike).
func TestAuditLockTimeoutIsTheCallersAfterACall(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	app, _, _ := appAndAdmin(t)
	show := func(q pgtest.Querier) string {
		var v string
		if err := q.QueryRow(ctx, `SHOW lock_timeout`).Scan(&v); err != nil {
			t.Fatal(err)
		}
		return v
	}
	pgtest.Exec(t, app, `SET lock_timeout = '7s'`)
	pgtest.Exec(t, app, `SELECT idem.idem_begin('p', 'a1', 'POST /x', sha256('a'), p_lease => '1 minute', p_lock_timeout => '150 ms')`)
	if v := show(app); v != "7s" {
		t.Errorf("session lock_timeout after idem_begin(p_lock_timeout => 150 ms): %s, want 7s", v)
	}
	pgtest.Exec(t, app, `SELECT idem.idem_begin_steps('p', 'a2', 'POST /x', sha256('a'), p_lease => '1 minute', p_lock_timeout => '150 ms')`)
	if v := show(app); v != "7s" {
		t.Errorf("session lock_timeout after idem_begin_steps(p_lock_timeout => 150 ms): %s, want 7s", v)
	}
	tx, err := app.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	pgtest.Exec(t, tx, `SET LOCAL lock_timeout = '3s'`)
	pgtest.Exec(t, tx, `SELECT idem.idem_begin('p', 'a3', 'POST /x', sha256('a'), p_lock_timeout => '150 ms')`)
	if v := show(tx); v != "3s" {
		t.Errorf("SET LOCAL lock_timeout after a transactional idem_begin(p_lock_timeout => 150 ms): %s, want 3s", v)
	}
	pgtest.Exec(t, tx, `SELECT idem.idem_save_final('p', 'a3', 'POST /x', sha256('a'), NULL, 422, '{}', NULL)`)
	if v := show(tx); v != "3s" {
		t.Errorf("SET LOCAL lock_timeout after idem_save_final: %s, want 3s", v)
	}
}

// TestAuditFunctionsBoundTheirOwnWait: docs/sql-api.md: each function sets its own lock_timeout
// of 2 seconds (SQLSTATEs: 55P03 "a concurrent holder kept the key past the lock timeout"),
// whatever the caller's lock_timeout (0: wait forever). Another session holds the key's row
// (a step's transaction, as docs/sql-api.md warns: "the holder's idem_extend ... wait for it
// too"); the holder's idem_extend, idem_complete and an operator's idem_release_stuck each
// give up with 55P03 after about 2 s, as login roles.
func TestAuditFunctionsBoundTheirOwnWait(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	app, _, url := appAndAdmin(t)
	stepper := pgtest.Connect(t, pgtest.LoginRole(t, url, "idem_app"))
	ops := pgtest.Connect(t, pgtest.LoginRole(t, url, "idem_operator"))
	token := auditLeaseClaim(t, app, "p", "job", "j", "10 minutes")
	stx, err := stepper.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer stx.Rollback(ctx)
	pgtest.Exec(t, stx, `SELECT idem.idem_step('p', 'job', $1, 'reserve', '{"id": 1}')`, token)
	for _, c := range []struct {
		name string
		conn *pgx.Conn
		sql  string
	}{
		{"idem_extend", app, fmt.Sprintf(`SELECT idem.idem_extend('p', 'job', %d, '10 minutes')`, token)},
		{"idem_complete", app, fmt.Sprintf(`SELECT idem.idem_complete('p', 'job', %d, 200, '{}', 'x')`, token)},
		{"idem_yield", app, fmt.Sprintf(`SELECT idem.idem_yield('p', 'job', %d)`, token)},
		{"idem_release_stuck", ops, fmt.Sprintf(`SELECT idem.idem_release_stuck('p', 'job', %d, 'audit')`, token)},
	} {
		pgtest.Exec(t, c.conn, `SET lock_timeout = 0`)
		start := time.Now()
		_, err := c.conn.Exec(ctx, c.sql)
		took := time.Since(start)
		if sqlCode(err) != "55P03" || took > 4*time.Second || took < 1500*time.Millisecond {
			t.Errorf("%s against a row held by a step's transaction, caller lock_timeout 0: %v after %v; want 55P03 after about 2 s",
				c.name, err, took.Round(time.Millisecond))
		}
	}
}

// TestAuditStatementTimeoutEndsAKeyWaitWith57014: docs/sql-api.md: "The functions set no
// statement_timeout: one set on the role or the database below the lock timeout ends the
// wait first, with 57014 (query_canceled)". A statement_timeout set on the service's login
// role.
func TestAuditStatementTimeoutEndsAKeyWaitWith57014(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.NewDB(t)
	admin := pgtest.Connect(t, url)
	holder := pgtest.Connect(t, pgtest.LoginRole(t, url, "idem_app"))
	loginURL := pgtest.LoginRole(t, url, "idem_app")
	cfg, _ := pgx.ParseConfig(loginURL)
	pgtest.Exec(t, admin, fmt.Sprintf(`ALTER ROLE %s SET statement_timeout = '300ms'`, cfg.User))
	waiter := pgtest.Connect(t, loginURL)
	htx, err := holder.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer htx.Rollback(ctx)
	pgtest.Exec(t, htx, `SELECT idem.idem_begin('p', 'k', 'POST /x', sha256('a'))`)
	start := time.Now()
	_, err = waiter.Exec(ctx, `SELECT idem.idem_begin('p', 'k', 'POST /x', sha256('a'))`)
	if took := time.Since(start); sqlCode(err) != "57014" || took > 1500*time.Millisecond {
		t.Errorf("a duplicate under a role's statement_timeout of 300 ms: %v after %v; want 57014 at about 300 ms", err, took)
	}
}

// TestAuditCleanupAllAsAnAppLogin: docs/sql-api.md: idem_cleanup_all is granted to idem_app and
// deletes every expired key batch by batch (CALL idem.idem_cleanup_all(5000) prints
// p_deleted); 22023 for a batch size below 1, 22004 for NULL ("all but idem_defaults"); live
// keys stay.
func TestAuditCleanupAllAsAnAppLogin(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	app, admin, _ := appAndAdmin(t)
	pgtest.InsertExpired(t, admin, "p", 7)
	auditLeaseClaim(t, app, "p", "live", "l", "1 minute")
	var deleted int64
	if err := app.QueryRow(ctx, `CALL idem.idem_cleanup_all(3)`).Scan(&deleted); err != nil || deleted != 7 {
		t.Errorf("CALL idem.idem_cleanup_all(3) as an idem_app login: %d deleted, %v; want 7", deleted, err)
	}
	if n := pgtest.Count(t, admin, `SELECT count(*) FROM idem.idempotency_keys`); n != 1 {
		t.Errorf("%d keys left, want the live one", n)
	}
	for call, want := range map[string]string{
		`CALL idem.idem_cleanup_all(0)`:         "22023",
		`CALL idem.idem_cleanup_all(-5)`:        "22023",
		`CALL idem.idem_cleanup_all(NULL)`:      "22004",
		`SELECT idem.idem_cleanup(-1)`:          "22023",
		`SELECT idem.idem_cleanup(-2147483648)`: "22023",
	} {
		if _, err := app.Exec(ctx, call); sqlCode(err) != want {
			t.Errorf("%s: %v, want %s", call, err, want)
		}
	}
}

// TestAuditIntervalBoundsAsDocumented: docs/sql-api.md, p_ttl: "at most 10 years as PostgreSQL
// compares intervals (a year is 12 months of 30 days: '10 years' and '3600 days' pass, '3601
// days' does not)"; p_lease "compared as for p_ttl"; idem_extend's p_lease "at most 10 years
// (22023)"; idem_save_final's p_ttl likewise.
func TestAuditIntervalBoundsAsDocumented(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	app, _, _ := appAndAdmin(t)
	n := 0
	for _, iv := range []string{"10 years", "3600 days", "3601 days", "9 years 12 months", "10 years 1 microsecond"} {
		want := "ok"
		if iv == "3601 days" || iv == "10 years 1 microsecond" {
			want = "22023"
		}
		for _, tmpl := range []string{
			`SELECT idem.idem_begin('p', 'b%d', 'POST /x', sha256('a'), p_lease => '1 minute', p_ttl => '%s')`,
			`SELECT idem.idem_begin('p', 'b%d', 'POST /x', sha256('a'), p_lease => '%s')`,
			`SELECT idem.idem_save_final('p', 'b%d', 'POST /x', sha256('a'), '%s', 404, '{}', NULL)`,
		} {
			n++
			sql := fmt.Sprintf(tmpl, n, iv)
			if _, err := app.Exec(ctx, sql); sqlCode(err) != want {
				t.Errorf("%s: %s, want %s", sql, sqlCode(err), want)
			}
		}
		token := auditLeaseClaim(t, app, "p", fmt.Sprintf("e%d", n), "e", "1 minute")
		sql := fmt.Sprintf(`SELECT idem.idem_extend('p', 'e%d', %d, '%s')`, n, token, iv)
		if _, err := app.Exec(ctx, sql); sqlCode(err) != want {
			t.Errorf("%s: %s, want %s", sql, sqlCode(err), want)
		}
	}
}

// TestAuditRolesAsLogins: docs/operations.md, "Who may do what", as login roles that are only
// members of idem_app or idem_operator (not SET ROLE from a superuser).
func TestAuditRolesAsLogins(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.NewDB(t)
	app := pgtest.Connect(t, pgtest.LoginRole(t, url, "idem_app"))
	ops := pgtest.Connect(t, pgtest.LoginRole(t, url, "idem_operator"))
	token := auditLeaseClaim(t, app, "p", "job", "j", "10 minutes")
	check := func(who string, conn *pgx.Conn, sql, want string) {
		t.Helper()
		_, err := conn.Exec(ctx, sql)
		if got := sqlCode(err); got != want {
			t.Errorf("%s: %s: %s (%v), want %s", who, sql, got, err, want)
		}
	}
	// The operator: no part of the API.
	for _, sql := range []string{
		`SELECT idem.idem_begin('p', 'o', 'POST /x', sha256('a'))`,
		`SELECT idem.idem_begin_steps('p', 'o', 'POST /x', sha256('a'))`,
		fmt.Sprintf(`SELECT idem.idem_complete('p', 'job', %d, 200, '{}', NULL)`, token),
		`SELECT idem.idem_save_final('p', 'o', 'POST /x', sha256('a'), NULL, 404, '{}', NULL)`,
		fmt.Sprintf(`SELECT idem.idem_release('p', 'job', %d)`, token),
		fmt.Sprintf(`SELECT idem.idem_yield('p', 'job', %d)`, token),
		fmt.Sprintf(`SELECT idem.idem_extend('p', 'job', %d, '1 hour')`, token),
		fmt.Sprintf(`SELECT idem.idem_step('p', 'job', %d, 's')`, token),
		fmt.Sprintf(`SELECT idem.idem_recovery('p', 'job', %d)`, token),
		`SELECT idem.idem_cleanup()`,
		`CALL idem.idem_cleanup_all()`,
		`SELECT * FROM idem.idem_cleanup_workers()`,
		`SELECT * FROM idem.idem_defaults()`,
		`SELECT * FROM idem.idempotency_keys`,
		`CALL idem.idem_new_installation_secret()`,
	} {
		check("idem_operator", ops, sql, "42501")
	}
	for _, sql := range []string{
		`SELECT * FROM idem.idem_version()`,
		`SELECT * FROM idem.idem_summary()`,
		`SELECT * FROM idem.idem_health()`,
		`SELECT * FROM idem.idem_replication()`,
		`SELECT * FROM idem.idem_key('p', 'job')`,
		`SELECT idem.idem_key_body('p', 'job')`,
		`SELECT * FROM idem.idem_stuck()`,
	} {
		check("idem_operator", ops, sql, "ok")
	}
	// The application: not the operators' lever, bodies, the list of tokens, the secret.
	for _, sql := range []string{
		`SELECT idem.idem_key_body('p', 'job')`,
		`SELECT * FROM idem.idem_stuck()`,
		fmt.Sprintf(`SELECT idem.idem_release_stuck('p', 'job', %d)`, token),
		`CALL idem.idem_new_installation_secret()`,
		`SELECT nextval('idem.installation_secret_1_1')`,
		`SELECT last_value FROM idem.installation_secret_1_1`,
		`SELECT * FROM idem.installation_secrets`,
		`SELECT idem.installation_secret_values()`,
		`SELECT idem.provider_key_prefixes()`,
		`SELECT idem.cleanup_relations(ARRAY['idem.idempotency_keys'::regclass], 10)`,
		`SELECT idem.key_figures(ARRAY['idem.idempotency_keys'::regclass], true)`,
		`CALL idem.cleanup_node(10, 1, 1)`,
		`SELECT nextval('idem.token_seq')`,
		`SELECT * FROM idem.schema_version`,
	} {
		check("idem_app", app, sql, "42501")
	}
	if n := pgtest.Count(t, ops, `SELECT count(*) FROM idem.idem_stuck()`); n != 1 {
		t.Errorf("the operator lists %d stuck claims, want 1", n)
	}
}

// TestAuditBaseBackupIsNotAStandby: docs/sql-api.md, idem_replication: "standbys is how many
// standbys stream from it (WAL senders, those of logical replication slots and of a base
// backup left out)"; docs/operations.md: "none (no standby: nothing to fail over to)". A
// pg_basebackup in progress (with its default -X stream) on a server without standbys, asked
// by the application role: none, 0, no warning.
func TestAuditBaseBackupIsNotAStandby(t *testing.T) {
	ctx := context.Background()
	url := pgtest.NewDB(t)
	app := pgtest.Connect(t, pgtest.LoginRole(t, url, "idem_app"))
	admin := pgtest.Connect(t, url)
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	bin, err := pgcluster.BinDir()
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	cmd := exec.Command(filepath.Join(bin, "pg_basebackup"), "-D", filepath.Join(dir, "b"), "-X", "stream",
		"--max-rate=32k", "-c", "fast", "-w")
	cmd.Env = append(os.Environ(), "PGHOST="+cfg.Host, "PGPORT="+strconv.Itoa(int(cfg.Port)), "PGUSER="+cfg.User,
		"PGPASSWORD="+cfg.Password)
	logf, err := os.Create(filepath.Join(dir, "log"))
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true} // its WAL streamer is a child of its own
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL); _ = cmd.Wait(); logf.Close() })
	out := func() string { b, _ := os.ReadFile(filepath.Join(dir, "log")); return string(b) }
	deadline := time.Now().Add(15 * time.Second)
	for pgtest.Count(t, admin, `SELECT count(*) FROM pg_stat_replication WHERE state = 'backup'`) == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("no base backup seen in pg_stat_replication: %s", out())
		}
		time.Sleep(20 * time.Millisecond)
	}
	// The WAL stream's sender (-X stream) starts beside it.
	for pgtest.Count(t, admin, `SELECT count(*) FROM pg_stat_replication`) < 2 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	var senders string
	_ = admin.QueryRow(ctx, `SELECT string_agg(application_name || '/' || state, ', ') FROM pg_stat_replication`).Scan(&senders)
	var mode string
	var standbys int
	var warning *string
	if err := app.QueryRow(ctx, `SELECT replication, standbys, replication_warning FROM idem.idem_replication()`).Scan(&mode, &standbys, &warning); err != nil {
		t.Fatal(err)
	}
	t.Logf("WAL senders during the base backup: %s", senders)
	if mode != "none" || standbys != 0 || warning != nil {
		w := "(none)"
		if warning != nil {
			w = *warning
		}
		t.Errorf("idem_replication during a pg_basebackup (WAL senders: %s): %s, %d standbys, warning %s; want none, 0, no warning",
			senders, mode, standbys, w)
	}
}

// TestAuditTakeoverLeaseCountsFromItsDecision: docs/sql-api.md, idem_begin: a takeover is
// decided on the row as it is after a wait for an uncommitted holder, and its lease counts
// from that decision, "later, never earlier": a caller counting from just before it sent the
// call ends its lease first. A lease that ran out is being taken over by another session
// (uncommitted, holding the row); this call waits for it, the other session rolls back after
// 1.5 s, and this call takes the key over with a lease of 10 s. (The review that wrote this
// found the docs promising the arrival for every path; they now say what each path does.)
func TestAuditTakeoverLeaseCountsFromItsDecision(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	app, admin, url := appAndAdmin(t)
	other := pgtest.Connect(t, pgtest.LoginRole(t, url, "idem_app"))
	auditLeaseClaim(t, app, "p", "job", "j", "1 minute")
	pgtest.Exec(t, admin, `UPDATE idem.idempotency_keys SET lease_expires_at = clock_timestamp() - interval '1 second' WHERE key = 'job'`)
	otx, err := other.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	auditLeaseClaim(t, otx, "p", "job", "j", "1 hour") // the takeover, not committed
	rolledBack := make(chan struct{})
	go func() {
		defer close(rolledBack)
		time.Sleep(1500 * time.Millisecond)
		_ = otx.Rollback(context.Background())
	}()
	defer func() { <-rolledBack }() // before the connection's cleanup closes it
	var sent time.Time
	if err := app.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&sent); err != nil {
		t.Fatal(err)
	}
	var outcome string
	if err := app.QueryRow(ctx, `SELECT outcome FROM idem.idem_begin(p_principal => 'p', p_key => 'job', p_action => 'POST /v1/jobs',
		p_request_sha256 => sha256('j'), p_lease => '10 seconds')`).Scan(&outcome); err != nil {
		t.Fatal(err)
	}
	var returned, leaseEnd time.Time
	if err := app.QueryRow(ctx, `SELECT clock_timestamp(), lease_expires_at FROM idem.idem_key('p', 'job')`).Scan(&returned, &leaseEnd); err != nil {
		t.Fatal(err)
	}
	if outcome != "claimed" {
		t.Fatalf("the takeover after the wait: %s", outcome)
	}
	// Counted from before the call was sent, the caller's lease ends first; counted from the
	// decision, the lease ends at most 10 s after the call returned.
	if leaseEnd.Before(sent.Add(10*time.Second)) || leaseEnd.After(returned.Add(10*time.Second)) {
		t.Errorf("a takeover with p_lease 10 s after a wait of about 1.5 s: its lease ends %v after the call was sent and %v after it returned; want from 10 s after the first to at most 10 s after the second",
			leaseEnd.Sub(sent).Round(time.Millisecond), leaseEnd.Sub(returned).Round(time.Millisecond))
	}
	if waited := returned.Sub(sent); waited < time.Second {
		t.Fatalf("the call did not wait for the other session's takeover (%v): the test proves nothing", waited)
	}
}

// TestAuditHealthLeavesOutALeaseGivenUp: docs/sql-api.md: idem_health counts claims with
// work under them; a lease given up on purpose (idem_yield) waits for its retry and is not
// counted, where idem_summary counts it in progress with its lease run out, as its state is.
// (The review that wrote this found the two disagreeing with no word in the docs.)
func TestAuditHealthLeavesOutALeaseGivenUp(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	app, _, url := appAndAdmin(t)
	ops := pgtest.Connect(t, pgtest.LoginRole(t, url, "idem_operator"))
	token := auditLeaseClaim(t, app, "p", "job", "j", "10 minutes")
	auditLeaseClaim(t, app, "p", "other", "o", "10 minutes")
	figures := func() (sIn, sRun, hIn, hRun int64) {
		t.Helper()
		if err := ops.QueryRow(ctx, `SELECT s.in_progress, s.leases_run_out, h.in_progress, h.leases_run_out
			FROM idem.idem_summary() AS s, idem.idem_health() AS h`).Scan(&sIn, &sRun, &hIn, &hRun); err != nil {
			t.Fatal(err)
		}
		return
	}
	if sIn, sRun, hIn, hRun := figures(); sIn != 2 || sRun != 0 || hIn != 2 || hRun != 0 {
		t.Fatalf("two leases running: summary %d in progress, %d run out; health %d and %d", sIn, sRun, hIn, hRun)
	}
	var ok bool
	if err := app.QueryRow(ctx, `SELECT idem.idem_yield('p', 'job', $1)`, token).Scan(&ok); err != nil || !ok {
		t.Fatalf("yield: %v %v", ok, err)
	}
	if sIn, sRun, hIn, hRun := figures(); sIn != 2 || sRun != 1 || hIn != 1 || hRun != 0 {
		t.Errorf("after idem_yield of one: idem_summary says %d in progress, %d leases run out (want 2 and 1); idem_health %d and %d (want 1 and 0)",
			sIn, sRun, hIn, hRun)
	}
}

// TestAuditRecoverySQLStateIsDocumented: docs/sql-api.md, idem_recovery: "when no claim with this
// token is in progress ... it raises 55000". The SQLSTATE table's row for 55000 names the
// functions that raise it: "complete, extend, release, step, release_stuck".
func TestAuditRecoverySQLStateIsDocumented(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	app, _, _ := appAndAdmin(t)
	if _, err := app.Exec(ctx, `SELECT idem.idem_recovery('p', 'absent', 1)`); sqlCode(err) != "55000" {
		t.Fatalf("idem_recovery of an absent claim: %v", err)
	}
	raw, err := os.ReadFile("../docs/sql-api.md")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(raw), "\n") {
		if strings.HasPrefix(line, "| 55000 |") && !strings.Contains(line, "recovery") {
			t.Errorf("idem_recovery raises 55000, but the SQLSTATE table does not say so: %s", line)
		}
	}
}

// TestAuditLongestArgumentsThroughTheLifecycle: docs/sql-api.md: a principal of 1 to 255
// characters (any, here 255 four-byte ones and control characters), a key of 255 visible
// ASCII characters, an action of 1000 characters: claimed, listed as stuck, released by an
// operator, taken over, completed, replayed; one more character is 22023. idem_stuck's p_limit
// "1 to 10,000"; a token that no claim has (0, negative) is 55000 or false.
func TestAuditLongestArgumentsThroughTheLifecycle(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	app, _, url := appAndAdmin(t)
	ops := pgtest.Connect(t, pgtest.LoginRole(t, url, "idem_operator"))
	principal := "\n\t" + strings.Repeat("😀", 253)
	key := strings.Repeat("~", 254) + "!"
	action := strings.Repeat("é", 1000)
	begin := `SELECT outcome, attempt, provider_key FROM idem.idem_begin(p_principal => $1, p_key => $2, p_action => $3,
		p_request_sha256 => sha256('x'), p_lease => '10 minutes')`
	var outcome, pk, pk2 string
	var token, token2 int64
	if err := app.QueryRow(ctx, begin, principal, key, action).Scan(&outcome, &token, &pk); err != nil || outcome != "claimed" {
		t.Fatalf("claim with the longest arguments: %q %v", outcome, err)
	}
	var listed int64
	if err := ops.QueryRow(ctx, `SELECT attempt FROM idem.idem_stuck(p_limit => 10000) WHERE principal_id = $1 AND key = $2`,
		principal, key).Scan(&listed); err != nil || listed != token {
		t.Fatalf("idem_stuck: %d %v, want %d", listed, err, token)
	}
	if _, err := ops.Exec(ctx, `SELECT idem.idem_release_stuck($1, $2, $3, repeat('r', 1000))`, principal, key, token); err != nil {
		t.Fatalf("idem_release_stuck with a 1000-character reason: %v", err)
	}
	if err := app.QueryRow(ctx, begin, principal, key, action).Scan(&outcome, &token2, &pk2); err != nil || outcome != "claimed" || pk2 != pk {
		t.Fatalf("the retry after the release: %q %v, provider key kept %v", outcome, err, pk2 == pk)
	}
	pgtest.Exec(t, app, `SELECT idem.idem_complete($1, $2, $3, 200, '{}', 'done')`, principal, key, token2)
	if err := app.QueryRow(ctx, begin, principal, key, action).Scan(&outcome, &token2, &pk2); err != nil || outcome != "replay" {
		t.Fatalf("the replay: %q %v", outcome, err)
	}
	for _, c := range []struct {
		sql  string
		args []any
		want string
	}{
		{begin, []any{principal + "x", key, action}, "22023"},
		{begin, []any{principal, key + "x", action}, "22023"},
		{begin, []any{principal, key, action + "x"}, "22023"},
		{`SELECT * FROM idem.idem_stuck(p_limit => 10001)`, nil, "22023"},
		{`SELECT idem.idem_complete('p', 'k', 0, 200, '{}', NULL)`, nil, "55000"},
		{`SELECT idem.idem_extend('p', 'k', -1, '1 minute')`, nil, "55000"},
		{`SELECT idem.idem_step('p', 'k', -9223372036854775808, 's')`, nil, "55000"},
	} {
		conn := app
		if strings.Contains(c.sql, "idem_stuck") {
			conn = ops
		}
		if _, err := conn.Exec(ctx, c.sql, c.args...); sqlCode(err) != c.want {
			t.Errorf("%s: %s (%v), want %s", c.sql, sqlCode(err), err, c.want)
		}
	}
}

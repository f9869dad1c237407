package tests

// An adversarial DBA's review of the SQL API: hostile input, called as a login role that is
// only a member of idem_app, as a service in another language would call it from psql.

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/internal/pgtest"
)

// dbaApp connects to a fresh migrated database as a login role in idem_app, and returns that
// connection and the superuser's.
func dbaApp(t *testing.T) (app, admin *pgx.Conn, url string) {
	t.Helper()
	url = pgtest.NewDB(t)
	admin = pgtest.Connect(t, url)
	app = pgtest.Connect(t, pgtest.LoginRole(t, url, "idem_app"))
	return app, admin, url
}

// TestDBABeginStepsAnswersAsBeginDoes: docs/sql-api.md, idem_begin_steps: "idem_begin with
// the same arguments, the same answers and the same errors". With a valid lease and TTL of one
// microsecond each ("A positive interval"), idem_begin answers claimed; idem_begin_steps raised
// 55000 from its inner idem_recovery (which refuses a lease claim whose TTL has passed, as it
// has a few microseconds after the claim) and the claim rolled back with the statement. It
// reads the claim it just made without that test now.
func TestDBABeginStepsAnswersAsBeginDoes(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	app, _, _ := dbaApp(t)
	var outcome string
	if err := app.QueryRow(ctx, `SELECT outcome FROM idem.idem_begin(p_principal => 'alice', p_key => 'k1', p_action => 'POST /v1/payouts',
		p_request_sha256 => sha256('p'), p_ttl => '1 microsecond', p_lease => '1 microsecond')`).Scan(&outcome); err != nil || outcome != "claimed" {
		t.Fatalf("idem_begin: %q, %v", outcome, err)
	}
	outcome = ""
	err := app.QueryRow(ctx, `SELECT outcome FROM idem.idem_begin_steps(p_principal => 'alice', p_key => 'k2', p_action => 'POST /v1/payouts',
		p_request_sha256 => sha256('p'), p_ttl => '1 microsecond', p_lease => '1 microsecond')`).Scan(&outcome)
	if err != nil || outcome != "claimed" {
		t.Errorf("idem_begin_steps with the arguments idem_begin claims with: outcome %q, error %v (SQLSTATE %s); want claimed, as idem_begin",
			outcome, err, sqlCode(err))
	}
}

// TestDBAAnswerKeptTheTTLWhenClaimedInAProcedure: docs/sql-api.md, "How long a key lives":
// "An answer is replayable for at least the TTL after it was stored (by idem_complete or
// idem_save_final), however long the work took ... For a transactional claim the answer is
// kept the TTL after it is stored plus the time its transaction ran before the claim's
// statement ..., so an answer may be kept a little longer than the TTL, never less."
//
// A DBA's batch (a DO block or a procedure, as pg_cron runs them) that commits between keys:
// each transaction after the first starts later than the statement that runs the block. The
// fresh claim's expiry was counted from statement_timestamp() (the block's start), but
// idem_complete moves it on only by the time since transaction_timestamp() (this transaction's
// start), so the answer lost the time the block ran before this transaction: it was kept
// until before the moment it was stored, and the client's retry claimed the key again and
// repeated the work. A fresh claim counts from the later of the two now.
func TestDBAAnswerKeptTheTTLWhenClaimedInAProcedure(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	app, _, _ := dbaApp(t)
	// An earlier batch of the block took 3 seconds; then one key, claimed, worked and answered
	// in a transaction of its own, with a TTL of 2 seconds.
	if _, err := app.Exec(ctx, `DO $$
		DECLARE r record;
		BEGIN
			PERFORM pg_sleep(3);
			COMMIT;
			SELECT * INTO r FROM idem.idem_begin(p_principal => 'alice', p_key => 'batch-1', p_action => 'POST /v1/transfers',
			                                     p_request_sha256 => sha256('t'), p_ttl => '2 seconds');
			PERFORM idem.idem_complete(p_principal => 'alice', p_key => 'batch-1', p_attempt => r.attempt, p_status => 201,
			                           p_headers => '{}', p_body => 'first');
			COMMIT;
		END $$`, pgx.QueryExecModeSimpleProtocol); err != nil {
		t.Fatal(err)
	}
	// The client's retry, right after the answer was stored (well within 2 seconds).
	tx, err := app.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	var outcome string
	var kept, now string
	if err := tx.QueryRow(ctx, `SELECT k.kept_until::text, clock_timestamp()::text FROM idem.idem_key('alice', 'batch-1') AS k`).Scan(&kept, &now); err != nil {
		t.Fatal(err)
	}
	if err := tx.QueryRow(ctx, `SELECT outcome FROM idem.idem_begin(p_principal => 'alice', p_key => 'batch-1', p_action => 'POST /v1/transfers',
		p_request_sha256 => sha256('t'), p_ttl => '2 seconds')`).Scan(&outcome); err != nil {
		t.Fatal(err)
	}
	if outcome != "replay" {
		t.Errorf("retry right after the answer (TTL 2 s) was stored: %q, want replay; the answer was kept until %s, and it is now %s",
			outcome, kept, now)
	}
}

// TestAnswerKeptTheTTLPlusTheTimeBeforeTheClaim: docs/sql-api.md, "How long a key lives": "For
// a transactional claim the answer is kept the TTL after it is stored plus the time its
// transaction ran before the claim's statement". A transaction that runs a second before its
// claim keeps its answer the TTL and that second.
func TestAnswerKeptTheTTLPlusTheTimeBeforeTheClaim(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	app, _, _ := dbaApp(t)
	tx, err := app.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	pgtest.Exec(t, tx, `SELECT pg_sleep(1)`)
	var token int64
	if err := tx.QueryRow(ctx, `SELECT attempt FROM idem.idem_begin(p_principal => 'alice', p_key => 'late-claim',
		p_action => 'POST /v1/transfers', p_request_sha256 => sha256('t'), p_ttl => '10 seconds')`).Scan(&token); err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, tx, `SELECT pg_sleep(1)`)
	var stored time.Time
	if err := tx.QueryRow(ctx, `SELECT clock_timestamp() FROM idem.idem_complete(p_principal => 'alice', p_key => 'late-claim',
		p_attempt => $1, p_status => 201, p_headers => '{}', p_body => 'first')`, token).Scan(&stored); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	var kept time.Time
	if err := app.QueryRow(ctx, `SELECT kept_until FROM idem.idem_key('alice', 'late-claim')`).Scan(&kept); err != nil {
		t.Fatal(err)
	}
	if d := kept.Sub(stored); d < 10900*time.Millisecond || d > 11500*time.Millisecond {
		t.Errorf("the answer is kept %s after it was stored, want the TTL (10 s) and the second before the claim", d)
	}
}

// TestDBALeaseCountsFromTheCallInAProcedure: docs/sql-api.md, idem_begin: "A committed lease
// claim still running: in_progress", and "The lease of a fresh lease claim counts from when
// the database received the call ... A caller that keeps the lease alive must count its own
// deadline from just before it sent the call ...: its deadline then ends first, on every
// path."
//
// In a DO block or procedure that commits between keys (a DBA's batch, a pg_cron job), a fresh
// lease claim's lease was counted from statement_timestamp(), the start of the whole block, not
// from its transaction: a claim made 3 seconds into the block with a lease of 2 seconds had run
// out before it was made, and a duplicate on another connection took the key over at once, so
// two attempts did the work. It counts from the start of the claim's transaction now.
func TestDBALeaseCountsFromTheCallInAProcedure(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	app, _, url := dbaApp(t)
	dup := pgtest.Connect(t, pgtest.LoginRole(t, url, "idem_app"))
	if _, err := app.Exec(ctx, `DO $$
		BEGIN
			PERFORM pg_sleep(3);
			COMMIT;
			-- The holder's deadline: 2 seconds from just before this call.
			PERFORM idem.idem_begin(p_principal => 'alice', p_key => 'job-1', p_action => 'POST /v1/payouts',
			                        p_request_sha256 => sha256('p'), p_lease => '2 seconds');
			COMMIT;
		END $$`, pgx.QueryExecModeSimpleProtocol); err != nil {
		t.Fatal(err)
	}
	// A duplicate a few milliseconds after the claim was made and committed.
	var outcome string
	var retryAfter *time.Duration
	if err := dup.QueryRow(ctx, `SELECT outcome, retry_after FROM idem.idem_begin(p_principal => 'alice', p_key => 'job-1',
		p_action => 'POST /v1/payouts', p_request_sha256 => sha256('p'), p_lease => '2 seconds')`).Scan(&outcome, &retryAfter); err != nil {
		t.Fatal(err)
	}
	if outcome != "in_progress" {
		t.Errorf("duplicate right after a lease claim of 2 s was made: %q, want in_progress (the lease was counted from the block's start, 3 s before the call)", outcome)
	}
}

// TestDBATTLDoesNotDependOnTheSessionTimeZone: docs/sql-api.md, "How long a key lives": "An
// answer is replayable for at least the TTL after it was stored", p_ttl compared "as
// PostgreSQL compares intervals" (where '1 day' is 24 hours). The claim's expiry was computed
// as timestamptz + p_ttl in the caller's session TimeZone, so a TTL with a day part was a
// calendar day of the session's zone: 23 hours across a daylight-saving change. A TTL or lease
// with a day part is given in hours first now (include/in_hours.sql). The zone here is a POSIX
// rule whose daylight-saving time starts one hour from now, as a European zone's does on the
// last Sunday of March.
func TestDBATTLDoesNotDependOnTheSessionTimeZone(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	app, _, _ := dbaApp(t)
	start := time.Now().UTC().Add(time.Hour)
	n := start.YearDay() - 1 // POSIX "n": zero-based day of the year, leap days counted
	zone := fmt.Sprintf("AAA0BBB,%d/%02d:%02d,%d/%02d:%02d", n, start.Hour(), start.Minute(), (n+180)%365, start.Hour(), start.Minute())
	pgtest.Exec(t, app, fmt.Sprintf(`SET TimeZone = '%s'`, zone))
	tx, err := app.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	var token int64
	if err := tx.QueryRow(ctx, `SELECT attempt FROM idem.idem_begin(p_principal => 'alice', p_key => 'k1', p_action => 'POST /v1/transfers',
		p_request_sha256 => sha256('t'), p_ttl => '1 day')`).Scan(&token); err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `SELECT idem.idem_complete(p_principal => 'alice', p_key => 'k1', p_attempt => $1, p_status => 201,
		p_headers => '{}', p_body => 'ok')`, token); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	var kept time.Duration
	if err := app.QueryRow(ctx, `SELECT k.kept_until - clock_timestamp() FROM idem.idem_key('alice', 'k1') AS k`).Scan(&kept); err != nil {
		t.Fatal(err)
	}
	if kept < 24*time.Hour-time.Minute {
		t.Errorf("an answer stored with p_ttl '1 day' under TimeZone %q is kept %v from now, want at least 24 hours ('1 day' as PostgreSQL compares intervals)", zone, kept)
	}
	// A lease of a day, and one extended by a day, last 24 hours too.
	var lease, extended time.Duration
	if err := app.QueryRow(ctx, `SELECT b.attempt FROM idem.idem_begin(p_principal => 'alice', p_key => 'k2', p_action => 'POST /v1/payouts',
		p_request_sha256 => sha256('p'), p_lease => '1 day') AS b`).Scan(&token); err != nil {
		t.Fatal(err)
	}
	if err := app.QueryRow(ctx, `SELECT k.lease_expires_at - clock_timestamp() FROM idem.idem_key('alice', 'k2') AS k`).Scan(&lease); err != nil {
		t.Fatal(err)
	}
	if err := app.QueryRow(ctx, `SELECT idem.idem_extend('alice', 'k2', $1, '1 day') - clock_timestamp()`, token).Scan(&extended); err != nil {
		t.Fatal(err)
	}
	if lease < 24*time.Hour-time.Minute || extended < 24*time.Hour-time.Minute {
		t.Errorf("under TimeZone %q a lease of '1 day' runs %v from now, extended by '1 day' %v: want 24 hours each", zone, lease, extended)
	}
}

// TestDBAHugeCalendarIntervalsAreRefusedClearly: a TTL or a lease with a year, month or day part
// is given in hours (computed in integers) before it is used; one far past the 10-year limit must
// still get the limit's 22023, not an integer overflow (22003) from that computation.
func TestDBAHugeCalendarIntervalsAreRefusedClearly(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	app, _, _ := dbaApp(t)
	for _, call := range []string{
		`SELECT outcome FROM idem.idem_begin(p_principal => 'alice', p_key => 'huge-ttl', p_action => 'POST /v1/transfers',
			p_request_sha256 => sha256('t'), p_ttl => '1000000 years')`,
		`SELECT outcome FROM idem.idem_begin(p_principal => 'alice', p_key => 'huge-lease', p_action => 'POST /v1/payouts',
			p_request_sha256 => sha256('p'), p_lease => '100000000 days')`,
		`SELECT idem.idem_save_final(p_principal => 'alice', p_key => 'huge-final', p_action => 'POST /v1/transfers',
			p_request_sha256 => sha256('t'), p_ttl => '1000000 years', p_status => 422, p_headers => '{}', p_body => 'no')::text`,
		`SELECT idem.idem_extend('alice', 'huge-extend', 1, '1000000 years')::text`,
	} {
		var out string
		err := app.QueryRow(ctx, call).Scan(&out)
		if sqlCode(err) != "22023" || !strings.Contains(err.Error(), "at most 10 years") {
			t.Errorf("%s: %q, %v (SQLSTATE %s); want 22023, at most 10 years", call, out, err, sqlCode(err))
		}
	}
}

package tests

// A mutation review of the SQL functions off the claim's main path (D235): single-point
// changes of sql/functions that the rest of the suite let through, most of them in the
// operators' views. Each test here failed with its change applied; the comment names the
// promise it keeps.

import (
	"context"
	"testing"

	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestSQLRunOutAsSoonAsTakeoverIsPossible: docs/sql-api.md ("For operators"): idem_stuck says of
// each claim "when its lease ends and whether it ran out", idem_health counts the "leases run out
// (their work is dead, or a retry will take them over)". A lease that ended a moment ago is one
// that a retry takes over now (idem_begin answers claimed): both views must count it run out at
// once, not some time after its end.
func TestSQLRunOutAsSoonAsTakeoverIsPossible(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.NewDB(t)
	app := pgtest.Connect(t, pgtest.LoginRole(t, url, "idem_app"))
	op := pgtest.Connect(t, pgtest.LoginRole(t, url, "idem_operator"))

	var outcome string
	if err := app.QueryRow(ctx, `SELECT outcome FROM idem.idem_begin(p_principal => 'ops', p_key => 'short',
		p_action => 'POST /v1/jobs', p_request_sha256 => sha256('job'), p_lease => '20 milliseconds')`).Scan(&outcome); err != nil || outcome != "claimed" {
		t.Fatalf("claim: %q %v", outcome, err)
	}
	owner := pgtest.Connect(t, url)
	pgtest.WaitFor(t, owner, `SELECT count(*) FROM idem.idempotency_keys WHERE key = 'short'
		AND lease_expires_at < clock_timestamp() - interval '30 milliseconds'`)

	var runOut bool
	if err := op.QueryRow(ctx, `SELECT lease_run_out FROM idem.idem_stuck() WHERE key = 'short'`).Scan(&runOut); err != nil {
		t.Fatal(err)
	}
	var healthRunOut int64
	if err := app.QueryRow(ctx, `SELECT leases_run_out FROM idem.idem_health()`).Scan(&healthRunOut); err != nil {
		t.Fatal(err)
	}
	// What the views say is what a retry finds: it takes the key over (rolled back).
	tx, err := app.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if err := tx.QueryRow(ctx, `SELECT outcome FROM idem.idem_begin(p_principal => 'ops', p_key => 'short',
		p_action => 'POST /v1/jobs', p_request_sha256 => sha256('job'), p_lease => '1 minute')`).Scan(&outcome); err != nil || outcome != "claimed" {
		t.Fatalf("the retry after the lease's end: %q %v, want claimed (a takeover)", outcome, err)
	}
	if !runOut || healthRunOut != 1 {
		t.Fatalf("a lease that ended and that a retry takes over: idem_stuck's lease_run_out %v, idem_health's "+
			"leases_run_out %d; want true and 1", runOut, healthRunOut)
	}
}

// TestSQLSummaryOfAnAnsweredLeaseClaim: docs/sql-api.md ("For operators"): idem_summary gives "the
// keys by state ... in_progress are committed lease claims ..., leases_run_out those whose lease
// ran out (their work is dead, or a retry will take them over) ...; the oldest claim in progress
// and its age". A lease claim answered by idem_complete is completed: no claim in progress, no
// lease run out once its answer's time has passed, and no oldest claim, although its row keeps its
// claim time.
func TestSQLSummaryOfAnAnsweredLeaseClaim(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.NewDB(t)
	app := pgtest.Connect(t, pgtest.LoginRole(t, url, "idem_app"))

	var token int64
	if err := app.QueryRow(ctx, `SELECT attempt FROM idem.idem_begin(p_principal => 'ops', p_key => 'answered',
		p_action => 'POST /v1/jobs', p_request_sha256 => sha256('job'), p_ttl => '50 milliseconds',
		p_lease => '1 minute')`).Scan(&token); err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, app, `SELECT idem.idem_complete('ops', 'answered', $1, 201, '{}', 'ok')`, token)
	// The answer is kept 50 ms; then the key is expired for the API (its row waits for cleanup,
	// which deletes it once its claim's TTL, past the lease's end, has passed too).
	pgtest.WaitFor(t, app, `SELECT count(*) FROM idem.idem_key('ops', 'answered') WHERE expired`)

	var keys, inProgress, completed, runOut int64
	var oldestSet bool
	if err := app.QueryRow(ctx, `SELECT keys, in_progress, completed, leases_run_out, oldest_in_progress_at IS NOT NULL
		FROM idem.idem_summary()`).Scan(&keys, &inProgress, &completed, &runOut, &oldestSet); err != nil {
		t.Fatal(err)
	}
	if keys != 1 || completed != 1 || inProgress != 0 || runOut != 0 || oldestSet {
		t.Fatalf("idem_summary of one answered lease claim: %d keys, %d completed, %d in progress, %d leases run out, "+
			"an oldest claim in progress: %v; want 1, 1, 0, 0 and none", keys, completed, inProgress, runOut, oldestSet)
	}
}

// TestSQLAnswerStillKeptIsNoBacklog: docs/sql-api.md ("The life of a key", idem_cleanup, "For
// operators"): an answer is kept the TTL after it was given, and a key is expired only once "their
// TTL ran out, no lease on them still runs and no answer is still kept"; idem_summary's expired and
// idem_health's cleanup_backlog are "the keys that cleanup has not deleted yet". A transactional
// claim whose transaction ran longer than its TTL has a claim expiry in the past but its answer
// kept the TTL after the answer: it is neither expired nor in the backlog (cleanup would not delete
// it), and a retry replays it.
func TestSQLAnswerStillKeptIsNoBacklog(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.NewDB(t)
	app := pgtest.Connect(t, pgtest.LoginRole(t, url, "idem_app"))

	tx, err := app.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	var token int64
	if err := tx.QueryRow(ctx, `SELECT attempt FROM idem.idem_begin(p_principal => 'ops', p_key => 'slow-tx',
		p_action => 'POST /v1/orders', p_request_sha256 => sha256('order'), p_ttl => '2 seconds')`).Scan(&token); err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, tx, `SELECT pg_sleep(2.3)`) // the work outlasts the TTL
	pgtest.Exec(t, tx, `SELECT idem.idem_complete('ops', 'slow-tx', $1, 201, '{}', 'ok')`, token)
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}

	var expired, backlog int64
	if err := app.QueryRow(ctx, `SELECT s.expired, h.cleanup_backlog FROM idem.idem_summary() AS s, idem.idem_health() AS h`).
		Scan(&expired, &backlog); err != nil {
		t.Fatal(err)
	}
	var outcome string
	if err := app.QueryRow(ctx, `SELECT outcome FROM idem.idem_begin(p_principal => 'ops', p_key => 'slow-tx',
		p_action => 'POST /v1/orders', p_request_sha256 => sha256('order'), p_ttl => '2 seconds')`).Scan(&outcome); err != nil {
		t.Fatal(err)
	}
	if outcome != "replay" {
		t.Fatalf("the retry right after the answer: %q, want replay (the answer is kept the TTL after it)", outcome)
	}
	if expired != 0 || backlog != 0 {
		t.Fatalf("an answer still kept (a retry replays it): idem_summary counts %d expired, idem_health %d in the "+
			"cleanup backlog; want 0 and 0", expired, backlog)
	}
}

// TestSQLStuckRefusesANegativeDayPart: docs/sql-api.md ("For operators"): idem_stuck's p_older_than
// is "at least zero in every part"; "SQLSTATEs": 22023 for "idem_stuck's age negative in any part".
// '-1 day 25 hours' is an hour as a whole, and its time part is positive: only its day part is
// negative, which must be refused as '-1 month 31 days' is.
func TestSQLStuckRefusesANegativeDayPart(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.NewDB(t)
	op := pgtest.Connect(t, pgtest.LoginRole(t, url, "idem_operator"))
	_, err := op.Exec(ctx, `SELECT * FROM idem.idem_stuck('-1 day 25 hours')`)
	if code := sqlCode(err); code != "22023" {
		t.Fatalf("idem_stuck('-1 day 25 hours'): %v (SQLSTATE %q); want 22023, an age negative in a part", err, code)
	}
}

// TestSQLSummaryCountsAnExpiredReleasedKeyAsReleased: docs/sql-api.md ("For operators"):
// idem_summary gives "the keys by state, as each row's state is", and expired "the keys that
// cleanup has not deleted yet" beside them. A released key whose TTL then ran out is still a
// released row until cleanup deletes it: counted released, and expired too.
func TestSQLSummaryCountsAnExpiredReleasedKeyAsReleased(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.NewDB(t)
	app := pgtest.Connect(t, pgtest.LoginRole(t, url, "idem_app"))

	var token int64
	if err := app.QueryRow(ctx, `SELECT attempt FROM idem.idem_begin(p_principal => 'ops', p_key => 'let-go',
		p_action => 'POST /v1/jobs', p_request_sha256 => sha256('job'), p_ttl => '1 second',
		p_lease => '1 second')`).Scan(&token); err != nil {
		t.Fatal(err)
	}
	var released bool
	if err := app.QueryRow(ctx, `SELECT idem.idem_release('ops', 'let-go', $1)`, token).Scan(&released); err != nil || !released {
		t.Fatalf("idem_release: %v %v", released, err)
	}
	pgtest.WaitFor(t, app, `SELECT count(*) FROM idem.idem_key('ops', 'let-go') WHERE expired`)

	var keys, releasedN, expired int64
	if err := app.QueryRow(ctx, `SELECT keys, released, expired FROM idem.idem_summary()`).Scan(&keys, &releasedN, &expired); err != nil {
		t.Fatal(err)
	}
	if keys != 1 || releasedN != 1 || expired != 1 {
		t.Fatalf("idem_summary of one released key whose TTL ran out: %d keys, %d released, %d expired; want 1, 1, 1",
			keys, releasedN, expired)
	}
}

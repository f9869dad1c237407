package tests

// An operator's review of cleanup and the operators' functions against docs/operations.md and
// docs/sql-api.md, as the roles the docs name.

import (
	"context"
	"testing"
	"time"

	"github.com/pgidem/pgidem/internal/dbidem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestMaintenanceLockPausesThePgCronCleaner: docs/operations.md ("Cleanup") tells an operator to
// pause every cleaner for a maintenance window by holding the cleanup lock
// (`pg_advisory_xact_lock(29665259344325742)`), and says pg_cron can do what `server cleanup`
// does. The documented pg_cron job, `CALL idem.idem_cleanup_all(5000)`, took no part in that
// lock and deleted every expired key in the middle of the window. It waits for the lock now,
// batch by batch, as `server cleanup` does (D177).
func TestMaintenanceLockPausesThePgCronCleaner(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.NewDB(t)
	owner := pgtest.Connect(t, url) // the owner of schema idem: the role the pg_cron recipe schedules as
	pgtest.InsertExpired(t, owner, "p", 300)

	// The maintenance window, as docs/operations.md shows it, as another role.
	maint := pgtest.Connect(t, pgtest.LoginRole(t, url, "idem_operator"))
	pgtest.Exec(t, maint, `BEGIN`)
	pgtest.Exec(t, maint, `SELECT pg_advisory_xact_lock(29665259344325742)`)
	defer func() { _, _ = maint.Exec(ctx, `ROLLBACK`) }()
	if dbidem.CleanupLock != 29665259344325742 {
		t.Fatalf("idem.CleanupLock is %d; the docs and idem_cleanup_all name 29665259344325742", dbidem.CleanupLock)
	}

	// What pg_cron runs every minute (docs/snippets/pg_cron.sql).
	cron := pgtest.Connect(t, url)
	var pid uint32
	if err := cron.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
		t.Fatal(err)
	}
	type result struct {
		deleted int64
		err     error
	}
	done := make(chan result, 1)
	go func() {
		var r result
		r.err = cron.QueryRow(ctx, `CALL idem.idem_cleanup_all(5000)`).Scan(&r.deleted)
		done <- r
	}()
	pgtest.WaitUntilBlocked(t, owner, pid)
	if left := pgtest.Count(t, owner, `SELECT count(*) FROM idem.idempotency_keys`); left != 300 {
		t.Fatalf("during a maintenance window the pg_cron cleanup job deleted %d of 300 expired keys", 300-left)
	}
	pgtest.Exec(t, maint, `ROLLBACK`)
	select {
	case r := <-done:
		if r.err != nil || r.deleted != 300 {
			t.Fatalf("the pg_cron cleanup job after the window: %d deleted, %v; want 300", r.deleted, r.err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the pg_cron cleanup job did not end after the maintenance window")
	}
}

// TestStuckListsOnlyClaimsThatHoldTheirKey: docs/operations.md ("Operators"): a stuck lease
// claim "shows as in_progress ... in leases_run_out of the summary and in the gauge
// idempotency_leases_run_out"; the release flow "starts from the list": "server keys stuck 5m
// lists the lease claims in progress ... 3. server keys release PRINCIPAL KEY TOKEN ..., with the
// token from the list"; the alert IdemLeasesRunOut: "work that died with its lease held: its
// clients get 409 until a retry takes it over". docs/sql-api.md: idem_health counts "claims in
// progress, leases run out, the oldest claim (claims with work under them ...)"; and "an expired
// key is absent: the next request claims it anew".
// A lease claim whose key expired (its lease plus its TTL passed) holds nothing: the same
// request, and any other, claims the key anew. Yet until cleanup deleted it, idem_stuck listed
// it with its token, idem_health (the gauges idempotency_keys_in_progress,
// idempotency_leases_run_out, idempotency_oldest_in_progress_seconds) counts it as a claim in
// progress whose lease ran out, and the documented next step, releasing it with the token from
// the list, failed with 55000 "the key expired". Both read only claims whose key has not
// expired now (D177).
func TestStuckListsOnlyClaimsThatHoldTheirKey(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.NewDB(t)
	app := pgtest.Connect(t, pgtest.LoginRole(t, url, "idem_app"))
	op := pgtest.Connect(t, pgtest.LoginRole(t, url, "idem_operator"))
	var outcome string
	if err := app.QueryRow(ctx, `SELECT outcome FROM idem.idem_begin(p_principal => 'bob', p_key => 'payout-9',
		p_action => 'POST /v1/payouts', p_request_sha256 => sha256('payout'), p_ttl => '10 milliseconds',
		p_lease => '10 milliseconds')`).Scan(&outcome); err != nil || outcome != "claimed" {
		t.Fatalf("claim: %q %v", outcome, err)
	}
	time.Sleep(100 * time.Millisecond) // the process died; its lease and then its TTL ran out

	// The key is absent for the API: the same request claims it anew (rolled back).
	tx, err := app.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := tx.QueryRow(ctx, `SELECT outcome FROM idem.idem_begin(p_principal => 'bob', p_key => 'payout-9',
		p_action => 'POST /v1/payouts', p_request_sha256 => sha256('payout'), p_lease => '1 minute')`).Scan(&outcome); err != nil || outcome != "claimed" {
		t.Fatalf("the retry of an expired key: %q %v, want claimed", outcome, err)
	}
	_ = tx.Rollback(ctx)

	var inProgress, runOut int64
	if err := app.QueryRow(ctx, `SELECT in_progress, leases_run_out FROM idem.idem_health()`).Scan(&inProgress, &runOut); err != nil {
		t.Fatal(err)
	}
	var token int64
	listed := true
	if err := op.QueryRow(ctx, `SELECT attempt FROM idem.idem_stuck() WHERE principal_id = 'bob' AND key = 'payout-9'`).Scan(&token); err != nil {
		listed = false
	}
	var releaseErr error
	if listed {
		_, releaseErr = op.Exec(ctx, `SELECT idem.idem_release_stuck('bob', 'payout-9', $1, 'process killed')`, token)
	}
	if inProgress != 0 || runOut != 0 || (listed && releaseErr != nil) {
		t.Fatalf("a lease claim whose key expired (absent: any request claims it anew): idem_health counts %d in progress, "+
			"%d leases run out (want 0, 0: it holds nothing, its clients get no 409); idem_stuck lists it: %v; releasing it "+
			"with the token from the list: %v (SQLSTATE %s)", inProgress, runOut, listed, releaseErr, sqlCode(releaseErr))
	}
}

// TestCleanupAllWaitsOutTheWindowUnderALockTimeout: docs/sql-api.md: "Each batch first
// waits for the cleanup lock ... a maintenance window that holds the lock pauses it until the
// window ends"; the section "Behind PgBouncer": "Nothing depends on session state: the
// functions set search_path and lock_timeout through their own SET clauses". The procedure has
// no SET clause (it cannot), so its new wait runs under the caller's lock_timeout: a pg_cron
// job whose role has one (a common guard rail, ALTER ROLE ... SET lock_timeout) fails with
// 55P03 at the window instead of waiting it out (D177's first build). Each batch's wait sets
// lock_timeout 0 for its own transaction now; the session keeps its setting.
func TestCleanupAllWaitsOutTheWindowUnderALockTimeout(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.NewDB(t)
	owner := pgtest.Connect(t, url)
	pgtest.InsertExpired(t, owner, "p", 50)

	maint := pgtest.Connect(t, pgtest.LoginRole(t, url, "idem_operator"))
	pgtest.Exec(t, maint, `BEGIN`)
	pgtest.Exec(t, maint, `SELECT pg_advisory_xact_lock(29665259344325742)`)
	defer func() { _, _ = maint.Exec(ctx, `ROLLBACK`) }()

	cron := pgtest.Connect(t, url)
	pgtest.Exec(t, cron, `SET lock_timeout = '500ms'`) // as ALTER ROLE ... SET lock_timeout gives every session of the role
	done := make(chan error, 1)
	go func() {
		var n int64
		done <- cron.QueryRow(ctx, `CALL idem.idem_cleanup_all(5000)`).Scan(&n)
	}()
	select {
	case err := <-done:
		t.Fatalf("the pg_cron job ended during the maintenance window: %v; want it to wait until the window ends", err)
	case <-time.After(2 * time.Second):
	}
	pgtest.Exec(t, maint, `ROLLBACK`)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	var lt string
	if err := cron.QueryRow(ctx, `SHOW lock_timeout`).Scan(&lt); err != nil || lt != "500ms" {
		t.Fatalf("the session's lock_timeout after the CALL: %q %v, want 500ms as it was", lt, err)
	}
}

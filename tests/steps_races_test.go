package tests

import (
	"context"
	"strings"
	"testing"

	"github.com/pgidem/pgidem/internal/pgtest"
)

func stepsClaim(t *testing.T, q pgtest.Querier, principal, key, body, lease string) (string, int64, string) {
	t.Helper()
	var outcome, pk string
	var attempt int64
	var leaseArg any
	if lease != "" {
		leaseArg = lease
	}
	if err := q.QueryRow(context.Background(), `SELECT outcome, attempt, coalesce(provider_key, '') FROM idem.idem_begin_steps($1, $2, 'POST /x', sha256($3::bytea), p_lease => $4::interval)`,
		principal, key, body, leaseArg).Scan(&outcome, &attempt, &pk); err != nil {
		t.Fatalf("claim: %v", err)
	}
	return outcome, attempt, pk
}

// TestStepsRecordedAtOnce: two connections record the same step of the same token at once; the second waits for
// the first and gets 23505; different names merge.
func TestStepsRecordedAtOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.NewDB(t)
	appURL := pgtest.LoginRole(t, url, "idem_app")
	a := pgtest.Connect(t, appURL)
	b := pgtest.Connect(t, appURL)
	admin := pgtest.Connect(t, url)
	_, tok, _ := stepsClaim(t, a, "p", "k", "x", "1 minute")
	txa, err := a.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := txa.Exec(ctx, `SELECT idem.idem_step('p', 'k', $1, 'one', '1')`, tok); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		_, err := b.Exec(ctx, `SELECT idem.idem_step('p', 'k', $1, 'one', '2')`, tok)
		done <- err
	}()
	pgtest.WaitUntilBlocked(t, admin, b.PgConn().PID())
	if err := txa.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-done; sqlCode(err) != "23505" {
		t.Fatalf("second idem_step of the same step: %v, want 23505", err)
	}
	// different names, concurrently
	txa, _ = a.Begin(ctx)
	if _, err := txa.Exec(ctx, `SELECT idem.idem_step('p', 'k', $1, 'two', '2')`, tok); err != nil {
		t.Fatal(err)
	}
	go func() {
		_, err := b.Exec(ctx, `SELECT idem.idem_step('p', 'k', $1, 'three', '3')`, tok)
		done <- err
	}()
	pgtest.WaitUntilBlocked(t, admin, b.PgConn().PID())
	_ = txa.Commit(ctx)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	var saved string
	var point string
	if err := a.QueryRow(ctx, `SELECT recovery_point, recovery_saved::text FROM idem.idem_recovery('p', 'k', $1)`, tok).Scan(&point, &saved); err != nil {
		t.Fatal(err)
	}
	if saved != `{"one": 1, "two": 2, "three": 3}` || point != "three" {
		t.Fatalf("saved %s point %s", saved, point)
	}
}

// TestStepsTransactionalTakeoverFencesTheHolder: a transactional takeover of a lease that ran out; the old holder's step waits for it and
// is refused once it completes.
func TestStepsTransactionalTakeoverFencesTheHolder(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.NewDB(t)
	appURL := pgtest.LoginRole(t, url, "idem_app")
	a := pgtest.Connect(t, appURL)
	b := pgtest.Connect(t, appURL)
	admin := pgtest.Connect(t, url)
	_, tok, pk := stepsClaim(t, a, "p", "k", "x", "1 minute")
	if _, err := a.Exec(ctx, `SELECT idem.idem_step('p', 'k', $1, 'one', '"v1"')`, tok); err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, admin, `UPDATE idem.idempotency_keys SET lease_expires_at = clock_timestamp() - interval '1 second'`)
	txb, err := b.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = txb.Rollback(ctx) }()
	var outcome, pk2 string
	var tok2 int64
	var point *string
	var saved *string
	if err := txb.QueryRow(ctx, `SELECT outcome, attempt, provider_key, recovery_point, recovery_saved::text FROM idem.idem_begin_steps('p', 'k', 'POST /x', sha256('x'::bytea))`).Scan(&outcome, &tok2, &pk2, &point, &saved); err != nil {
		t.Fatal(err)
	}
	if outcome != "claimed" || pk2 != pk || point == nil || *point != "one" {
		t.Fatalf("transactional takeover: %s %s/%s %v %v", outcome, pk, pk2, point, saved)
	}
	done := make(chan error, 1)
	go func() {
		_, err := a.Exec(ctx, `SELECT idem.idem_step('p', 'k', $1, 'two', '"v2"')`, tok)
		done <- err
	}()
	pgtest.WaitUntilBlocked(t, admin, a.PgConn().PID())
	if _, err := txb.Exec(ctx, `SELECT idem.idem_complete('p', 'k', $1, 200, '{}', 'ok')`, tok2); err != nil {
		t.Fatal(err)
	}
	if err := txb.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-done; sqlCode(err) != "55000" {
		t.Fatalf("old holder's step after the takeover completed: %v", err)
	}
	var rpk string
	if err := b.QueryRow(ctx, `SELECT outcome || provider_key FROM idem.idem_begin('p', 'k', 'POST /x', sha256('x'::bytea))`).Scan(&rpk); err != nil {
		t.Fatal(err)
	}
	if rpk != "replay"+pk {
		t.Fatalf("replay %s, want the same provider key", rpk)
	}
}

// TestStepsHostileNamesAsTheAppRole: hostile names and sizes as the app role.
func TestStepsHostileNamesAsTheAppRole(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.NewDB(t)
	a := pgtest.Connect(t, pgtest.LoginRole(t, url, "idem_app"))
	_, tok, _ := stepsClaim(t, a, "p", "k", "x", "1 minute")
	step := func(name any, saved any) string {
		tx, err := a.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = tx.Rollback(ctx) }()
		_, err = tx.Exec(ctx, `SELECT idem.idem_step('p', 'k', $1, $2, $3::jsonb)`, tok, name, saved)
		if err == nil {
			_ = tx.Commit(ctx)
		}
		return sqlCode(err)
	}
	cases := []struct {
		name  any
		saved any
		want  string
	}{
		{"", nil, "22023"},
		{nil, nil, "22004"},
		{strings.Repeat("😀", 255), nil, "ok"},
		{strings.Repeat("é", 256), nil, "22023"},
		{"a\"b\\c\n", `{"x":"\\u0000"}`, "ok"},
		{"big", `"` + strings.Repeat("x", 9000) + `"`, "22023"},
		{"0", `null`, "ok"},
	}
	for _, c := range cases {
		if got := step(c.name, c.saved); got != c.want {
			t.Errorf("step %.20v: %s, want %s", c.name, got, c.want)
		}
	}
	var saved string
	if err := a.QueryRow(ctx, `SELECT recovery_saved::text FROM idem.idem_recovery('p', 'k', $1)`, tok).Scan(&saved); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(saved, `"0": null`) {
		t.Fatalf("saved %.80s...: the NULL value is not JSON null", saved)
	}
}

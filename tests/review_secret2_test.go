package tests

import (
	"context"
	"encoding/hex"
	"fmt"
	"strings"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgidem/pgidem/internal/pgtest"
)

// secretClaim runs idem_begin as a lease claim of alice's key on q and returns outcome, attempt and
// provider key.
func secretClaim(t *testing.T, q pgtest.Querier, key string) (string, int64, string) {
	t.Helper()
	var outcome, pk string
	var attempt int64
	if err := q.QueryRow(context.Background(), `SELECT outcome, attempt, provider_key FROM idem.idem_begin('alice', $1,
		'POST /payouts', sha256('100'), p_lease => interval '1 minute')`, key).Scan(&outcome, &attempt, &pk); err != nil {
		t.Fatalf("claim %s: %v", key, err)
	}
	return outcome, attempt, pk
}

// TestConcurrentNewInstallationSecretsKeepAGenerationsKey (D158; it failed before): two runs of
// idem_new_installation_secret that overlap (the second one starts while the first one waits
// for older transactions; the LOCK TABLE in the procedure serializes only their first
// transactions). Run B computed its first token from token_seq's last value, which run A has
// not moved yet: B's secret starts right above A's (t3 = t2 + the few draws made between
// them), not 2^32 draws away. Run A then moves the sequence to t2, having waited only for the
// transactions older than A's own secret, not for those older than B's. A transaction X that
// started between A's commit and B's (so it planned the provider key with the lists {s1, s2})
// and is still open draws t3 right after A's move: it gives its generation the key of s2, while
// every other session (lists {s1, s2, s3}) gives the same generation the key of s3. One
// generation, two provider keys (docs/sql-api.md, "Generations and provider keys": "a duplicate
// while the work runs ... the same"; the procedure's own comment: "no claim ever gives a token
// of the new secret the key of an older one"). Now B's secret starts 2^32 above A's, and X's
// claim draws a token of A's secret.
//
// The gap is held open by transactions (H, X), not by timing.
func TestConcurrentNewInstallationSecretsKeepAGenerationsKey(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.NewDB(t)
	owner := pgtest.Connect(t, url)
	sleeping := `SELECT count(*) >= $1::int FROM pg_stat_activity WHERE datname = current_database()
		AND query LIKE 'CALL idem.idem_new_installation_secret%' AND wait_event = 'PgSleep'`
	asInt := `SELECT CASE WHEN (` + sleeping + `) THEN 1 ELSE 0 END`

	// H: a transaction older than A's secret, so that A waits.
	h := pgtest.Connect(t, url)
	pgtest.Exec(t, h, `BEGIN`)
	pgtest.Exec(t, h, `SELECT 1`)

	runA := make(chan error, 1)
	go func() {
		_, err := pgtest.Connect(t, url).Exec(ctx, `CALL idem.idem_new_installation_secret(p_wait => '1 minute')`)
		runA <- err
	}()
	pgtest.WaitFor(t, owner, asInt, 1)

	// X: starts after A's secret committed, plans the fresh claim's provider key with {s1, s2}.
	x := pgtest.Connect(t, pgtest.LoginRole(t, url, "idem_app"))
	pgtest.Exec(t, x, `BEGIN`)
	if o, _, _ := secretClaim(t, x, "warm"); o != "claimed" {
		t.Fatalf("warm: %s", o)
	}

	// B: a second run while A waits.
	runB := make(chan error, 1)
	go func() {
		_, err := pgtest.Connect(t, url).Exec(ctx, `CALL idem.idem_new_installation_secret(p_wait => '1 minute')`)
		runB <- err
	}()
	pgtest.WaitFor(t, owner, asInt, 2)
	var froms []int64
	rows, err := owner.Query(ctx, `SELECT from_token FROM idem.installation_secrets ORDER BY from_token`)
	if err != nil {
		t.Fatal(err)
	}
	froms, err = pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("secrets from tokens %v", froms)

	// H ends: A moves the tokens to its secret and returns (B still waits, for X).
	pgtest.Exec(t, h, `COMMIT`)
	if err := <-runA; err != nil {
		t.Fatalf("run A: %v", err)
	}
	// Another session takes token t2; X's next claim draws the one above it.
	other := pgtest.Connect(t, url)
	_, burnt, _ := secretClaim(t, other, "burn")
	outcome, attempt, xKey := secretClaim(t, x, "victim")
	if outcome != "claimed" {
		t.Fatalf("victim: %s", outcome)
	}
	pgtest.Exec(t, x, `COMMIT`)
	if err := <-runB; err != nil {
		t.Fatalf("run B: %v", err)
	}
	t.Logf("burn took token %d, the victim's generation is token %d", burnt, attempt)

	// A duplicate of the victim's request, from a fresh session: in_progress, the same generation.
	dupOutcome, _, dupKey := secretClaim(t, pgtest.Connect(t, url), "victim")
	// The lease runs out; a retry takes it over in the same generation.
	pgtest.Exec(t, owner, `UPDATE idem.idempotency_keys SET lease_expires_at = clock_timestamp() - interval '1 second'
		WHERE key = 'victim'`)
	toOutcome, _, toKey := secretClaim(t, pgtest.Connect(t, url), "victim")
	if dupOutcome != "in_progress" || toOutcome != "claimed" {
		t.Fatalf("duplicate %s, takeover %s", dupOutcome, toOutcome)
	}
	if dupKey != xKey || toKey != xKey {
		t.Fatalf("one generation (token %d), several provider keys: the claim in the transaction open across the two runs gave %s, "+
			"the duplicate's in_progress %s, the takeover %s", attempt, xKey, dupKey, toKey)
	}
}

// secretClaimAs is secretClaim for any principal, with an optional fingerprint body.
func secretClaimAs(t *testing.T, q pgtest.Querier, principal, key, body string) (string, int64, string) {
	t.Helper()
	var outcome, pk string
	var attempt int64
	if err := q.QueryRow(context.Background(), `SELECT outcome, attempt, coalesce(provider_key, '') FROM idem.idem_begin($1, $2,
		'POST /payouts', sha256(convert_to($3, 'UTF8')), p_lease => interval '1 minute')`, principal, key, body).Scan(&outcome, &attempt, &pk); err != nil {
		t.Fatalf("claim %s/%s: %v", principal, key, err)
	}
	return outcome, attempt, pk
}

// TestProviderKeyFollowsGenerationsAsTheRoles (review, passes): the table of docs/sql-api.md,
// "Generations and provider keys", end to end on real sessions: a yield, an operator's
// release_stuck, a run-out lease's takeover, a duplicate and a replay keep the provider key; an
// expiry, a release, a cleanup and a save_final on a free key start a new generation with a new
// one; another principal gets another one.
func TestProviderKeyFollowsGenerationsAsTheRoles(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.NewDB(t)
	owner := pgtest.Connect(t, url)
	app := pgtest.Connect(t, pgtest.LoginRole(t, url, "idem_app"))
	op := pgtest.Connect(t, pgtest.LoginRole(t, url, "idem_operator"))
	seen := map[string]string{}
	fresh := func(what, pk string) {
		t.Helper()
		if len(pk) != 64 {
			t.Fatalf("%s: provider key %q", what, pk)
		}
		if prev, ok := seen[pk]; ok {
			t.Errorf("%s: provider key %s repeats that of %s", what, pk, prev)
		}
		seen[pk] = what
	}
	same := func(what, pk, want string) {
		t.Helper()
		if pk != want {
			t.Errorf("%s: provider key %s, want the generation's %s", what, pk, want)
		}
	}
	o, a, p1 := secretClaimAs(t, app, "alice", "k", "1")
	if o != "claimed" {
		t.Fatalf("first claim: %s", o)
	}
	fresh("first claim", p1)
	if o, _, pk := secretClaimAs(t, app, "alice", "k", "1"); o != "in_progress" {
		t.Fatalf("duplicate: %s", o)
	} else {
		same("duplicate", pk, p1)
	}
	var ok bool
	if err := app.QueryRow(ctx, `SELECT idem.idem_yield('alice', 'k', $1)`, a).Scan(&ok); err != nil || !ok {
		t.Fatalf("yield: %v %v", ok, err)
	}
	o, a, pk := secretClaimAs(t, app, "alice", "k", "1")
	if o != "claimed" {
		t.Fatalf("after yield: %s", o)
	}
	same("takeover after yield", pk, p1)
	pgtest.Exec(t, op, `SELECT idem.idem_release_stuck('alice', 'k', $1, 'review')`, a)
	o, _, pk = secretClaimAs(t, app, "alice", "k", "1")
	if o != "claimed" {
		t.Fatalf("after release_stuck: %s", o)
	}
	same("takeover after release_stuck", pk, p1)
	var stuckKey string
	if err := op.QueryRow(ctx, `SELECT provider_key FROM idem.idem_stuck() WHERE key = 'k'`).Scan(&stuckKey); err != nil {
		t.Fatal(err)
	}
	same("idem_stuck", stuckKey, p1)
	pgtest.Exec(t, owner, `UPDATE idem.idempotency_keys SET lease_expires_at = clock_timestamp() - interval '1 second' WHERE key = 'k'`)
	o, a, pk = secretClaimAs(t, app, "alice", "k", "1")
	if o != "claimed" {
		t.Fatalf("after run-out: %s", o)
	}
	same("takeover after the lease ran out", pk, p1)
	pgtest.Exec(t, app, `SELECT idem.idem_complete('alice', 'k', $1, 200, '{}', 'ok')`, a)
	o, _, pk = secretClaimAs(t, app, "alice", "k", "1")
	if o != "replay" {
		t.Fatalf("replay: %s", o)
	}
	same("replay", pk, p1)

	// Expiry: a new generation, even for the same request.
	pgtest.Exec(t, owner, `UPDATE idem.idempotency_keys SET expires_at = clock_timestamp() - interval '1 second',
		lease_expires_at = clock_timestamp() - interval '1 second' WHERE key = 'k'`)
	o, a, p2 := secretClaimAs(t, app, "alice", "k", "1")
	if o != "claimed" {
		t.Fatalf("after expiry: %s", o)
	}
	fresh("claim after expiry", p2)
	// Release: a new generation.
	if err := app.QueryRow(ctx, `SELECT idem.idem_release('alice', 'k', $1)`, a).Scan(&ok); err != nil || !ok {
		t.Fatalf("release: %v %v", ok, err)
	}
	o, a, p3 := secretClaimAs(t, app, "alice", "k", "1")
	if o != "claimed" {
		t.Fatalf("after release: %s", o)
	}
	fresh("claim after release", p3)
	// Release again, then a final answer saved on the free key: a new generation, whose replay
	// carries a new key.
	if err := app.QueryRow(ctx, `SELECT idem.idem_release('alice', 'k', $1)`, a).Scan(&ok); err != nil || !ok {
		t.Fatalf("release: %v %v", ok, err)
	}
	if err := app.QueryRow(ctx, `SELECT idem.idem_save_final('alice', 'k', 'POST /payouts', sha256(convert_to('1', 'UTF8')),
		interval '1 hour', 422, '{}', 'no')`).Scan(&ok); err != nil || !ok {
		t.Fatalf("save_final: %v %v", ok, err)
	}
	o, _, p4 := secretClaimAs(t, app, "alice", "k", "1")
	if o != "replay" {
		t.Fatalf("replay of save_final: %s", o)
	}
	fresh("replay after save_final on a released key", p4)
	// Cleanup: the expired row is deleted; the next claim starts a new generation.
	pgtest.Exec(t, owner, `UPDATE idem.idempotency_keys SET expires_at = clock_timestamp() - interval '1 second',
		lease_expires_at = NULL WHERE key = 'k'`)
	pgtest.Exec(t, app, `SELECT idem.idem_cleanup()`)
	if n := pgtest.Count(t, owner, `SELECT count(*) FROM idem.idempotency_keys WHERE key = 'k'`); n != 0 {
		t.Fatalf("cleanup left %d rows", n)
	}
	o, _, p5 := secretClaimAs(t, app, "alice", "k", "1")
	if o != "claimed" {
		t.Fatalf("after cleanup: %s", o)
	}
	fresh("claim after cleanup", p5)
	// Another principal, the same client key and request.
	_, _, pb := secretClaimAs(t, app, "bob", "k", "1")
	fresh("bob's claim", pb)
	// A principal/key split that concatenates to the same text: NUL-separated, so a new key.
	_, _, pc := secretClaimAs(t, app, "alic", "ek", "1")
	fresh("alic/ek's claim", pc)
}

// TestAutoExplainLevelDecidesWhereTheSecretGoes: docs/sql-api.md, "Where the secret's bytes
// go": the plans that hold the secret are printed to no session (idem_begin and idem_stuck run
// with debug_print_plan off and client_min_messages = notice); auto_explain with nested,
// verbose plans writes them to the server's log at its default level (LOG), which reaches no
// client. auto_explain's own log_level decides the level of its messages, though: at NOTICE
// or INFO (to see plans in psql) it sends the plan of provider_key_prefixes' query, which the
// planner runs to fold the prefixes into the provider key's plan, with the secret as a
// constant, to the application's session (client_min_messages = notice lets NOTICE through,
// and INFO always reaches the client). The docs say so; this test holds both halves.
func TestAutoExplainLevelDecidesWhereTheSecretGoes(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.NewDB(t)
	owner := pgtest.Connect(t, url)
	var values [][]byte
	if err := owner.QueryRow(ctx, `SELECT idem.installation_secret_values()`).Scan(&values); err != nil || len(values) == 0 {
		t.Fatalf("the owner reads the secrets: %v %v", values, err)
	}
	for _, level := range []string{"log", "info", "notice"} {
		login := pgtest.LoginRole(t, url, "idem_app")
		cfg, err := pgx.ParseConfig(login)
		if err != nil {
			t.Fatal(err)
		}
		for _, sql := range []string{`session_preload_libraries = 'auto_explain'`, `auto_explain.log_min_duration = 0`,
			`auto_explain.log_nested_statements = on`, `auto_explain.log_verbose = on`, `auto_explain.log_level = ` + level} {
			pgtest.Exec(t, owner, fmt.Sprintf(`ALTER ROLE %s SET %s`, cfg.User, sql))
		}
		var mu sync.Mutex
		var notices []string
		cfg.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) {
			mu.Lock()
			defer mu.Unlock()
			notices = append(notices, n.Severity+": "+n.Message+" "+n.Detail)
		}
		conn, err := pgx.ConnectConfig(ctx, cfg)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close(ctx)
		// The application's session as it is: no setting of its own.
		var pk string
		if err := conn.QueryRow(ctx, `SELECT provider_key FROM idem.idem_begin('leak', 'k', 'POST /x', sha256('x'),
			p_lease => interval '1 minute')`).Scan(&pk); err != nil {
			t.Fatal(err)
		}
		mu.Lock()
		leaked := false
		for _, n := range notices {
			for _, v := range values {
				if strings.Contains(n, hex.EncodeToString(v)) {
					leaked = true
				}
			}
		}
		mu.Unlock()
		if want := level != "log"; leaked != want {
			t.Errorf("auto_explain.log_level = %s: the secret reached the application's session: %v, want %v (%d messages)",
				level, leaked, want, len(notices))
		}
	}
}

// secretWant is the provider key that docs/sql-api.md gives alice's key for generation gen under
// the newest secret whose first token is at or below gen (one token range), computed by the
// owner from the sequences.
func secretWant(t *testing.T, owner pgtest.Querier, key string, gen int64) string {
	t.Helper()
	var want string
	if err := owner.QueryRow(context.Background(), `SELECT encode(sha256('pgidem provider key v3'::bytea || '\x00'::bytea
		|| (SELECT string_agg(int8send(pg_sequence_last_value(u.q::regclass)), ''::bytea ORDER BY u.o)
		      FROM unnest(s.secret_seqs) WITH ORDINALITY AS u(q, o)) || '\x00'::bytea
		|| 'alice'::bytea || '\x00'::bytea || convert_to($1, 'UTF8') || '\x00'::bytea || convert_to($2::bigint::text, 'UTF8')), 'hex')
		FROM idem.installation_secrets AS s WHERE s.from_token <= $2 ORDER BY s.from_token DESC LIMIT 1`, key, gen).Scan(&want); err != nil {
		t.Fatal(err)
	}
	return want
}

// TestOneRotationWithPooledSessions (review, passes): one run of idem_new_installation_secret
// against long-lived sessions: a session that planned the provider key before the run and
// claims afterwards (READ COMMITTED and REPEATABLE READ, the latter begun while the run waits),
// a lease claimed before the run by a session that keeps its old plans and taken over after it
// by a session that planned the new lists, and a run inside a transaction block that is rolled
// back: every generation keeps one provider key, the one of its token's secret.
func TestOneRotationWithPooledSessions(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.NewDB(t)
	owner := pgtest.Connect(t, url)
	oldSess := pgtest.Connect(t, pgtest.LoginRole(t, url, "idem_app"))
	rrSess := pgtest.Connect(t, pgtest.LoginRole(t, url, "idem_app"))
	newSess := pgtest.Connect(t, pgtest.LoginRole(t, url, "idem_app"))
	_, inflightTok, inflight := secretClaim(t, oldSess, "inflight")
	_, _, _ = secretClaim(t, rrSess, "warm-rr")
	if inflight != secretWant(t, owner, "inflight", inflightTok) {
		t.Fatalf("before: %s", inflight)
	}

	// A run in a transaction block: refused at its COMMIT, everything rolled back.
	pgtest.Exec(t, owner, `BEGIN`)
	if _, err := owner.Exec(ctx, `CALL idem.idem_new_installation_secret()`); err == nil {
		t.Fatal("the procedure ran in a transaction block")
	}
	pgtest.Exec(t, owner, `ROLLBACK`)
	if n := pgtest.Count(t, owner, `SELECT count(*) FROM idem.installation_secrets`); n != 1 {
		t.Fatalf("%d secrets after a rolled-back run", n)
	}
	if n := pgtest.Count(t, owner, `SELECT count(*) FROM pg_class WHERE relname LIKE 'installation_secret_2_%'`); n != 0 {
		t.Fatalf("a rolled-back run left %d sequences", n)
	}
	if _, _, pk := secretClaim(t, oldSess, "inflight"); pk != inflight {
		t.Fatalf("after a rolled-back run: %s, want %s", pk, inflight)
	}

	// A real run, held in its wait by H.
	h := pgtest.Connect(t, url)
	pgtest.Exec(t, h, `BEGIN`)
	pgtest.Exec(t, h, `SELECT 1`)
	run := make(chan error, 1)
	go func() {
		_, err := pgtest.Connect(t, url).Exec(ctx, `CALL idem.idem_new_installation_secret(p_wait => '1 minute')`)
		run <- err
	}()
	pgtest.WaitFor(t, owner, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
		AND query LIKE 'CALL idem.idem_new_installation_secret%' AND wait_event = 'PgSleep'`)
	// While it waits: a REPEATABLE READ transaction takes its snapshot, and newSess plans the new lists.
	pgtest.Exec(t, rrSess, `BEGIN ISOLATION LEVEL REPEATABLE READ`)
	pgtest.Exec(t, rrSess, `SELECT 1`)
	if _, _, pk := secretClaim(t, newSess, "inflight"); pk != inflight {
		t.Fatalf("in_progress during the wait on a session with the new lists: %s, want %s", pk, inflight)
	}
	pgtest.Exec(t, h, `COMMIT`)
	if err := <-run; err != nil {
		t.Fatal(err)
	}
	_, rrTok, rrKey := secretClaim(t, rrSess, "rr")
	pgtest.Exec(t, rrSess, `COMMIT`)
	_, afterTok, afterKey := secretClaim(t, oldSess, "after")
	from := pgtest.Count(t, owner, `SELECT max(from_token) FROM idem.installation_secrets`)
	if int64(from) > rrTok || int64(from) > afterTok {
		t.Fatalf("tokens %d, %d below the new secret's first %d", rrTok, afterTok, from)
	}
	for _, c := range []struct {
		key string
		tok int64
		got string
	}{{"rr", rrTok, rrKey}, {"after", afterTok, afterKey}} {
		if w := secretWant(t, owner, c.key, c.tok); c.got != w {
			t.Errorf("%s (token %d): %s, want the new secret's %s", c.key, c.tok, c.got, w)
		}
		for _, s := range []*pgx.Conn{oldSess, newSess, rrSess} {
			if o, _, pk := secretClaim(t, s, c.key); o != "in_progress" || pk != c.got {
				t.Errorf("%s: duplicate %s %s, want in_progress %s", c.key, o, pk, c.got)
			}
		}
	}
	// The in-flight lease runs out; a session of new plans takes it over: the same key.
	pgtest.Exec(t, owner, `UPDATE idem.idempotency_keys SET lease_expires_at = clock_timestamp() - interval '1 second' WHERE key = 'inflight'`)
	if o, _, pk := secretClaim(t, newSess, "inflight"); o != "claimed" || pk != inflight {
		t.Fatalf("takeover after the run: %s %s, want claimed %s", o, pk, inflight)
	}
	if _, _, pk := secretClaim(t, oldSess, "inflight"); pk != inflight {
		t.Fatalf("duplicate on the old session: %s, want %s", pk, inflight)
	}
}

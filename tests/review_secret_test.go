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
	"github.com/pgidem/pgidem/internal/release010"
	idemsql "github.com/pgidem/pgidem/sql"
)

// TestNewInstallationSecretVersusARepeatableReadClaim (review finding): the provider key of a
// generation must be the same for every attempt and every answer of that generation
// (docs/sql-api.md, "Generations and provider keys"). idem_new_installation_secret relies on
// "a claim reads the secrets after it drew its token": true of a READ COMMITTED statement,
// false under REPEATABLE READ or SERIALIZABLE (supported isolation levels of the SQL API),
// where the claim reads with the transaction's snapshot. A transaction whose snapshot was
// taken before the procedure's first COMMIT, and which claims after its second, draws a token
// at or above the new secret's from_token but cannot see that secret's row: idem_begin hands
// out the provider key of the OLD secret. Every later read of the generation (the
// in_progress answer to a duplicate, the takeover after the lease runs out, the replay) reads
// under a fresh snapshot and gives the NEW secret's key: one generation, two provider keys,
// so a provider that deduplicates on the key runs the work twice.
//
// Migration 006 has the same gap: a REPEATABLE READ transaction whose snapshot predates the
// migration's commit calls the new idem_begin (function bodies are looked up with a fresh
// catalog snapshot), draws from idem.token_seq, sees no secret row at all, and gives the v2
// key (no secret) for a generation that every later read gives a v3 key.
//
// The gap is held open by the transaction's snapshot, not by timing.
func TestNewInstallationSecretVersusARepeatableReadClaim(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.NewDB(t)
	owner := pgtest.Connect(t, url)
	rr := pgtest.Connect(t, url)

	pgtest.Exec(t, rr, `BEGIN ISOLATION LEVEL REPEATABLE READ`)
	pgtest.Exec(t, rr, `SELECT count(*) FROM idem.installation_secrets`) // the snapshot
	// The procedure commits the new secret, then waits for this older transaction before it
	// moves the tokens to the secret: the claim made meanwhile is in the old secret's range.
	called := make(chan error, 1)
	go func() {
		_, err := pgtest.Connect(t, url).Exec(ctx, `CALL idem.idem_new_installation_secret()`)
		called <- err
	}()
	pgtest.WaitFor(t, owner, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND query LIKE 'CALL idem.idem_new_installation_secret%'
		AND wait_event = 'PgSleep'`)
	var attempt int64
	var claimedKey, outcome string
	if err := rr.QueryRow(ctx, `SELECT outcome, attempt, provider_key FROM idem.idem_begin('alice', 'rr', 'POST /payouts',
		sha256('100'), p_lease => interval '1 minute')`).Scan(&outcome, &attempt, &claimedKey); err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, rr, `COMMIT`)
	if err := <-called; err != nil {
		t.Fatal(err)
	}
	if outcome != "claimed" {
		t.Fatalf("claim: %s", outcome)
	}
	from := pgtest.Count(t, owner, `SELECT max(from_token) FROM idem.installation_secrets`)
	t.Logf("token %d, newest secret from %d", attempt, from)

	// A duplicate while the lease runs: in_progress, the same generation.
	var dupKey string
	if err := owner.QueryRow(ctx, `SELECT outcome, provider_key FROM idem.idem_begin('alice', 'rr', 'POST /payouts',
		sha256('100'), p_lease => interval '1 minute')`).Scan(&outcome, &dupKey); err != nil {
		t.Fatal(err)
	}
	// The lease runs out; the retry takes it over in the same generation.
	pgtest.Exec(t, owner, `UPDATE idem.idempotency_keys SET lease_expires_at = clock_timestamp() - interval '1 second'
		WHERE key = 'rr'`)
	var takeoverKey string
	if err := owner.QueryRow(ctx, `SELECT outcome, provider_key FROM idem.idem_begin('alice', 'rr', 'POST /payouts',
		sha256('100'), p_lease => interval '1 minute')`).Scan(&outcome, &takeoverKey); err != nil {
		t.Fatal(err)
	}
	if outcome != "claimed" {
		t.Fatalf("takeover: %s", outcome)
	}
	if dupKey != claimedKey || takeoverKey != claimedKey {
		t.Fatalf("one generation (token %d), several provider keys: the claim under REPEATABLE READ gave %s, "+
			"the duplicate's in_progress %s, the takeover %s", attempt, claimedKey, dupKey, takeoverKey)
	}
}

// TestInstallationSecretIsTheOwnersOnly (review, passes): neither the application role nor the
// operator role can read a secret, draw or read tokens, or give the installation a new secret;
// and the application role's claims still compute their provider keys (through the SECURITY
// DEFINER functions).
func TestInstallationSecretIsTheOwnersOnly(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.NewDB(t)
	for _, group := range []string{"idem_app", "idem_operator"} {
		conn := pgtest.Connect(t, pgtest.LoginRole(t, url, group))
		for _, sql := range []string{
			`SELECT secret_seqs FROM idem.installation_secrets`,
			`SELECT count(*) FROM idem.installation_secrets`,
			`SELECT last_value FROM idem.installation_secret_1_1`,
			`SELECT pg_sequence_last_value('idem.installation_secret_1_2')`,
			`SELECT last_value FROM pg_sequences WHERE sequencename = 'installation_secret_1_3' AND last_value IS NOT NULL`,
			`SELECT idem.installation_secret_seqs()`,
			`SELECT idem.installation_secret_values()`,
			`SELECT idem.provider_key_prefixes()`,
			`SELECT idem.provider_key_bounds()`,
			`SELECT nextval('idem.token_seq')`,
			`SELECT last_value FROM idem.token_seq`,
			`SELECT setval('idem.token_seq', 1)`,
			`CALL idem.idem_new_installation_secret()`,
			`SELECT most_common_vals::text FROM pg_stats WHERE tablename = 'installation_secrets'`,
		} {
			var n int
			rows, err := conn.Query(ctx, sql)
			if err == nil {
				for rows.Next() {
					n++
				}
				rows.Close()
				err = rows.Err()
			}
			if err == nil && n > 0 {
				t.Errorf("%s may run %s (%d rows)", group, sql, n)
			}
		}
		if group == "idem_app" {
			var key string
			if err := conn.QueryRow(ctx, `SELECT provider_key FROM idem.idem_begin('alice', 'k', 'POST /x', sha256('x'),
				p_lease => interval '1 minute')`).Scan(&key); err != nil || len(key) != 64 {
				t.Fatalf("the application role's claim: %q %v", key, err)
			}
		}
	}
}

// TestUpgradeTo006VersusARepeatableReadClaim (review finding, the same gap as
// TestNewInstallationSecretVersusARepeatableReadClaim, in migration 006): a REPEATABLE READ
// transaction whose snapshot predates the migrate's commit claims after it. It runs the new
// idem_begin (function bodies are looked up afresh), draws its token from idem.token_seq (at or
// above the secret's from_token), but cannot see the secret's row: its generation gets the v2
// provider key, without the secret, and every later read of the generation (here the
// in_progress answer to a duplicate) the v3 key, with it.
func TestUpgradeTo006VersusARepeatableReadClaim(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.NewEmptyDB(t)
	owner := pgtest.Connect(t, url)
	if err := release010.Install(ctx, owner); err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, owner, `INSERT INTO principals VALUES ('p_rr', 'rr')`)
	rr := pgtest.Connect(t, url)
	pgtest.Exec(t, rr, `BEGIN ISOLATION LEVEL REPEATABLE READ`)
	pgtest.Exec(t, rr, `SELECT 1`) // the snapshot, before the upgrade
	if err := idemsql.Migrate(ctx, pgtest.Connect(t, url), idemsql.Options{}); err != nil {
		t.Fatal(err)
	}
	var claimedKey, outcome string
	var attempt int64
	if err := rr.QueryRow(ctx, `SELECT outcome, attempt, provider_key FROM idem.idem_begin('p_rr', 'k', 'POST /payouts',
		sha256('100'), p_lease => interval '1 minute')`).Scan(&outcome, &attempt, &claimedKey); err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, rr, `COMMIT`)
	var dupKey string
	if err := owner.QueryRow(ctx, `SELECT provider_key FROM idem.idem_begin('p_rr', 'k', 'POST /payouts',
		sha256('100'), p_lease => interval '1 minute')`).Scan(&dupKey); err != nil {
		t.Fatal(err)
	}
	from := pgtest.Count(t, owner, `SELECT min(from_token) FROM idem.installation_secrets`)
	t.Logf("claim %s, token %d, secret from %d", outcome, attempt, from)
	if dupKey != claimedKey {
		t.Fatalf("one generation (token %d), two provider keys: the claim under REPEATABLE READ across the upgrade gave %s, "+
			"the duplicate's in_progress %s", attempt, claimedKey, dupKey)
	}
}

// TestSecretNotPrintedInPlans (review finding): the installation's secrets are folded into the
// plans of the functions that compute provider keys (idem_begin, idem_stuck), and a session may
// ask PostgreSQL to print every plan it makes (debug_print_plan, sent to the client as LOG
// messages with client_min_messages = log): the application role and the operators' role read
// the secret that way, which docs/sql-api.md says nobody but the owner can. Those functions
// now run with debug_print_plan off and no LOG message to the client.
func TestSecretNotPrintedInPlans(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.NewDB(t)
	var values [][]byte
	if err := pgtest.Connect(t, url).QueryRow(ctx, `SELECT idem.installation_secret_values()`).Scan(&values); err != nil || len(values) == 0 {
		t.Fatalf("the owner reads the secrets: %v %v", values, err)
	}
	// A Const's bytes as a printed plan shows them: each a signed decimal, space-separated.
	var printed []string
	for _, v := range values {
		var b strings.Builder
		for i, c := range v {
			if i > 0 {
				b.WriteByte(' ')
			}
			fmt.Fprintf(&b, "%d", int8(c))
		}
		printed = append(printed, b.String())
		// EXPLAIN VERBOSE (auto_explain's) shows it in hex.
		printed = append(printed, hex.EncodeToString(v))
	}
	// The plans of the statements that fold the secrets in (the provider key's prefixes' own
	// query, run by the planner) are also printed by auto_explain where a DBA loads it for
	// every session, as LOG messages that client_min_messages = log sends to the client.
	owner := pgtest.Connect(t, url)
	for _, c := range []struct{ group, sql, explain string }{
		{"idem_app", `SELECT provider_key FROM idem.idem_begin('leak', 'k1', 'POST /x', sha256('x'), p_lease => interval '1 minute')`, ""},
		{"idem_operator", `SELECT count(*) FROM idem.idem_stuck()`, ""},
		{"idem_app", `SELECT provider_key FROM idem.idem_begin('leak', 'k2', 'POST /x', sha256('x'), p_lease => interval '1 minute')`, "auto_explain"},
	} {
		login := pgtest.LoginRole(t, url, c.group)
		cfg, err := pgx.ParseConfig(login)
		if err != nil {
			t.Fatal(err)
		}
		if c.explain != "" {
			for _, sql := range []string{`session_preload_libraries = 'auto_explain'`, `auto_explain.log_min_duration = 0`,
				`auto_explain.log_nested_statements = on`, `auto_explain.log_verbose = on`} {
				pgtest.Exec(t, owner, fmt.Sprintf(`ALTER ROLE %s SET %s`, cfg.User, sql))
			}
		}
		var mu sync.Mutex
		var notices []string
		cfg.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) {
			mu.Lock()
			defer mu.Unlock()
			// A printed plan is in the detail, broken into lines.
			notices = append(notices, strings.Join(strings.Fields(n.Severity+": "+n.Message+" "+n.Detail), " "))
		}
		conn, err := pgx.ConnectConfig(ctx, cfg)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close(ctx)
		sets := []string{`SET debug_print_plan = on`, `SET debug_pretty_print = off`}
		if c.explain != "" {
			sets = nil
		}
		for _, sql := range append(sets, `SET client_min_messages = log`, c.sql) {
			if _, err := conn.Exec(ctx, sql); err != nil {
				t.Fatalf("%s: %s: %v", c.group, sql, err)
			}
		}
		mu.Lock()
		plans := 0
		for _, n := range notices {
			if strings.Contains(n, "plan:") || strings.Contains(n, "Query Text:") {
				plans++
			}
			for i, p := range printed {
				if strings.Contains(n, p) {
					t.Errorf("%s: a printed plan holds secret %d: %.200s...", c.group, i+1, n)
				}
			}
		}
		mu.Unlock()

		if plans == 0 {
			t.Fatalf("%s: no plan was printed at all (%d notices): the test shows nothing", c.group, len(notices))
		}
	}
}

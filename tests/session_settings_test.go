package tests

// The caller's session settings (D231). Services in other languages call the SQL API in their
// own sessions, which carry any setting a non-superuser may SET or ALTER ROLE gives the login
// role; the outcome, the stored row, the provider key and the error codes must not depend on
// them. An adversarial review (helper session) wrote these tests; one of them failed: with
// standard_conforming_strings off, the functions' own '\x00' bytea literals read as NUL
// characters and idem_begin, idem_begin_steps, idem_save_final, idem_key and idem_stuck failed
// with 22021 on every call.

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/internal/pgtest"
)

// settingsRun is what one session saw of the life of two keys.
type settingsRun struct {
	claimOutcome   string
	claimProvider  string
	replayOutcome  string
	replayProvider string
	replayStatus   int32
	replayHeaders  map[string]string
	replayBody     []byte
	mmOutcome      string
	mmChanged      []string
	leaseOutcome   string
	leaseProvider  string
	dupOutcome     string
	dupProvider    string
	dupRetry       float64 // seconds
	extendAhead    float64 // seconds from now to the lease's new end
}

const (
	settingsFieldsA  = `{"amount":"00000000000000aa","n\u00e9v":"00000000000000bb"}`
	settingsFieldsB  = `{"amount":"00000000000000cc","n\u00e9v":"00000000000000bb"}`
	settingsHeaders  = `{"X-N\u00e9v":"v\u00e4lue","Content-Type":"application/json"}`
	settingsAction   = "POST /v1/zz"
	settingsReplays  = 7 // replays per session: past the 5 custom plans of plan_cache_mode = auto
	settingsLease    = "30 seconds"
	settingsExtendTo = "1 day"
)

var (
	settingsBody = []byte{0x00, 0xff, 'A', '\\', '\'', 0x80, 'z'}
	settingsFp1  = settingsSum("r1")
	settingsFp2  = settingsSum("r2")
)

func settingsSum(s string) []byte { h := sha256.Sum256([]byte(s)); return h[:] }

// settingsScenario runs, on c (whatever its settings), a transactional claim, its
// completion, replays, a mismatch; then a lease claim, a duplicate of it and a heartbeat, under
// keys named after prefix. The caller's own SQL names every function with its schema and takes
// the fingerprints as parameters, so that only idem's functions can depend on the settings.
func settingsScenario(ctx context.Context, c *pgx.Conn, principal, prefix string) (settingsRun, error) {
	var r settingsRun
	k1, k2 := prefix+"-tx", prefix+"-lease"
	tx, err := c.Begin(ctx)
	if err != nil {
		return r, fmt.Errorf("begin: %w", err)
	}
	defer tx.Rollback(ctx)
	var attempt int64
	if err := tx.QueryRow(ctx, `SELECT outcome, attempt, provider_key FROM idem.idem_begin(p_principal => $1, p_key => $2,
		p_action => $3, p_request_sha256 => $4, p_request_fields => $5::text::jsonb)`,
		principal, k1, settingsAction, settingsFp1, settingsFieldsA).Scan(&r.claimOutcome, &attempt, &r.claimProvider); err != nil {
		return r, fmt.Errorf("claim: %w", err)
	}
	if _, err := tx.Exec(ctx, `SELECT idem.idem_complete(p_principal => $1, p_key => $2, p_attempt => $3, p_status => 201,
		p_headers => $4::text::jsonb, p_body => $5)`, principal, k1, attempt, settingsHeaders, settingsBody); err != nil {
		return r, fmt.Errorf("complete: %w", err)
	}
	if err := tx.Commit(ctx); err != nil {
		return r, fmt.Errorf("commit: %w", err)
	}
	for i := 0; i < settingsReplays; i++ {
		var headers []byte
		var outcome, provider string
		if err := c.QueryRow(ctx, `SELECT outcome, provider_key, response_status, response_headers::text, response_body FROM idem.idem_begin(
			p_principal => $1, p_key => $2, p_action => $3, p_request_sha256 => $4, p_request_fields => $5::text::jsonb)`,
			principal, k1, settingsAction, settingsFp1, settingsFieldsA).Scan(&outcome, &provider, &r.replayStatus, &headers, &r.replayBody); err != nil {
			return r, fmt.Errorf("replay %d: %w", i+1, err)
		}
		if i > 0 && (outcome != r.replayOutcome || provider != r.replayProvider) {
			return r, fmt.Errorf("replay %d: %s %s, the first replay %s %s", i+1, outcome, provider, r.replayOutcome, r.replayProvider)
		}
		r.replayOutcome, r.replayProvider = outcome, provider
		if err := json.Unmarshal(headers, &r.replayHeaders); err != nil {
			return r, fmt.Errorf("replay headers %q: %w", headers, err)
		}
	}
	if err := c.QueryRow(ctx, `SELECT outcome, changed_fields FROM idem.idem_begin(
		p_principal => $1, p_key => $2, p_action => $3, p_request_sha256 => $4, p_request_fields => $5::text::jsonb)`,
		principal, k1, settingsAction, settingsFp2, settingsFieldsB).Scan(&r.mmOutcome, &r.mmChanged); err != nil {
		return r, fmt.Errorf("mismatch: %w", err)
	}
	var lease int64
	if err := c.QueryRow(ctx, `SELECT outcome, attempt, provider_key FROM idem.idem_begin(p_principal => $1, p_key => $2,
		p_action => $3, p_request_sha256 => $4, p_lease => $5::text::interval, p_ttl => '1 day')`,
		principal, k2, settingsAction, settingsFp1, settingsLease).Scan(&r.leaseOutcome, &lease, &r.leaseProvider); err != nil {
		return r, fmt.Errorf("lease claim: %w", err)
	}
	if err := c.QueryRow(ctx, `SELECT outcome, provider_key, pg_catalog.date_part('epoch', retry_after) FROM idem.idem_begin(
		p_principal => $1, p_key => $2, p_action => $3, p_request_sha256 => $4, p_lease => $5::text::interval, p_ttl => '1 day')`,
		principal, k2, settingsAction, settingsFp1, settingsLease).Scan(&r.dupOutcome, &r.dupProvider, &r.dupRetry); err != nil {
		return r, fmt.Errorf("lease duplicate: %w", err)
	}
	if err := c.QueryRow(ctx, `SELECT pg_catalog.date_part('epoch', idem.idem_extend(p_principal => $1, p_key => $2, p_attempt => $3,
		p_lease => $4::text::interval) OPERATOR(pg_catalog.-) pg_catalog.clock_timestamp())`,
		principal, k2, lease, settingsExtendTo).Scan(&r.extendAhead); err != nil {
		return r, fmt.Errorf("extend: %w", err)
	}
	return r, nil
}

// settingsReplayElsewhere replays both keys of prefix on c and returns their provider keys
// (the transactional key's replay, the lease's duplicate).
func settingsReplayElsewhere(ctx context.Context, c *pgx.Conn, principal, prefix string) (string, string, error) {
	var p1, p2, o1, o2 string
	var body []byte
	if err := c.QueryRow(ctx, `SELECT outcome, provider_key, response_body FROM idem.idem_begin(p_principal => $1, p_key => $2,
		p_action => $3, p_request_sha256 => $4)`, principal, prefix+"-tx", settingsAction, settingsFp1).Scan(&o1, &p1, &body); err != nil {
		return "", "", fmt.Errorf("replay: %w", err)
	}
	if err := c.QueryRow(ctx, `SELECT outcome, provider_key FROM idem.idem_begin(p_principal => $1, p_key => $2,
		p_action => $3, p_request_sha256 => $4, p_lease => '30 seconds')`, principal, prefix+"-lease", settingsAction, settingsFp1).Scan(&o2, &p2); err != nil {
		return "", "", fmt.Errorf("lease duplicate: %w", err)
	}
	if o1 != "replay" || o2 != "in_progress" || !bytes.Equal(body, settingsBody) {
		return "", "", fmt.Errorf("%s (body %x) and %s, want replay (body %x) and in_progress", o1, body, o2, settingsBody)
	}
	return p1, p2, nil
}

// settingsCompare checks one session's run against the promises, and that a session without
// the settings (plain) sees the same keys alike, and the other way round.
func settingsCompare(t *testing.T, ctx context.Context, name string, set, plain *pgx.Conn, principal string) {
	t.Helper()
	r, err := settingsScenario(ctx, set, principal, "set")
	if err != nil {
		t.Fatalf("%s: %v (SQLSTATE %s)", name, err, sqlCode(err))
	}
	if r.claimOutcome != "claimed" || r.replayOutcome != "replay" || r.mmOutcome != "mismatch" ||
		r.leaseOutcome != "claimed" || r.dupOutcome != "in_progress" {
		t.Errorf("%s: outcomes %s/%s/%s/%s/%s, want claimed/replay/mismatch/claimed/in_progress", name,
			r.claimOutcome, r.replayOutcome, r.mmOutcome, r.leaseOutcome, r.dupOutcome)
	}
	if r.replayStatus != 201 || !bytes.Equal(r.replayBody, settingsBody) {
		t.Errorf("%s: replay %d %x, want 201 %x", name, r.replayStatus, r.replayBody, settingsBody)
	}
	if r.replayHeaders["X-N\u00e9v"] != "v\u00e4lue" || len(r.replayHeaders) != 2 {
		t.Errorf("%s: replay headers %q", name, r.replayHeaders)
	}
	if strings.Join(r.mmChanged, ",") != "amount" {
		t.Errorf("%s: changed_fields %q, want [amount]", name, r.mmChanged)
	}
	if r.claimProvider != r.replayProvider || r.leaseProvider != r.dupProvider || len(r.claimProvider) != 64 {
		t.Errorf("%s: provider keys claim %s replay %s, lease %s duplicate %s: want each pair equal", name,
			r.claimProvider, r.replayProvider, r.leaseProvider, r.dupProvider)
	}
	if !(r.dupRetry > 25 && r.dupRetry <= 30) {
		t.Errorf("%s: retry_after %v s, want about 30", name, r.dupRetry)
	}
	if !(r.extendAhead > 86000 && r.extendAhead <= 86400) {
		t.Errorf("%s: idem_extend('1 day') ends %v s from now, want 86400 (24 hours)", name, r.extendAhead)
	}
	p1, p2, err := settingsReplayElsewhere(ctx, plain, principal, "set")
	if err != nil {
		t.Fatalf("%s: from a default session: %v", name, err)
	}
	if p1 != r.claimProvider || p2 != r.leaseProvider {
		t.Errorf("%s: provider keys under the settings %s / %s, a default session's for the same generations %s / %s",
			name, r.claimProvider, r.leaseProvider, p1, p2)
	}
	d, err := settingsScenario(ctx, plain, principal, "plain")
	if err != nil {
		t.Fatalf("%s: default session: %v", name, err)
	}
	q1, q2, err := settingsReplayElsewhere(ctx, set, principal, "plain")
	if err != nil {
		t.Fatalf("%s: a default session's keys, under the settings: %v (SQLSTATE %s)", name, err, sqlCode(err))
	}
	if q1 != d.claimProvider || q2 != d.leaseProvider {
		t.Errorf("%s: a default session's keys repeated under the settings give provider keys %s / %s; the default session got %s / %s",
			name, q1, q2, d.claimProvider, d.leaseProvider)
	}
}

// settingsCases: settings a non-superuser may SET, each of which must change nothing.
var settingsCases = map[string][]string{
	"TimeZone":            {"TimeZone = 'Pacific/Chatham'"},
	"TimeZoneNegative":    {"TimeZone = 'America/St_Johns'"},
	"DateStyleSQL":        {"DateStyle = 'SQL, DMY'"},
	"DateStyleGerman":     {"DateStyle = 'German'"},
	"IntervalSQLStandard": {"IntervalStyle = 'sql_standard'"},
	"IntervalISO8601":     {"IntervalStyle = 'iso_8601'"},
	"IntervalVerbose":     {"IntervalStyle = 'postgres_verbose'"},
	"ExtraFloatDigitsLow": {"extra_float_digits = -15"},
	"ExtraFloatDigitsMax": {"extra_float_digits = 3"},
	"ByteaEscape":         {"bytea_output = 'escape'"},
	"GenericPlans":        {"plan_cache_mode = force_generic_plan"},
	"CustomPlans":         {"plan_cache_mode = force_custom_plan"},
	"JIT":                 {"jit = on", "jit_above_cost = 0", "jit_inline_above_cost = 0", "jit_optimize_above_cost = 0"},
	"NoScans":             {"enable_indexscan = off", "enable_seqscan = off", "enable_bitmapscan = off", "enable_indexonlyscan = off"},
	"RowSecurityOff":      {"row_security = off"},
	"Serializable":        {"default_transaction_isolation = 'serializable'"},
	"RepeatableRead":      {"default_transaction_isolation = 'repeatable read'"},
	"ShortLockTimeout":    {"lock_timeout = '1ms'"},
	"ShortIdleTimeout":    {"idle_in_transaction_session_timeout = '1s'"},
	"SearchPathTempFirst": {"search_path = pg_temp, public"},
	"NonStandardStrings":  {"standard_conforming_strings = off"},
	"PlpgsqlExtraErrors":  {"plpgsql.extra_errors = 'all'", "plpgsql.extra_warnings = 'all'"},
	"Everything": {"TimeZone = 'Asia/Kathmandu'", "DateStyle = 'Postgres, DMY'", "IntervalStyle = 'iso_8601'",
		"extra_float_digits = 0", "bytea_output = 'escape'", "plan_cache_mode = force_generic_plan",
		"enable_indexscan = off", "row_security = off", "lock_timeout = '1ms'", "standard_conforming_strings = off"},
}

// TestSQLAnswersAlikeUnderTheCallersSettings: each setting SET in the caller's session before its first call.
func TestSQLAnswersAlikeUnderTheCallersSettings(t *testing.T) {
	t.Parallel()
	for name, sets := range settingsCases {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			db := pgtest.NewDB(t)
			appURL := pgtest.LoginRole(t, db, "idem_app")
			plain := pgtest.Connect(t, appURL)
			c := pgtest.Connect(t, appURL)
			for _, s := range sets {
				pgtest.Exec(t, c, "SET "+s)
			}
			settingsCompare(t, ctx, name, c, plain, "zz-\u00fc")
		})
	}
}

// TestSQLAnswersAlikeUnderTheLoginRolesSettings: settings given to the service's login role
// with ALTER ROLE ... SET (as docs/sql-api.md's login-role block does for its timeouts), which a
// session has from its start; the default session is another login role of idem_app. The
// combined case and the one that failed: the others are the session's SET above.
func TestSQLAnswersAlikeUnderTheLoginRolesSettings(t *testing.T) {
	t.Parallel()
	for _, name := range []string{"Everything", "NonStandardStrings"} {
		sets := settingsCases[name]
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			db := pgtest.NewDB(t)
			admin := pgtest.Connect(t, db)
			setURL := pgtest.LoginRole(t, db, "idem_app")
			cfg, err := pgx.ParseConfig(setURL)
			if err != nil {
				t.Fatal(err)
			}
			for _, s := range sets {
				pgtest.Exec(t, admin, `ALTER ROLE `+cfg.User+` SET `+s)
			}
			plain := pgtest.Connect(t, pgtest.LoginRole(t, db, "idem_app"))
			c := pgtest.Connect(t, setURL)
			settingsCompare(t, ctx, name, c, plain, "zz-\u00fc")
		})
	}
}

// TestSQLFunctionsUnderStandardConformingStringsOff: standard_conforming_strings is a setting
// any role may SET (PostgreSQL 15 still accepts off). The functions' own literals are parsed
// under the caller's setting: the bytea literal '\x00' (the provider key, the field hashes,
// idem_key's field names) read as an escape for a NUL character, and every call of idem_begin,
// idem_begin_steps, idem_save_final, idem_key and idem_stuck in such a session failed with
// 22021, "invalid byte sequence for encoding UTF8: 0x00". Every literal with a backslash is an
// E” string now (D231). settingsCases' NonStandardStrings runs the claim, replay, mismatch,
// lease and extension; this test the other functions. (idem_replication's pattern for
// synchronous_standby_names, \s and \d, read 's' and 'd' without an error; a superuser's
// setting, so TestSQLLiteralsReadAlikeInEverySession checks the literals themselves.)
func TestSQLFunctionsUnderStandardConformingStringsOff(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.NewDB(t)
	appURL := pgtest.LoginRole(t, db, "idem_app")
	opURL := pgtest.LoginRole(t, db, "idem_operator")
	plain := pgtest.Connect(t, appURL)
	if _, err := settingsScenario(ctx, plain, "zz", "plain"); err != nil {
		t.Fatal(err)
	}
	app := pgtest.Connect(t, appURL)
	op := pgtest.Connect(t, opURL)
	for _, c := range []*pgx.Conn{app, op} {
		pgtest.Exec(t, c, `SET standard_conforming_strings = off`)
	}
	// each fresh call in a transaction rolled back: a transactional claim must not commit
	// without its answer (the commit guard), and nothing need stay
	inTx := func(name string, c *pgx.Conn, sql string, args ...any) string {
		t.Helper()
		tx, err := c.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx)
		var got string
		if err := tx.QueryRow(ctx, sql, args...).Scan(&got); err != nil {
			t.Errorf("%s with standard_conforming_strings = off: %v (SQLSTATE %s)", name, err, sqlCode(err))
		}
		return got
	}
	if got := inTx("idem_begin_steps (a fresh lease)", app, `SELECT outcome FROM idem.idem_begin_steps(p_principal => 'zz', p_key => 'fresh-steps',
		p_action => 'POST /v1/zz', p_request_sha256 => $1, p_lease => '30 seconds', p_request_fields => $2::text::jsonb)`,
		settingsFp1, settingsFieldsA); got != "claimed" {
		t.Errorf("idem_begin_steps: %q, want claimed", got)
	}
	if got := inTx("idem_save_final (a free key)", app, `SELECT idem.idem_save_final(p_principal => 'zz', p_key => 'fresh-final',
		p_action => 'POST /v1/zz', p_request_sha256 => $1, p_ttl => NULL, p_status => 404, p_headers => '{}', p_body => NULL,
		p_request_fields => $2::text::jsonb)::text`, settingsFp1, settingsFieldsA); got != "true" {
		t.Errorf("idem_save_final: %q, want true", got)
	}
	var names []string
	if err := app.QueryRow(ctx, `SELECT field_names FROM idem.idem_key('zz', 'plain-tx')`).Scan(&names); err != nil {
		t.Errorf("idem_key with standard_conforming_strings = off: %v (SQLSTATE %s)", err, sqlCode(err))
	} else if strings.Join(names, ",") != "amount,n\u00e9v" {
		t.Errorf("idem_key's field names %q, want [amount n\u00e9v]", names)
	}
	var stuck int
	if err := op.QueryRow(ctx, `SELECT count(*) FROM idem.idem_stuck()`).Scan(&stuck); err != nil || stuck != 1 {
		t.Errorf("idem_stuck with standard_conforming_strings = off: %d claims, %v (SQLSTATE %s); want the one lease claim", stuck, err, sqlCode(err))
	}
}

// TestSQLHostileSearchPathChangesNothing: docs/sql-api.md, every function of the API "pins
// search_path = pg_catalog, pg_temp and qualifies every name"; idem_cleanup_all "names every
// other function, operator and type with its schema: the caller's search_path picks none of
// them". A caller's search_path that puts a schema before pg_catalog, holding functions and
// operators named like pg_catalog's (now(), clock_timestamp(), nextval, convert_to, encode,
// sha256, hashtextextended, = and <> on text and bytea, + and < on integers), and a temporary
// table named like idem's, changes no outcome and no provider key.
func TestSQLHostileSearchPathChangesNothing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.NewDB(t)
	admin := pgtest.Connect(t, db)
	pgtest.Exec(t, admin, `CREATE SCHEMA evil;
		GRANT USAGE ON SCHEMA evil TO PUBLIC;
		CREATE FUNCTION evil.now() RETURNS timestamptz LANGUAGE sql AS $$SELECT pg_catalog.timestamptz '2000-01-01'$$;
		CREATE FUNCTION evil.clock_timestamp() RETURNS timestamptz LANGUAGE sql AS $$SELECT pg_catalog.timestamptz '2000-01-01'$$;
		CREATE FUNCTION evil.statement_timestamp() RETURNS timestamptz LANGUAGE sql AS $$SELECT pg_catalog.timestamptz '2000-01-01'$$;
		CREATE FUNCTION evil.transaction_timestamp() RETURNS timestamptz LANGUAGE sql AS $$SELECT pg_catalog.timestamptz '2000-01-01'$$;
		CREATE FUNCTION evil.nextval(regclass) RETURNS bigint LANGUAGE sql AS $$SELECT 1::bigint$$;
		CREATE FUNCTION evil.convert_to(text, name) RETURNS bytea LANGUAGE sql AS $$SELECT pg_catalog.decode('00', 'hex')$$;
		CREATE FUNCTION evil.convert_to(text, text) RETURNS bytea LANGUAGE sql AS $$SELECT pg_catalog.decode('00', 'hex')$$;
		CREATE FUNCTION evil.encode(bytea, text) RETURNS text LANGUAGE sql AS $$SELECT 'evil'::pg_catalog.text$$;
		CREATE FUNCTION evil.sha256(bytea) RETURNS bytea LANGUAGE sql AS $$SELECT pg_catalog.decode('00', 'hex')$$;
		CREATE FUNCTION evil.hashtextextended(text, bigint) RETURNS bigint LANGUAGE sql AS $$SELECT 0::bigint$$;
		CREATE FUNCTION evil.t_true(text, text) RETURNS boolean LANGUAGE sql AS $$SELECT true$$;
		CREATE FUNCTION evil.t_false(text, text) RETURNS boolean LANGUAGE sql AS $$SELECT false$$;
		CREATE FUNCTION evil.b_true(bytea, bytea) RETURNS boolean LANGUAGE sql AS $$SELECT true$$;
		CREATE FUNCTION evil.b_false(bytea, bytea) RETURNS boolean LANGUAGE sql AS $$SELECT false$$;
		CREATE FUNCTION evil.i_plus(integer, integer) RETURNS integer LANGUAGE sql AS $$SELECT 0$$;
		CREATE FUNCTION evil.i_lt(integer, integer) RETURNS boolean LANGUAGE sql AS $$SELECT false$$;
		CREATE FUNCTION evil.bi_plus(bigint, integer) RETURNS bigint LANGUAGE sql AS $$SELECT 0::bigint$$;
		CREATE OPERATOR evil.= (LEFTARG = text, RIGHTARG = text, FUNCTION = evil.t_true);
		CREATE OPERATOR evil.<> (LEFTARG = text, RIGHTARG = text, FUNCTION = evil.t_false);
		CREATE OPERATOR evil.= (LEFTARG = bytea, RIGHTARG = bytea, FUNCTION = evil.b_true);
		CREATE OPERATOR evil.<> (LEFTARG = bytea, RIGHTARG = bytea, FUNCTION = evil.b_false);
		CREATE OPERATOR evil.+ (LEFTARG = integer, RIGHTARG = integer, FUNCTION = evil.i_plus);
		CREATE OPERATOR evil.< (LEFTARG = integer, RIGHTARG = integer, FUNCTION = evil.i_lt);
		CREATE OPERATOR evil.+ (LEFTARG = bigint, RIGHTARG = integer, FUNCTION = evil.bi_plus)`)
	appURL := pgtest.LoginRole(t, db, "idem_app")
	plain := pgtest.Connect(t, appURL)
	c := pgtest.Connect(t, appURL)
	pgtest.Exec(t, c, `CREATE TEMP TABLE idempotency_keys (principal_id text, key text, state text);
		CREATE TEMP TABLE installation_secrets (from_token bigint)`)
	pgtest.Exec(t, c, `SET search_path = pg_temp, evil, pg_catalog`)
	settingsCompare(t, ctx, "hostile search_path", c, plain, "zz")

	// idem_cleanup_all, SECURITY INVOKER: it deletes every expired key, and reports how many,
	// under the same search_path.
	pgtest.InsertExpired(t, admin, "old", 5)
	var deleted int64
	if err := c.QueryRow(ctx, `CALL idem.idem_cleanup_all(2, NULL)`).Scan(&deleted); err != nil {
		t.Fatalf("idem_cleanup_all under the hostile search_path: %v", err)
	}
	left := pgtest.Count(t, admin, `SELECT count(*) FROM idem.idempotency_keys WHERE principal_id = 'old'`)
	if deleted != 5 || left != 0 {
		t.Errorf("idem_cleanup_all(2) under the hostile search_path: reported %d, %d expired keys left; want 5 and 0", deleted, left)
	}
}

// TestSQLCallersLockTimeoutIsNotTheWait: docs/sql-api.md: every function "sets its own
// lock_timeout (2 seconds; idem_begin takes a per-call p_lock_timeout), which holds only for
// the call: the caller's setting is back when it returns". A caller whose session has
// lock_timeout = 1ms still waits for an uncommitted holder of the key (a real row lock, held by
// another connection's transaction) and then answers from the committed row; and its own
// lock_timeout is 1ms again afterwards, with or without p_lock_timeout.
func TestSQLCallersLockTimeoutIsNotTheWait(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.NewDB(t)
	appURL := pgtest.LoginRole(t, db, "idem_app")
	holder := pgtest.Connect(t, appURL)
	waiter := pgtest.Connect(t, appURL)
	watch := pgtest.Connect(t, db)
	pgtest.Exec(t, waiter, `SET lock_timeout = '1ms'`)
	for _, lt := range []string{"", ", p_lock_timeout => '5 seconds'"} {
		key := "held" + fmt.Sprint(len(lt))
		tx, err := holder.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		var attempt int64
		if err := tx.QueryRow(ctx, `SELECT attempt FROM idem.idem_begin(p_principal => 'zz', p_key => $1, p_action => 'a', p_request_sha256 => $2)`,
			key, settingsFp1).Scan(&attempt); err != nil {
			t.Fatal(err)
		}
		var pid uint32
		if err := waiter.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
			t.Fatal(err)
		}
		type res struct {
			outcome string
			err     error
		}
		done := make(chan res, 1)
		go func() {
			var o string
			err := waiter.QueryRow(ctx, `SELECT outcome FROM idem.idem_begin(p_principal => 'zz', p_key => $1, p_action => 'a',
				p_request_sha256 => $2`+lt+`)`, key, settingsFp1).Scan(&o)
			done <- res{o, err}
		}()
		pgtest.WaitUntilBlocked(t, watch, pid)
		if _, err := tx.Exec(ctx, `SELECT idem.idem_complete('zz', $1, $2, 200, '{}', 'x')`, key, attempt); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		r := <-done
		if r.err != nil || r.outcome != "replay" {
			t.Errorf("duplicate of an uncommitted claim, caller's lock_timeout 1ms%s: %q %v (SQLSTATE %s), want replay after the holder's commit",
				lt, r.outcome, r.err, sqlCode(r.err))
		}
		var after string
		if err := waiter.QueryRow(ctx, `SHOW lock_timeout`).Scan(&after); err != nil {
			t.Fatal(err)
		}
		if after != "1ms" {
			t.Errorf("caller's lock_timeout after the call%s: %s, want 1ms", lt, after)
		}
	}
}

// TestSQLAnswersAlikeInEveryClientEncoding: a caller in LATIN1 or SQL_ASCII (a service in another
// language) passes a non-ASCII principal, field names and header values in its own encoding;
// the key it claims is the one a UTF8 session replays, with the same provider key (the SHA-256
// of the principal "in UTF-8", docs/sql-api.md), and each session reads the stored headers and
// changed fields in its own encoding.
func TestSQLAnswersAlikeInEveryClientEncoding(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.NewDB(t)
	appURL := pgtest.LoginRole(t, db, "idem_app")
	utf := pgtest.Connect(t, appURL)
	latin1 := func(s string) string {
		var b []byte
		for _, r := range s {
			b = append(b, byte(r))
		}
		return string(b)
	}
	for _, enc := range []string{"LATIN1", "SQL_ASCII", "WIN1252"} {
		c := pgtest.Connect(t, appURL)
		pgtest.Exec(t, c, `SET client_encoding = '`+enc+`'`)
		conv := latin1
		if enc == "SQL_ASCII" {
			conv = func(s string) string { return s } // no conversion: the bytes are the server's (UTF8)
		}
		principal := "m\u00fcller"
		key := "enc-" + enc
		var attempt int64
		var pk string
		tx, err := c.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := tx.QueryRow(ctx, `SELECT attempt, provider_key FROM idem.idem_begin(p_principal => $1, p_key => $2, p_action => $3,
			p_request_sha256 => $4, p_request_fields => $5::text::jsonb)`, conv(principal), key, conv("POST /v1/caf\u00e9"), settingsFp1,
			conv(`{"n\u00e9v":"00000000000000aa","x":"00000000000000bb"}`)).Scan(&attempt, &pk); err != nil {
			t.Fatalf("%s: claim: %v", enc, err)
		}
		if _, err := tx.Exec(ctx, `SELECT idem.idem_complete($1, $2, $3, 201, $4::text::jsonb, 'b')`, conv(principal), key, attempt,
			conv(`{"X-Caf\u00e9":"cr\u00e8me"}`)); err != nil {
			t.Fatalf("%s: complete: %v", enc, err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		var outcome, pk2 string
		var headers []byte
		if err := utf.QueryRow(ctx, `SELECT outcome, provider_key, response_headers::text FROM idem.idem_begin(p_principal => $1, p_key => $2,
			p_action => $3, p_request_sha256 => $4)`, principal, key, "POST /v1/caf\u00e9", settingsFp1).Scan(&outcome, &pk2, &headers); err != nil {
			t.Fatalf("%s: replay from UTF8: %v", enc, err)
		}
		var h map[string]string
		_ = json.Unmarshal(headers, &h)
		if outcome != "replay" || pk2 != pk || h["X-Caf\u00e9"] != "cr\u00e8me" {
			t.Errorf("%s: a UTF8 session's repeat: %s, provider key %s (claimed with %s), headers %q", enc, outcome, pk2, pk, headers)
		}
		var changed []string
		if err := c.QueryRow(ctx, `SELECT outcome, changed_fields FROM idem.idem_begin(p_principal => $1, p_key => $2, p_action => $3,
			p_request_sha256 => $4, p_request_fields => $5::text::jsonb)`, conv(principal), key, conv("POST /v1/caf\u00e9"), settingsFp2,
			conv(`{"n\u00e9v":"00000000000000cc","x":"00000000000000bb"}`)).Scan(&outcome, &changed); err != nil {
			t.Fatalf("%s: mismatch: %v", enc, err)
		}
		if outcome != "mismatch" || strings.Join(changed, ",") != conv("n\u00e9v") {
			t.Errorf("%s: mismatch %s %q, want mismatch [%q]", enc, outcome, changed, conv("n\u00e9v"))
		}
	}
}

// TestSQLReadOnlySessionClaimsNothing: a session whose transactions default to read only (a role
// pointed at a read replica's settings, or ALTER ROLE ... SET default_transaction_read_only)
// gets a clear error for a claim, and nothing is stored; a repeat of a completed key, which
// writes nothing ("Only claimed writes"), still replays there.
func TestSQLReadOnlySessionClaimsNothing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.NewDB(t)
	appURL := pgtest.LoginRole(t, db, "idem_app")
	plain := pgtest.Connect(t, appURL)
	d, err := settingsScenario(ctx, plain, "zz", "plain")
	if err != nil {
		t.Fatal(err)
	}
	c := pgtest.Connect(t, appURL)
	pgtest.Exec(t, c, `SET default_transaction_read_only = on`)
	var outcome, pk string
	err = c.QueryRow(ctx, `SELECT outcome, provider_key FROM idem.idem_begin('zz', 'ro-fresh', 'a', $1)`, settingsFp1).Scan(&outcome, &pk)
	if sqlCode(err) != "25006" {
		t.Errorf("claim of a fresh key in a read-only transaction: %q %v (SQLSTATE %s), want 25006", outcome, err, sqlCode(err))
	}
	if n := pgtest.Count(t, plain, `SELECT count(*) FROM idem.idem_key('zz', 'ro-fresh')`); n != 0 {
		t.Errorf("a key was stored by the refused claim")
	}
	if err := c.QueryRow(ctx, `SELECT outcome, provider_key FROM idem.idem_begin(p_principal => 'zz', p_key => 'plain-tx',
		p_action => $1, p_request_sha256 => $2)`, settingsAction, settingsFp1).Scan(&outcome, &pk); err != nil || outcome != "replay" || pk != d.claimProvider {
		t.Errorf("repeat of a completed key in a read-only transaction: %q %s %v, want replay %s", outcome, pk, err, d.claimProvider)
	}
	if err := c.QueryRow(ctx, `SELECT outcome, provider_key FROM idem.idem_begin(p_principal => 'zz', p_key => 'plain-lease',
		p_action => $1, p_request_sha256 => $2, p_lease => '30 seconds')`, settingsAction, settingsFp1).Scan(&outcome, &pk); err != nil || outcome != "in_progress" || pk != d.leaseProvider {
		t.Errorf("duplicate of a running lease in a read-only transaction: %q %s %v, want in_progress %s", outcome, pk, err, d.leaseProvider)
	}
}

// TestSQLLiteralsReadAlikeInEverySession: no string literal of the SQL this project installs
// (sql/idem.sql, the migrations and their online steps) holds a backslash unless it is an E”
// string, which reads the same whatever the session's standard_conforming_strings (D231). A
// plain '\x00' reads as a NUL character in a session with the setting off: the functions failed
// there with 22021, and a pattern such as '\s' would silently match 's'.
func TestSQLLiteralsReadAlikeInEverySession(t *testing.T) {
	t.Parallel()
	files, err := filepath.Glob("../sql/migrations/*.sql")
	if err != nil {
		t.Fatal(err)
	}
	online, err := filepath.Glob("../sql/migrations/online/*.sql")
	if err != nil {
		t.Fatal(err)
	}
	files = append(append([]string{"../sql/idem.sql"}, files...), online...)
	literal := regexp.MustCompile(`(^|[^A-Za-z0-9_])([Ee]?)'((?:[^']|'')*)'`)
	seen := 0
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for n, line := range strings.Split(string(b), "\n") {
			if i := strings.Index(line, "--"); i >= 0 && !strings.Contains(line[:i], "'") {
				line = line[:i]
			}
			for _, m := range literal.FindAllStringSubmatch(line, -1) {
				seen++
				if m[2] == "" && strings.Contains(m[3], `\`) {
					t.Errorf("%s:%d: the literal '%s' holds a backslash: write it as an E'' string (standard_conforming_strings)", f, n+1, m[3])
				}
			}
		}
	}
	if seen < 100 {
		t.Fatalf("read %d string literals in %d files: the scan reads nothing", seen, len(files))
	}
}

package tests

// A review (helper session; secrets and sensitive data, no broken promise found), at the SQL level: what the API's roles can read
// of the installation's secret, and what one principal's calls can learn of another's key.

import (
	"context"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgidem/pgidem/internal/pgtest"
)

// secretsSecretForms is every printed form of the installation's secrets: hex (bytea, EXPLAIN
// VERBOSE), and each 8-byte part as a signed decimal (a sequence's value).
func secretsSecretForms(t *testing.T, owner pgtest.Querier) []string {
	t.Helper()
	var values [][]byte
	if err := owner.QueryRow(context.Background(), `SELECT idem.installation_secret_values()`).Scan(&values); err != nil || len(values) == 0 {
		t.Fatalf("the owner reads the secrets: %v %v", values, err)
	}
	var forms []string
	for _, v := range values {
		forms = append(forms, hex.EncodeToString(v))
		for i := 0; i+8 <= len(v); i += 8 {
			forms = append(forms, strconv.FormatInt(int64(binary.BigEndian.Uint64(v[i:i+8])), 10))
		}
	}
	return forms
}

// TestSecretsNotInWhatTheRolesRead: docs/sql-api.md: the installation's secret is "readable
// by nobody but the schema's owner". As the application role and as the operator role: the
// function sources and settings (pg_proc.prosrc, proconfig), comments, the sequences' catalog
// rows and view (pg_sequence, pg_sequences), the settings, the statistics of schema idem, the
// operators' functions' answers, the plans of EXPLAIN VERBOSE of the API's calls, and every
// field of the errors and notices the API raises hold no form of the secret.
func TestSecretsNotInWhatTheRolesRead(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.NewDB(t)
	owner := pgtest.Connect(t, url)
	forms := secretsSecretForms(t, owner)
	pgtest.Exec(t, owner, `ANALYZE`)
	for _, group := range []string{"idem_app", "idem_operator"} {
		cfg, err := pgx.ParseConfig(pgtest.LoginRole(t, url, group))
		if err != nil {
			t.Fatal(err)
		}
		var mu sync.Mutex
		var seen []string
		cfg.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) {
			mu.Lock()
			defer mu.Unlock()
			seen = append(seen, fmt.Sprintf("%+v", *n))
		}
		conn, err := pgx.ConnectConfig(ctx, cfg)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close(ctx)
		reads := 0
		for _, sql := range []string{
			`SELECT p.proname || ' ' || p.prosrc || ' ' || coalesce(array_to_string(p.proconfig, ','), '') || ' ' || coalesce(p.probin, '')
			   FROM pg_proc AS p WHERE p.pronamespace = 'idem'::regnamespace`,
			`SELECT coalesce(d.description, '') FROM pg_description AS d`,
			`SELECT s::text FROM pg_sequences AS s`,
			`SELECT s::text FROM pg_sequence AS s`,
			`SELECT c.relname || coalesce(array_to_string(c.reloptions, ','), '') FROM pg_class AS c WHERE c.relnamespace = 'idem'::regnamespace`,
			`SELECT s::text FROM pg_settings AS s`,
			`SELECT coalesce(array_to_string(s.setconfig, ','), '') FROM pg_db_role_setting AS s`,
			`SELECT s::text FROM pg_stats AS s WHERE s.schemaname = 'idem'`,
			`SELECT s::text FROM pg_stat_user_functions AS s`,
			`SELECT a::text FROM pg_stat_activity AS a`,
			`SELECT h::text FROM idem.idem_health() AS h`,
			`SELECT s::text FROM idem.idem_summary(true) AS s`,
			`SELECT d::text FROM idem.idem_defaults() AS d`,
			`SELECT v::text FROM idem.idem_version() AS v`,
		} {
			rows, err := conn.Query(ctx, sql)
			if err != nil {
				t.Logf("%s may not read %.60s...: %v", group, sql, err)
				continue
			}
			for rows.Next() {
				var s string
				if err := rows.Scan(&s); err != nil {
					t.Fatal(err)
				}
				reads++
				for _, f := range forms {
					if strings.Contains(s, f) {
						t.Errorf("%s reads the secret (%s) in %.80s: %.300s", group, f, sql, s)
					}
				}
			}
			rows.Close()
		}
		if reads == 0 {
			t.Fatalf("%s read nothing: the test shows nothing", group)
		}
		// The API's calls, good and bad, with every field of their errors, and their plans.
		calls := []string{
			`SET client_min_messages = debug5`,
			`EXPLAIN (VERBOSE, COSTS OFF) SELECT * FROM idem.idem_begin('zz', 'k', 'POST /x', sha256('x'), p_lease => interval '1 minute')`,
			`EXPLAIN (ANALYZE, VERBOSE, COSTS OFF, TIMING OFF) SELECT * FROM idem.idem_begin('zz', 'k2', 'POST /x', sha256('x'), p_lease => interval '1 minute')`,
			`SELECT * FROM idem.idem_begin('zz', 'k2', 'POST /x', sha256('y'), p_lease => interval '1 minute')`,
			`SELECT * FROM idem.idem_begin('zz', 'bad key', 'POST /x', sha256('x'))`,
			`SELECT * FROM idem.idem_begin('zz', 'k3', 'POST /x', '\x00'::bytea)`,
			`SELECT * FROM idem.idem_begin('zz', 'k4', 'POST /x', sha256('x'), p_ttl => interval '-1 day')`,
			`SELECT * FROM idem.idem_stuck()`,
			`SELECT * FROM idem.idem_key('zz', 'k2')`,
			`SELECT * FROM idem.idem_complete('zz', 'k2', 1, 200, '{}', ''::bytea)`,
			`SELECT idem.provider_key_prefixes()`,
			`SELECT idem.installation_secret_values()`,
		}
		for _, sql := range calls {
			rows, err := conn.Query(ctx, sql)
			var lines []string
			if err == nil {
				for rows.Next() {
					vals, _ := rows.Values()
					lines = append(lines, fmt.Sprint(vals...))
				}
				rows.Close()
				err = rows.Err()
			}
			var pgErr *pgconn.PgError
			if errors.As(err, &pgErr) {
				lines = append(lines, fmt.Sprintf("%+v", *pgErr))
			} else if err != nil {
				lines = append(lines, err.Error())
			}
			text := strings.Join(lines, "\n")
			for _, f := range forms {
				if strings.Contains(text, f) {
					t.Errorf("%s: %s shows the secret (%s): %.400s", group, sql, f, text)
				}
			}
		}
		mu.Lock()
		for _, n := range seen {
			for _, f := range forms {
				if strings.Contains(n, f) {
					t.Errorf("%s: a notice holds the secret (%s): %.300s", group, f, n)
				}
			}
		}
		mu.Unlock()
	}
}

// TestSecretsPrincipalsAreIndependentInSQL: docs/sql-api.md, "Generations and provider
// keys": "another principal uses the same key | a different [provider key]"; every function
// takes (principal, key, attempt). Bob's calls under the key Alice holds (her transaction
// open, the row locked): his claim neither waits nor is refused, gets its own generation and
// provider key; with Alice's token he can complete, extend, yield, release, step or recover
// nothing of hers (55000, her row unchanged); and her request's fingerprint, sent by Bob, is
// a fresh claim for him, not her answer.
func TestSecretsPrincipalsAreIndependentInSQL(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.NewDB(t)
	owner := pgtest.Connect(t, url)
	alice := pgtest.Connect(t, pgtest.LoginRole(t, url, "idem_app"))
	bob := pgtest.Connect(t, pgtest.LoginRole(t, url, "idem_app"))

	// Alice: a lease claim, committed, and a transactional claim under another key, held open.
	var aLease int64
	var aLeasePK string
	if err := alice.QueryRow(ctx, `SELECT attempt, provider_key FROM idem.idem_begin('alice', 'shared-lease', 'POST /payouts',
		sha256('alice'), p_lease => interval '1 minute')`).Scan(&aLease, &aLeasePK); err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, alice, `BEGIN`)
	var aTx int64
	if err := alice.QueryRow(ctx, `SELECT attempt FROM idem.idem_begin('alice', 'shared-tx', 'POST /payouts', sha256('alice'))`).Scan(&aTx); err != nil {
		t.Fatal(err)
	}

	// Bob's claims under both keys, with Alice's fingerprint: at once (a 200 ms lock timeout
	// would refuse a wait on her row), fresh, with provider keys of their own.
	for _, key := range []string{"shared-tx", "shared-lease"} {
		start := time.Now()
		var outcome, pk string
		var attempt int64
		err := bob.QueryRow(ctx, `SELECT outcome, attempt, coalesce(provider_key, '') FROM idem.idem_begin('bob', $1, 'POST /payouts',
			sha256('alice'), p_lease => interval '1 minute', p_lock_timeout => interval '200 milliseconds')`, key).Scan(&outcome, &attempt, &pk)
		if err != nil || outcome != "claimed" || pk == aLeasePK || time.Since(start) > time.Second {
			t.Errorf("bob under alice's %s: %s %d %s, %v after %s", key, outcome, attempt, pk, err, time.Since(start))
		}
	}

	// With Alice's tokens, Bob touches nothing of hers.
	for _, sql := range []string{
		`SELECT idem.idem_complete('bob', 'shared-lease', $1, 200, '{}', 'stolen'::bytea)`,
		`SELECT idem.idem_extend('bob', 'shared-lease', $1, interval '1 hour')`,
		`SELECT * FROM idem.idem_recovery('bob', 'shared-lease', $1)`,
		`SELECT idem.idem_step('bob', 'shared-lease', $1, 'step-1')`,
	} {
		_, err := bob.Exec(ctx, sql, aLease)
		var pgErr *pgconn.PgError
		ok := errors.As(err, &pgErr)
		if !ok || pgErr.Code != "55000" {
			t.Errorf("bob's %s with alice's token: %v", sql, err)
		}
	}
	// yield and release answer false for a claim they do not find (docs/sql-api.md).
	for _, sql := range []string{`SELECT idem.idem_yield('bob', 'shared-lease', $1)`, `SELECT idem.idem_release('bob', 'shared-lease', $1)`} {
		var done bool
		if err := bob.QueryRow(ctx, sql, aLease).Scan(&done); err != nil || done {
			t.Errorf("bob's %s with alice's token: %v %v", sql, done, err)
		}
	}
	// Bob's own lease claim under shared-lease is his to answer, and Alice's is untouched.
	pgtest.Exec(t, alice, `ROLLBACK`)
	var state string
	var attempt int64
	var body []byte
	if err := owner.QueryRow(ctx, `SELECT state::text, attempt, coalesce(response_body, '') FROM idem.idempotency_keys
		WHERE principal_id = 'alice' AND key = 'shared-lease'`).Scan(&state, &attempt, &body); err != nil {
		t.Fatal(err)
	}
	if state != "p" || attempt != aLease || len(body) != 0 {
		t.Errorf("alice's lease claim after bob's calls: state %s, attempt %d (was %d), body %q", state, attempt, aLease, body)
	}
	// Bob cannot read Alice's key's story under his name.
	pgtest.Exec(t, alice, `SELECT idem.idem_begin('alice', 'alice-only', 'POST /x', sha256('a'), p_lease => interval '1 minute')`)
	if n := pgtest.Count(t, bob, `SELECT count(*) FROM idem.idem_key('bob', 'alice-only')`); n != 0 {
		t.Errorf("bob's story of a key only alice has: %d rows", n)
	}
}

// TestSecretsMismatchCarriesNothingOfTheFirstAnswer: docs/sql-api.md, idem_begin's columns:
// the stored response (status, headers, body) and resource_id are set for `replay`, and
// provider_key for claimed, replay and in_progress; a `mismatch` (a different request under
// the key) is refused and must get nothing of the first request's answer or provider key.
func TestSecretsMismatchCarriesNothingOfTheFirstAnswer(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.NewDB(t)
	app := pgtest.Connect(t, pgtest.LoginRole(t, url, "idem_app"))
	pgtest.Exec(t, app, `BEGIN`)
	var attempt int64
	if err := app.QueryRow(ctx, `SELECT attempt FROM idem.idem_begin('alice', 'mm', 'POST /tokens', sha256('first'),
		p_request_fields => '{"name": "0123456789abcdef"}')`).Scan(&attempt); err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, app, `SELECT idem.idem_complete('alice', 'mm', $1, 201, '{"Location": "/tokens/ZZLOCATION"}',
		'{"token":"ZZBODYSECRET"}'::bytea, 'ZZRESOURCE')`, attempt)
	pgtest.Exec(t, app, `COMMIT`)
	for _, fp := range []string{"second", "first"} {
		action := "POST /tokens"
		if fp == "first" {
			action = "POST /other" // the same body, another action: a mismatch too
		}
		var outcome string
		var status *int32
		var headers, body, resource, withheld, pk *string
		if err := app.QueryRow(ctx, `SELECT outcome, response_status, response_headers::text, convert_from(response_body, 'UTF8'),
				resource_id, withheld, provider_key
			FROM idem.idem_begin('alice', 'mm', $1, sha256($2::bytea), p_request_fields => '{"name": "fedcba9876543210"}')`,
			action, fp).Scan(&outcome, &status, &headers, &body, &resource, &withheld, &pk); err != nil {
			t.Fatal(err)
		}
		if outcome != "mismatch" || status != nil || headers != nil || body != nil || resource != nil || pk != nil {
			t.Errorf("%s under the key: %s, status %v, headers %v, body %v, resource %v, provider key %v", action, outcome,
				secretsDeref(status), secretsDeref(headers), secretsDeref(body), secretsDeref(resource), secretsDeref(pk))
		}
	}
}

func secretsDeref[T any](p *T) any {
	if p == nil {
		return nil
	}
	return *p
}

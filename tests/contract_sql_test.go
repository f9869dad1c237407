package tests

// A line-by-line audit of docs/sql-api.md: the SQL functions called directly over pgx, with
// named arguments, as a service in another language would, as login roles that are only
// members of idem_app or idem_operator.

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"math/rand"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgidem/pgidem/internal/pgtest"
)

func csFP(s string) []byte { h := sha256.Sum256([]byte(s)); return h[:] }

func csCode(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code
	}
	if err == nil {
		return ""
	}
	return "other: " + err.Error()
}

// TestContractSQLNo40001UnderReadCommitted: docs/sql-api.md, idem_begin: "Under READ
// COMMITTED (the supported default) it never raises 40001." Several sessions of the
// application role hammer a few keys whose TTLs and leases run out within a millisecond, so
// that every path runs against the others (fresh claims, re-claims of expired and released
// keys, takeovers, replays, mismatches, save_final, release, yield, cleanup deleting rows under
// them), each call in READ COMMITTED. No call of idem_begin, idem_save_final or idem_cleanup may
// fail (the wait on a holder is far below the 2 s lock timeout); completions may only be
// fenced (55000).
func TestContractSQLNo40001UnderReadCommitted(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.NewDB(t)
	appURL := pgtest.LoginRole(t, url, "idem_app")
	const workers = 6
	deadline := time.Now().Add(4 * time.Second)
	var mu sync.Mutex
	failures := map[string]int{}
	fail := func(what string, err error) {
		mu.Lock()
		defer mu.Unlock()
		failures[what+": "+csCode(err)]++
		if failures[what+": "+csCode(err)] == 1 {
			t.Logf("%s: %v", what, err)
		}
	}
	counts := map[string]int{}
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			conn, err := pgx.Connect(ctx, appURL)
			if err != nil {
				fail("connect", err)
				return
			}
			defer conn.Close(ctx)
			rng := rand.New(rand.NewSource(int64(w)))
			for time.Now().Before(deadline) {
				key := fmt.Sprintf("k%d", rng.Intn(3))
				fp := csFP(fmt.Sprintf("r%d", rng.Intn(2)))
				ttl := []string{"1 millisecond", "5 milliseconds", "1 second"}[rng.Intn(3)]
				op := rng.Intn(5)
				mu.Lock()
				counts[fmt.Sprint(op)]++
				mu.Unlock()
				switch op {
				case 0, 1: // transactional claim, completed in its transaction
					tx, err := conn.Begin(ctx)
					if err != nil {
						fail("begin tx", err)
						return
					}
					var outcome string
					var tok int64
					err = tx.QueryRow(ctx, `SELECT outcome, attempt FROM idem.idem_begin(p_principal => 'p', p_key => $1,
						p_action => 'POST /x', p_request_sha256 => $2, p_ttl => $3::interval)`, key, fp, ttl).Scan(&outcome, &tok)
					if err != nil {
						fail("idem_begin (transactional)", err)
						_ = tx.Rollback(ctx)
						continue
					}
					if outcome == "claimed" {
						if rng.Intn(2) == 0 {
							_, err = tx.Exec(ctx, `SELECT idem.idem_complete(p_principal => 'p', p_key => $1, p_attempt => $2,
								p_status => 201, p_headers => '{}', p_body => 'ok')`, key, tok)
						} else {
							_, err = tx.Exec(ctx, `SELECT idem.idem_save_final(p_principal => 'p', p_key => $1, p_action => 'POST /x',
								p_request_sha256 => $2, p_ttl => $3::interval, p_status => 422, p_headers => '{}', p_body => 'no')`, key, fp, ttl)
						}
						if err != nil {
							fail("complete/save_final own claim", err)
							_ = tx.Rollback(ctx)
							continue
						}
					}
					if err := tx.Commit(ctx); err != nil {
						fail("commit", err)
					}
				case 2: // lease claim, then complete, release or yield, each on its own
					var outcome string
					var tok int64
					err := conn.QueryRow(ctx, `SELECT outcome, attempt FROM idem.idem_begin(p_principal => 'p', p_key => $1,
						p_action => 'POST /x', p_request_sha256 => $2, p_ttl => $3::interval, p_lease => '1 millisecond')`, key, fp, ttl).Scan(&outcome, &tok)
					if err != nil {
						fail("idem_begin (lease)", err)
						continue
					}
					if outcome != "claimed" {
						continue
					}
					switch rng.Intn(3) {
					case 0:
						_, err = conn.Exec(ctx, `SELECT idem.idem_complete(p_principal => 'p', p_key => $1, p_attempt => $2,
							p_status => 200, p_headers => '{}', p_body => NULL)`, key, tok)
						if err != nil && csCode(err) != "55000" {
							fail("idem_complete (lease)", err)
						}
					case 1:
						var ok bool
						if err := conn.QueryRow(ctx, `SELECT idem.idem_release(p_principal => 'p', p_key => $1, p_attempt => $2)`, key, tok).Scan(&ok); err != nil {
							fail("idem_release", err)
						}
					case 2:
						var ok bool
						if err := conn.QueryRow(ctx, `SELECT idem.idem_yield(p_principal => 'p', p_key => $1, p_attempt => $2)`, key, tok).Scan(&ok); err != nil {
							fail("idem_yield", err)
						}
					}
				case 3: // a final answer for a key nobody holds
					var ok bool
					if err := conn.QueryRow(ctx, `SELECT idem.idem_save_final(p_principal => 'p', p_key => $1, p_action => 'POST /x',
						p_request_sha256 => $2, p_ttl => $3::interval, p_status => 404, p_headers => '{}', p_body => 'nf')`, key, fp, ttl).Scan(&ok); err != nil {
						fail("idem_save_final", err)
					}
				case 4:
					var n int
					if err := conn.QueryRow(ctx, `SELECT idem.idem_cleanup(p_batch_size => 2)`).Scan(&n); err != nil {
						fail("idem_cleanup", err)
					}
				}
			}
		}(w)
	}
	wg.Wait()
	t.Logf("operations: %v", counts)
	for what, n := range failures {
		t.Errorf("%d times %s (READ COMMITTED: no call may fail; never 40001)", n, what)
	}
}

// TestContractSQLKeyTableLockGivesFastAnswers: docs/sql-api.md: each function "sets its own
// lock_timeout (2 seconds ...) ... behind a lock on the key table, a VACUUM FULL's or a LOCK
// TABLE's, they raise 55P03 instead of waiting it out", and the upgrade promise that a lock
// on the key table turns keyed requests into fast answers "without stalling the rest of the
// API". A maintenance session holds ACCESS EXCLUSIVE on idem.idempotency_keys; fresh sessions
// of the two roles, whose own lock_timeout is 0 (wait forever), call every function of the
// API once: each returns (or raises 55P03) within about the 2 seconds, none waits for the lock.
func TestContractSQLKeyTableLockGivesFastAnswers(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.NewDB(t)
	appURL := pgtest.LoginRole(t, url, "idem_app")
	opURL := pgtest.LoginRole(t, url, "idem_operator")
	admin := pgtest.Connect(t, url)
	holder := pgtest.Connect(t, url)
	// A lease claim to act on.
	var tok int64
	if err := admin.QueryRow(ctx, `SELECT attempt FROM idem.idem_begin(p_principal => 'p', p_key => 'k', p_action => 'POST /x',
		p_request_sha256 => sha256('r'), p_lease => '1 hour')`).Scan(&tok); err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, holder, `BEGIN; LOCK TABLE idem.idempotency_keys IN ACCESS EXCLUSIVE MODE`)
	t.Cleanup(func() { _, _ = holder.Exec(context.Background(), `ROLLBACK`) })
	calls := []struct{ url, name, sql string }{
		{appURL, "idem_begin", `SELECT * FROM idem.idem_begin(p_principal => 'p', p_key => 'k2', p_action => 'POST /x', p_request_sha256 => sha256('r'))`},
		{appURL, "idem_begin (replay probe)", `SELECT * FROM idem.idem_begin(p_principal => 'p', p_key => 'k', p_action => 'POST /x', p_request_sha256 => sha256('r'))`},
		{appURL, "idem_begin_steps", `SELECT * FROM idem.idem_begin_steps(p_principal => 'p', p_key => 'k3', p_action => 'POST /x', p_request_sha256 => sha256('r'), p_lease => '1 minute')`},
		{appURL, "idem_complete", fmt.Sprintf(`SELECT idem.idem_complete(p_principal => 'p', p_key => 'k', p_attempt => %d, p_status => 200, p_headers => '{}', p_body => NULL)`, tok)},
		{appURL, "idem_save_final", `SELECT idem.idem_save_final(p_principal => 'p', p_key => 'k4', p_action => 'POST /x', p_request_sha256 => sha256('r'), p_ttl => NULL, p_status => 404, p_headers => '{}', p_body => NULL)`},
		{appURL, "idem_release", fmt.Sprintf(`SELECT idem.idem_release(p_principal => 'p', p_key => 'k', p_attempt => %d)`, tok)},
		{appURL, "idem_yield", fmt.Sprintf(`SELECT idem.idem_yield(p_principal => 'p', p_key => 'k', p_attempt => %d)`, tok)},
		{appURL, "idem_extend", fmt.Sprintf(`SELECT idem.idem_extend(p_principal => 'p', p_key => 'k', p_attempt => %d, p_lease => '1 hour')`, tok)},
		{appURL, "idem_step", fmt.Sprintf(`SELECT idem.idem_step(p_principal => 'p', p_key => 'k', p_attempt => %d, p_step => 's')`, tok)},
		{appURL, "idem_recovery", fmt.Sprintf(`SELECT * FROM idem.idem_recovery(p_principal => 'p', p_key => 'k', p_attempt => %d)`, tok)},
		{appURL, "idem_cleanup", `SELECT idem.idem_cleanup()`},
		{appURL, "idem_cleanup_workers", `SELECT * FROM idem.idem_cleanup_workers()`},
		{appURL, "idem_health", `SELECT * FROM idem.idem_health()`},
		{appURL, "idem_summary", `SELECT * FROM idem.idem_summary()`},
		{appURL, "idem_key", `SELECT * FROM idem.idem_key(p_principal => 'p', p_key => 'k')`},
		{appURL, "idem_version", `SELECT * FROM idem.idem_version()`},
		{appURL, "idem_defaults", `SELECT * FROM idem.idem_defaults()`},
		{appURL, "idem_serves_version", `SELECT idem.idem_serves_version(5)`},
		{appURL, "idem_replication", `SELECT * FROM idem.idem_replication()`},
		{opURL, "idem_key_body", `SELECT idem.idem_key_body(p_principal => 'p', p_key => 'k')`},
		{opURL, "idem_stuck", `SELECT * FROM idem.idem_stuck()`},
		{opURL, "idem_release_stuck", fmt.Sprintf(`SELECT idem.idem_release_stuck(p_principal => 'p', p_key => 'k', p_attempt => %d)`, tok)},
	}
	var wg sync.WaitGroup
	for _, c := range calls {
		wg.Add(1)
		go func() {
			defer wg.Done()
			conn, err := pgx.Connect(ctx, c.url)
			if err != nil {
				t.Errorf("%s: connect: %v", c.name, err)
				return
			}
			defer conn.Close(ctx)
			if _, err := conn.Exec(ctx, `SET lock_timeout = 0; SET statement_timeout = '15s'`); err != nil {
				t.Errorf("%s: %v", c.name, err)
				return
			}
			start := time.Now()
			_, err = conn.Exec(ctx, "BEGIN; "+c.sql+"; ROLLBACK")
			took := time.Since(start)
			if code := csCode(err); (code != "" && code != "55P03") || took > 3500*time.Millisecond {
				t.Errorf("%s behind a lock on the key table: %v after %v; want an answer or 55P03 within about 2 s", c.name, err, took.Round(time.Millisecond))
			} else {
				t.Logf("%s: %q after %v", c.name, code, took.Round(time.Millisecond))
			}
		}()
	}
	wg.Wait()
}

type csAnswer struct {
	Outcome     string
	Attempt     *int64
	Status      *int32
	Headers     *string
	Body        []byte
	ResourceID  *string
	Withheld    *string
	Changed     []string
	RetryAfter  *time.Duration
	ProviderKey *string
}

type csQuerier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// csBegin calls idem_begin with named arguments; extra is appended to them.
func csBegin(t *testing.T, q csQuerier, key, action string, fp []byte, extra string, args ...any) csAnswer {
	t.Helper()
	a, err := csBeginErr(q, key, action, fp, extra, args...)
	if err != nil {
		t.Fatalf("idem_begin(%s, %s%s): %v", key, action, extra, err)
	}
	return a
}

func csBeginErr(q csQuerier, key, action string, fp []byte, extra string, args ...any) (csAnswer, error) {
	var a csAnswer
	all := append([]any{key, action, fp}, args...)
	err := q.QueryRow(context.Background(), `SELECT outcome, attempt, response_status, response_headers::text, response_body,
		resource_id, withheld, changed_fields, retry_after, provider_key
		FROM idem.idem_begin(p_principal => 'alice', p_key => $1, p_action => $2, p_request_sha256 => $3`+extra+`)`, all...).Scan(
		&a.Outcome, &a.Attempt, &a.Status, &a.Headers, &a.Body, &a.ResourceID, &a.Withheld, &a.Changed, &a.RetryAfter, &a.ProviderKey)
	return a, err
}

func csFields(kv ...string) string {
	s := "{"
	for i := 0; i < len(kv); i += 2 {
		if i > 0 {
			s += ","
		}
		h := sha256.Sum256([]byte(kv[i+1]))
		s += fmt.Sprintf(`"%s":"%x"`, kv[i], h)
	}
	return s + "}"
}

// TestContractSQLBeginColumns: docs/sql-api.md, idem_begin's columns, each "set for" the
// outcomes the table names and NULL otherwise: response_* and resource_id and withheld for
// replay; changed_fields for mismatch ("sorted names of top-level fields whose hashes differ
// (added and removed ones too); {} when the action differs; NULL when either request came
// without field hashes"); retry_after for in_progress ("how long the current lease still
// runs"); provider_key for claimed, replay, in_progress; attempt for all ("for claimed this
// claim's, otherwise the current holder's").
func TestContractSQLBeginColumns(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.NewDB(t)
	app := pgtest.Connect(t, pgtest.LoginRole(t, url, "idem_app"))
	f1 := csFields("amount", "100", "to", "acc", "memo", "m")
	f2 := csFields("amount", "500", "to", "acc", "extra", "x") // amount changed, memo removed, extra added

	// A transactional claim, completed with a resource id.
	tx, err := app.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	c := csBegin(t, tx, "k1", "POST /v1/transfers", csFP("a"), ", p_request_fields => $4::jsonb", f1)
	if c.Outcome != "claimed" || c.Attempt == nil || c.ProviderKey == nil || len(*c.ProviderKey) != 64 ||
		c.Status != nil || c.Headers != nil || c.Body != nil || c.ResourceID != nil || c.Withheld != nil || c.Changed != nil || c.RetryAfter != nil {
		t.Fatalf("claimed: %+v; want attempt and provider_key only", c)
	}
	pgtest.Exec(t, tx, `SELECT idem.idem_complete(p_principal => 'alice', p_key => 'k1', p_attempt => $1, p_status => 201,
		p_headers => '{"Content-Type":"application/json"}', p_body => '{"id":1}', p_resource_id => 'tr_1')`, *c.Attempt)
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}

	r := csBegin(t, app, "k1", "POST /v1/transfers", csFP("a"), "")
	if r.Outcome != "replay" || r.Attempt == nil || *r.Attempt != *c.Attempt || r.Status == nil || *r.Status != 201 ||
		r.Headers == nil || *r.Headers != `{"Content-Type": "application/json"}` || string(r.Body) != `{"id":1}` ||
		r.ResourceID == nil || *r.ResourceID != "tr_1" || r.Withheld != nil || r.Changed != nil || r.RetryAfter != nil ||
		r.ProviderKey == nil || *r.ProviderKey != *c.ProviderKey {
		t.Errorf("replay: %+v; want the stored answer, the claim's token and provider key", r)
	}

	// Mismatch: the same action, both with fields: the changed, added and removed, sorted.
	m := csBegin(t, app, "k1", "POST /v1/transfers", csFP("b"), ", p_request_fields => $4::jsonb", f2)
	if m.Outcome != "mismatch" || m.Attempt == nil || *m.Attempt != *c.Attempt || fmt.Sprint(m.Changed) != "[amount extra memo]" ||
		m.Status != nil || m.Body != nil || m.RetryAfter != nil || m.ProviderKey != nil {
		t.Errorf("mismatch with fields: %+v; want changed_fields [amount extra memo], no provider key", m)
	}
	// Another action (method or path), with fields on both sides: {} (not NULL).
	m = csBegin(t, app, "k1", "PUT /v1/transfers", csFP("a"), ", p_request_fields => $4::jsonb", f1)
	if m.Outcome != "mismatch" || m.Changed == nil || len(m.Changed) != 0 {
		t.Errorf("mismatch of another action: changed_fields %#v; want {}", m.Changed)
	}
	// Another action, this request without fields: still {} ("{} when the action differs").
	m = csBegin(t, app, "k1", "POST /v1/other", csFP("b"), "")
	if m.Outcome != "mismatch" || m.Changed == nil || len(m.Changed) != 0 {
		t.Errorf("mismatch of another action without fields: changed_fields %#v; want {}", m.Changed)
	}
	// The same action, this request without fields: NULL (unknown).
	m = csBegin(t, app, "k1", "POST /v1/transfers", csFP("b"), "")
	if m.Outcome != "mismatch" || m.Changed != nil {
		t.Errorf("mismatch without this request's fields: changed_fields %#v; want NULL", m.Changed)
	}
	// The first request came without fields: NULL, though this one has them.
	tx, err = app.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	c2 := csBegin(t, tx, "k2", "POST /v1/transfers", csFP("a"), "")
	pgtest.Exec(t, tx, `SELECT idem.idem_complete(p_principal => 'alice', p_key => 'k2', p_attempt => $1, p_status => 200,
		p_headers => '{}', p_body => NULL)`, *c2.Attempt)
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	m = csBegin(t, app, "k2", "POST /v1/transfers", csFP("b"), ", p_request_fields => $4::jsonb", f2)
	if m.Outcome != "mismatch" || m.Changed != nil {
		t.Errorf("mismatch against a request stored without fields: changed_fields %#v; want NULL", m.Changed)
	}
	// A replay of a body-less answer: the body NULL, not withheld.
	r = csBegin(t, app, "k2", "POST /v1/transfers", csFP("a"), "")
	if r.Outcome != "replay" || r.Body != nil || r.Withheld != nil || r.Status == nil || *r.Status != 200 || r.ResourceID != nil {
		t.Errorf("replay of a body-less answer: %+v", r)
	}

	// A lease claim in progress: in_progress, the holder's token, retry_after within the lease.
	l := csBegin(t, app, "k3", "POST /v1/exports", csFP("e"), ", p_lease => '1 minute'")
	sent := time.Now()
	ip := csBegin(t, app, "k3", "POST /v1/exports", csFP("e"), ", p_lease => '1 minute'")
	elapsed := time.Since(sent)
	if ip.Outcome != "in_progress" || ip.Attempt == nil || *ip.Attempt != *l.Attempt || ip.RetryAfter == nil ||
		*ip.RetryAfter > time.Minute || *ip.RetryAfter < time.Minute-elapsed-5*time.Second ||
		ip.ProviderKey == nil || *ip.ProviderKey != *l.ProviderKey || ip.Status != nil || ip.Changed != nil {
		t.Errorf("in_progress: %+v (retry_after %v); want the holder's token and provider key, retry_after just under 1 minute", ip, ip.RetryAfter)
	}
	// Another request under the running lease: mismatch, the holder's token, {} for another action.
	m = csBegin(t, app, "k3", "POST /v1/other", csFP("e"), "")
	if m.Outcome != "mismatch" || m.Attempt == nil || *m.Attempt != *l.Attempt || m.RetryAfter != nil || m.ProviderKey != nil {
		t.Errorf("mismatch under a running lease: %+v", m)
	}

	// withheld: one_time_secret and too_large replay with body NULL and the reason.
	for i, reason := range []string{"one_time_secret", "too_large"} {
		key := fmt.Sprintf("w%d", i)
		w := csBegin(t, app, key, "POST /v1/keys", csFP(key), ", p_lease => '1 minute'")
		pgtest.Exec(t, app, `SELECT idem.idem_complete(p_principal => 'alice', p_key => $1, p_attempt => $2, p_status => 201,
			p_headers => '{}', p_body => NULL, p_withheld => $3)`, key, *w.Attempt, reason)
		r := csBegin(t, app, key, "POST /v1/keys", csFP(key), "")
		if r.Outcome != "replay" || r.Body != nil || r.Withheld == nil || *r.Withheld != reason || r.Status == nil || *r.Status != 201 {
			t.Errorf("replay of a %s answer: %+v", reason, r)
		}
		// With a body beside it: 22023, nothing stored.
		w2 := csBegin(t, app, key+"b", "POST /v1/keys", csFP(key), ", p_lease => '1 minute'")
		_, err := app.Exec(ctx, `SELECT idem.idem_complete(p_principal => 'alice', p_key => $1, p_attempt => $2, p_status => 201,
			p_headers => '{}', p_body => 'secret', p_withheld => $3)`, key+"b", *w2.Attempt, reason)
		if csCode(err) != "22023" {
			t.Errorf("idem_complete with p_withheld %s and a body: %v; want 22023", reason, err)
		}
	}
}

// TestContractSQLCatalogPromises: docs/sql-api.md: every function of the application's API
// "is SECURITY DEFINER", "pins search_path = pg_catalog, pg_temp", "sets its own lock_timeout
// (2 seconds ...)", "uses no EXCEPTION block (no subtransaction)", "is granted to the role
// idem_app (name configurable) and to nobody else"; idem_defaults and idem_serves_version
// are SECURITY INVOKER; every function carries a COMMENT ON FUNCTION; nothing in schema idem is
// granted to PUBLIC.
func TestContractSQLCatalogPromises(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	conn := pgtest.Connect(t, pgtest.NewDB(t))
	api := []string{"idem_begin", "idem_begin_steps", "idem_complete", "idem_save_final", "idem_release", "idem_yield",
		"idem_extend", "idem_step", "idem_recovery", "idem_cleanup"}
	for _, name := range api {
		var secdef, exc bool
		var cfg []string
		var grantees []string
		if err := conn.QueryRow(ctx, `SELECT p.prosecdef, coalesce(p.proconfig, '{}'), p.prosrc ~* '\mexception\s+when\M',
			ARRAY(SELECT CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE a.grantee::regrole::text END
			        FROM aclexplode(coalesce(p.proacl, acldefault('f', p.proowner))) AS a
			       WHERE a.grantee <> p.proowner AND a.privilege_type = 'EXECUTE' ORDER BY 1)
			FROM pg_proc p WHERE p.pronamespace = 'idem'::regnamespace AND p.proname = $1`, name).Scan(&secdef, &cfg, &exc, &grantees); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		got := fmt.Sprint(cfg)
		if !secdef || !csContains(cfg, "search_path=pg_catalog, pg_temp") || !csContains(cfg, "lock_timeout=2s") || exc ||
			fmt.Sprint(grantees) != "[idem_app]" {
			t.Errorf("%s: SECURITY DEFINER %v, settings %s, EXCEPTION block %v, EXECUTE granted to %v; want DEFINER, "+
				"search_path pinned, lock_timeout 2s, no EXCEPTION block, idem_app only", name, secdef, got, exc, grantees)
		}
	}
	for _, name := range []string{"idem_defaults", "idem_serves_version"} {
		var secdef bool
		if err := conn.QueryRow(ctx, `SELECT prosecdef FROM pg_proc WHERE pronamespace = 'idem'::regnamespace AND proname = $1`, name).Scan(&secdef); err != nil || secdef {
			t.Errorf("%s: SECURITY DEFINER %v (%v); want INVOKER", name, secdef, err)
		}
	}
	rows, err := conn.Query(ctx, `SELECT p.oid::regprocedure::text FROM pg_proc p
		WHERE p.pronamespace = 'idem'::regnamespace AND obj_description(p.oid, 'pg_proc') IS NULL
		UNION ALL
		SELECT p.oid::regprocedure::text || ' (an EXCEPTION block)' FROM pg_proc p
		WHERE p.pronamespace = 'idem'::regnamespace AND p.prosrc ~* '\mexception\s+when\M'
		UNION ALL
		SELECT p.oid::regprocedure::text || ' (granted to PUBLIC)' FROM pg_proc p
		WHERE p.pronamespace = 'idem'::regnamespace
		  AND EXISTS (SELECT FROM aclexplode(coalesce(p.proacl, acldefault('f', p.proowner))) a WHERE a.grantee = 0)
		UNION ALL
		SELECT c.oid::regclass::text || ' (granted to PUBLIC)' FROM pg_class c
		WHERE c.relnamespace = 'idem'::regnamespace
		  AND EXISTS (SELECT FROM aclexplode(coalesce(c.relacl, acldefault(CASE WHEN c.relkind = 'S' THEN 's' ELSE 'r' END::"char", c.relowner))) a WHERE a.grantee = 0)
		UNION ALL
		SELECT 'schema idem (granted to PUBLIC)' FROM pg_namespace n
		WHERE n.nspname = 'idem' AND EXISTS (SELECT FROM aclexplode(coalesce(n.nspacl, acldefault('n', n.nspowner))) a WHERE a.grantee = 0)`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	for rows.Next() {
		var what string
		if err := rows.Scan(&what); err != nil {
			t.Fatal(err)
		}
		t.Errorf("%s: every function carries a COMMENT, none has an EXCEPTION block, nothing is granted to PUBLIC", what)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
}

func csContains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// TestContractSQLSaveFinalAndRelease: docs/sql-api.md, idem_save_final: "True when it stored
// the response"; "for a key nobody holds (absent, expired or released) it inserts the answer";
// "it never overwrites a completed key, nor touches another holder's lease: then it returns
// false"; p_withheld "as in idem_complete". idem_release: "Returns false when no lease claim
// with this attempt is in progress"; a transactional claim raises 55000. As idem_app.
func TestContractSQLSaveFinalAndRelease(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.NewDB(t)
	app := pgtest.Connect(t, pgtest.LoginRole(t, url, "idem_app"))
	admin := pgtest.Connect(t, url)
	saveFinal := func(key, fp string, status int, body any, withheld any) bool {
		t.Helper()
		var ok bool
		if err := app.QueryRow(ctx, `SELECT idem.idem_save_final(p_principal => 'alice', p_key => $1, p_action => 'POST /x',
			p_request_sha256 => sha256($2::bytea), p_ttl => NULL, p_status => $3, p_headers => '{}', p_body => $4::bytea,
			p_withheld => $5)`, key, fp, status, body, withheld).Scan(&ok); err != nil {
			t.Fatalf("save_final %s: %v", key, err)
		}
		return ok
	}
	row := func(key string) string {
		var s string
		if err := admin.QueryRow(ctx, `SELECT coalesce((SELECT format('%s/%s/%s/%s/%s', state, attempt, response_status,
			encode(response_body, 'escape'), withheld) FROM idem.idempotency_keys WHERE principal_id = 'alice' AND key = $1), 'none')`, key).Scan(&s); err != nil {
			t.Fatal(err)
		}
		return s
	}
	// Absent: stored.
	if !saveFinal("a", "r", 404, "nf", nil) {
		t.Errorf("save_final on an absent key: false; want true")
	}
	// Completed: false, nothing overwritten (same request, another request, another status).
	before := row("a")
	if saveFinal("a", "r", 422, "other", nil) || saveFinal("a", "s", 409, "x", nil) || row("a") != before {
		t.Errorf("save_final over a completed key: stored, or the row changed: %s -> %s", before, row("a"))
	}
	// withheld carried: replay with a NULL body and the reason.
	if !saveFinal("w", "r", 413, nil, "too_large") {
		t.Errorf("save_final with p_withheld: false")
	}
	r := csBegin(t, app, "w", "POST /x", csFP("r"), "")
	if r.Outcome != "replay" || r.Body != nil || r.Withheld == nil || *r.Withheld != "too_large" || r.Status == nil || *r.Status != 413 {
		t.Errorf("replay of a withheld final answer: %+v", r)
	}
	// Another holder's running lease: false, untouched; its holder then completes.
	l := csBegin(t, app, "l", "POST /x", csFP("r"), ", p_lease => '1 minute'")
	before = row("l")
	if saveFinal("l", "r", 422, "x", nil) || saveFinal("l", "s", 422, "x", nil) || row("l") != before {
		t.Errorf("save_final over a running lease: stored, or the row changed: %s -> %s", before, row("l"))
	}
	// idem_release: the holder's token, true once; then false; a stale token false.
	var ok bool
	if err := app.QueryRow(ctx, `SELECT idem.idem_release(p_principal => 'alice', p_key => 'l', p_attempt => $1)`, *l.Attempt-1).Scan(&ok); err != nil || ok {
		t.Errorf("release with another token: %v %v; want false", ok, err)
	}
	if err := app.QueryRow(ctx, `SELECT idem.idem_release(p_principal => 'alice', p_key => 'l', p_attempt => $1)`, *l.Attempt).Scan(&ok); err != nil || !ok {
		t.Errorf("release by the holder: %v %v; want true", ok, err)
	}
	if err := app.QueryRow(ctx, `SELECT idem.idem_release(p_principal => 'alice', p_key => 'l', p_attempt => $1)`, *l.Attempt).Scan(&ok); err != nil || ok {
		t.Errorf("second release: %v %v; want false", ok, err)
	}
	// Released: save_final stores (a key nobody holds).
	if !saveFinal("l", "s", 422, "after release", nil) {
		t.Errorf("save_final on a released key: false; want true")
	}
	// A completed key: release false, the answer stays.
	before = row("a")
	var tok int64
	if err := admin.QueryRow(ctx, `SELECT attempt FROM idem.idempotency_keys WHERE key = 'a'`).Scan(&tok); err != nil {
		t.Fatal(err)
	}
	if err := app.QueryRow(ctx, `SELECT idem.idem_release(p_principal => 'alice', p_key => 'a', p_attempt => $1)`, tok).Scan(&ok); err != nil || ok || row("a") != before {
		t.Errorf("release of a completed key: %v %v, row %s -> %s; want false, unchanged", ok, err, before, row("a"))
	}
	// Expired (completed with a TTL of 1 ms): save_final stores again.
	if err := app.QueryRow(ctx, `SELECT idem.idem_save_final(p_principal => 'alice', p_key => 'e', p_action => 'POST /x',
		p_request_sha256 => sha256('r'), p_ttl => '1 millisecond', p_status => 404, p_headers => '{}', p_body => NULL)`).Scan(&ok); err != nil || !ok {
		t.Fatalf("save_final e: %v %v", ok, err)
	}
	time.Sleep(20 * time.Millisecond)
	if !saveFinal("e", "s", 410, "gone", nil) || row("e") == "none" {
		t.Errorf("save_final on an expired key: not stored (%s); want true", row("e"))
	}
	// A transactional claim: release raises 55000 and the transaction is aborted.
	tx, err := app.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	c := csBegin(t, tx, "t", "POST /x", csFP("r"), "")
	_, err = tx.Exec(ctx, `SELECT idem.idem_release(p_principal => 'alice', p_key => 't', p_attempt => $1)`, *c.Attempt)
	if csCode(err) != "55000" {
		t.Errorf("release of a transactional claim: %v; want 55000", err)
	}
	if _, err := tx.Exec(ctx, `SELECT 1`); csCode(err) != "25P02" {
		t.Errorf("after the 55000 the transaction: %v; want aborted (25P02)", err)
	}
}

// TestContractSQLCleanupBatchOrderAndDefault: docs/sql-api.md, idem_cleanup: "deletes at
// most p_batch_size expired keys ..., oldest expires_at first, skipping rows that other
// transactions have locked (FOR UPDATE SKIP LOCKED) ..., and returns how many it deleted";
// p_batch_size DEFAULT 1000 (idem_defaults). As idem_app.
func TestContractSQLCleanupBatchOrderAndDefault(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.NewDB(t)
	app := pgtest.Connect(t, pgtest.LoginRole(t, url, "idem_app"))
	admin := pgtest.Connect(t, url)
	pgtest.InsertExpired(t, admin, "p", 6) // old-1 (oldest) .. old-6
	// An answer still kept (expires_at past, its answer's TTL not) and a lease still running.
	pgtest.Exec(t, admin, `INSERT INTO idem.idempotency_keys (expires_at, lease_expires_at, attempt, action_hash, state, principal_id, key,
		request_sha256, response_status, response_headers)
		VALUES (now() - interval '2 days', now() + interval '1 hour', nextval('idem.token_seq'), 0, 'c', 'p', 'kept', sha256('x'), 200, '{}'),
		       (now() - interval '2 days', now() + interval '1 hour', nextval('idem.token_seq'), 0, 'p', 'p', 'lease', sha256('x'), NULL, NULL)`)
	locker, err := admin.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = locker.Rollback(ctx) }()
	pgtest.Exec(t, locker, `SELECT 1 FROM idem.idempotency_keys WHERE key = 'old-2' FOR UPDATE`)
	left := func() string {
		var s string
		if err := admin.QueryRow(ctx, `SELECT string_agg(key, ',' ORDER BY key) FROM idem.idempotency_keys`).Scan(&s); err != nil {
			t.Fatal(err)
		}
		return s
	}
	var n int
	if err := app.QueryRow(ctx, `SELECT idem.idem_cleanup(p_batch_size => 2)`).Scan(&n); err != nil || n != 2 {
		t.Fatalf("cleanup(2): %d %v", n, err)
	}
	if got := left(); got != "kept,lease,old-2,old-4,old-5,old-6" {
		t.Errorf("after a batch of 2 with old-2 locked: %s; want old-1 and old-3 gone (the oldest unlocked), old-2 skipped", got)
	}
	if err := app.QueryRow(ctx, `SELECT idem.idem_cleanup(p_batch_size => 10)`).Scan(&n); err != nil || n != 3 {
		t.Errorf("cleanup(10): %d %v; want the 3 unlocked expired rows", n, err)
	}
	_ = locker.Rollback(ctx)
	if err := app.QueryRow(ctx, `SELECT idem.idem_cleanup()`).Scan(&n); err != nil || n != 1 {
		t.Errorf("cleanup() once unlocked: %d %v; want 1", n, err)
	}
	if got := left(); got != "kept,lease" {
		t.Errorf("left: %s; want the kept answer and the running lease", got)
	}
	// The default batch: 1000.
	pgtest.InsertExpired(t, admin, "q", 1001)
	if err := app.QueryRow(ctx, `SELECT idem.idem_cleanup()`).Scan(&n); err != nil || n != 1000 {
		t.Errorf("cleanup() of 1001 expired keys: %d %v; want the default batch, 1000", n, err)
	}
	if err := app.QueryRow(ctx, `SELECT idem.idem_cleanup()`).Scan(&n); err != nil || n != 1 {
		t.Errorf("then: %d %v; want 1", n, err)
	}
}

// TestContractSQLLockTimeoutIsTheFunctions: docs/sql-api.md: p_lock_timeout "NULL: 2
// seconds", and each function "sets its own lock_timeout (2 seconds ...)": the wait for an
// uncommitted holder of the key ends with 55P03 after about 2 s whatever the caller's own
// lock_timeout, shorter (100 ms) or longer (10 s), for idem_begin and idem_save_final; and the
// caller's transaction is aborted. p_lock_timeout bounds a wait for a lock on the key table too
// (a fresh session, behind LOCK TABLE): 300 ms, not 2 s.
func TestContractSQLLockTimeoutIsTheFunctions(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.NewDB(t)
	appURL := pgtest.LoginRole(t, url, "idem_app")
	holder := pgtest.Connect(t, appURL)
	pgtest.Exec(t, holder, `BEGIN`)
	csBegin(t, holder, "held", "POST /x", csFP("r"), "")
	calls := map[string]string{
		"idem_begin": `SELECT * FROM idem.idem_begin(p_principal => 'alice', p_key => 'held', p_action => 'POST /x', p_request_sha256 => sha256('r'))`,
		"idem_save_final": `SELECT idem.idem_save_final(p_principal => 'alice', p_key => 'held', p_action => 'POST /x', p_request_sha256 => sha256('r'),
			p_ttl => NULL, p_status => 404, p_headers => '{}', p_body => NULL)`,
	}
	var wg sync.WaitGroup
	for name, sql := range calls {
		for _, own := range []string{"100ms", "10s"} {
			wg.Add(1)
			go func() {
				defer wg.Done()
				conn, err := pgx.Connect(ctx, appURL)
				if err != nil {
					t.Error(err)
					return
				}
				defer conn.Close(ctx)
				tx, err := conn.Begin(ctx)
				if err != nil {
					t.Error(err)
					return
				}
				defer func() { _ = tx.Rollback(ctx) }()
				if _, err := tx.Exec(ctx, `SET LOCAL lock_timeout = '`+own+`'`); err != nil {
					t.Error(err)
					return
				}
				start := time.Now()
				_, err = tx.Exec(ctx, sql)
				took := time.Since(start)
				if csCode(err) != "55P03" || took < 1800*time.Millisecond || took > 3*time.Second {
					t.Errorf("%s behind an uncommitted holder, caller's lock_timeout %s: %v after %v; want 55P03 after about 2 s", name, own, err, took.Round(time.Millisecond))
				}
				if _, err := tx.Exec(ctx, `SELECT 1`); csCode(err) != "25P02" {
					t.Errorf("%s: after the 55P03 the caller's transaction: %v; want aborted", name, err)
				}
			}()
		}
	}
	wg.Wait()
	_, _ = holder.Exec(ctx, `ROLLBACK`)

	// p_lock_timeout behind a lock on the key table, in a session that never called the API.
	admin := pgtest.Connect(t, url)
	pgtest.Exec(t, admin, `BEGIN; LOCK TABLE idem.idempotency_keys IN ACCESS EXCLUSIVE MODE`)
	defer func() { _, _ = admin.Exec(ctx, `ROLLBACK`) }()
	for _, fn := range []string{"idem_begin", "idem_begin_steps"} {
		fresh := pgtest.Connect(t, appURL)
		start := time.Now()
		_, err := fresh.Exec(ctx, `SELECT * FROM idem.`+fn+`(p_principal => 'alice', p_key => 'k', p_action => 'POST /x',
			p_request_sha256 => sha256('r'), p_lock_timeout => '300 milliseconds')`)
		took := time.Since(start)
		if csCode(err) != "55P03" || took > 1500*time.Millisecond {
			t.Errorf("%s with p_lock_timeout 300 ms behind LOCK TABLE: %v after %v; want 55P03 after about 300 ms", fn, err, took.Round(time.Millisecond))
		}
	}
}

// TestContractSQLAnswersReadDrawNoToken: docs/sql-api.md, idem_begin: "A key that is already
// there is decided on the row that read finds, without a write", and attempt: "A replay, a
// mismatch or an in_progress answer decided on the row as first read draws none" (no token
// from idem.token_seq), and no write: the row's xmin stays.
func TestContractSQLAnswersReadDrawNoToken(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.NewDB(t)
	app := pgtest.Connect(t, pgtest.LoginRole(t, url, "idem_app"))
	admin := pgtest.Connect(t, url)
	c := csBegin(t, app, "done", "POST /x", csFP("r"), ", p_lease => '1 minute'")
	pgtest.Exec(t, app, `SELECT idem.idem_complete(p_principal => 'alice', p_key => 'done', p_attempt => $1, p_status => 200, p_headers => '{}', p_body => 'x')`, *c.Attempt)
	csBegin(t, app, "running", "POST /x", csFP("r"), ", p_lease => '1 minute', p_request_fields => $4::jsonb", csFields("a", "1"))
	state := func() string {
		var s string
		if err := admin.QueryRow(ctx, `SELECT (SELECT last_value FROM idem.token_seq)::text || ' ' ||
			(SELECT string_agg(key || ':' || xmin::text, ',' ORDER BY key) FROM idem.idempotency_keys)`).Scan(&s); err != nil {
			t.Fatal(err)
		}
		return s
	}
	before := state()
	for _, call := range []struct {
		key, action, fp, extra, want string
	}{
		{"done", "POST /x", "r", "", "replay"},
		{"done", "POST /x", "s", "", "mismatch"},
		{"done", "PUT /x", "r", "", "mismatch"},
		{"running", "POST /x", "r", ", p_lease => '1 minute'", "in_progress"},
		{"running", "POST /x", "s", ", p_request_fields => '{\"a\":\"00000000000000000000\"}'", "mismatch"},
	} {
		if a := csBegin(t, app, call.key, call.action, csFP(call.fp), call.extra); a.Outcome != call.want {
			t.Fatalf("%+v: %s", call, a.Outcome)
		}
	}
	if after := state(); after != before {
		t.Errorf("token sequence and rows before %s, after the answers %s: an answer read drew a token or wrote", before, after)
	}
}

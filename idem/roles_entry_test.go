package idem_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/idem/idemmigrate"
	"github.com/pgidem/pgidem/idem/idemprom"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestRolesNewAsOperatorIsRefused: New, StartCleaner and Do check at start that their role may
// call the SQL API ("a role that may not call the SQL API, is an error that says how to fix
// it, not a 503 on every request"). A login role in idem_operator only (the role
// docs/operations.md gives people, not servers) passed the schema check, whose idem_version
// both roles may call: New returned a middleware whose every keyed request answered 500
// idempotency_misconfigured, StartCleaner a cleaner whose every pass failed, and Do a bare
// 42501 from its claim. All three refuse it now with ErrPermissionDenied naming the grant.
func TestRolesNewAsOperatorIsRefused(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.NewDB(t)
	ops := newPool(t, pgtest.LoginRole(t, db, "idem_operator"))
	m, err := idem.New(ctx, idem.Options{DB: ops, Principal: alice, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err == nil {
		// Show what it does instead: every keyed request fails.
		srv := httptest.NewServer(m.Route(idem.Route{Action: "POST /x"})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.WriteHeader(http.StatusCreated)
		})))
		defer srv.Close()
		st, _, body := pgtest.Send(t, ctx, "POST", srv.URL, `{}`, "Idempotency-Key", "k")
		t.Errorf("New as a member of idem_operator only: no error; then a keyed request answers %d %s", st, body)
	} else if !errors.Is(err, idem.ErrPermissionDenied) {
		t.Errorf("New as a member of idem_operator only: %v, want ErrPermissionDenied", err)
	}
	if c, err := idem.StartCleaner(ctx, ops, idem.CleanerOptions{Interval: time.Hour, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}); err == nil {
		c.Stop()
		_, cerr := idem.Cleanup(ctx, ops, 10)
		t.Errorf("StartCleaner as a member of idem_operator only: no error (yet idem.Cleanup as that role: %v)", cerr)
	} else if !errors.Is(err, idem.ErrPermissionDenied) {
		t.Errorf("StartCleaner as a member of idem_operator only: %v, want ErrPermissionDenied", err)
	}
	// CheckSchema itself asks only what both roles may (idem_version: `server keys` runs it as
	// an operator).
	if err := idem.CheckSchema(ctx, ops); err != nil {
		t.Errorf("CheckSchema as a member of idem_operator only: %v, want nil", err)
	}
	// Do's first call checks too, then its claim fails: at least the failure is the documented one.
	job := idem.Job{Principal: "p", Key: "k", Action: "a"}
	noop := func(context.Context, pgx.Tx) (int, error) { return 1, nil }
	if _, _, err := idem.Do(ctx, ops, job, idem.TxOptions{}, noop); !errors.Is(err, idem.ErrPermissionDenied) ||
		!strings.Contains(err.Error(), "GRANT idem_app") {
		t.Errorf("Do as a member of idem_operator only: %v, want ErrPermissionDenied naming the GRANT (as CheckSchema's)", err)
	}
}

// roleOf returns the user name of a connection string.
func roleOf(t *testing.T, url string) string {
	t.Helper()
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	return cfg.User
}

// TestRolesRoleIsolationDefault (it failed: pgx's bare BEGIN took the role's default): TxOptions' doc: "Default READ COMMITTED, the level the SQL
// API is designed for (it never raises 40001 there)"; "The zero value is READ COMMITTED, 3
// attempts"; docs/sql-api.md: "Claim under READ COMMITTED (the Go driver's default)". A DBA's
// ALTER ROLE ... SET default_transaction_isolation on the service's login role (a member of
// idem_app) must not change what the zero TxOptions run at: Do's fn sees READ COMMITTED, and
// a Do (retries off, MaxAttempts 1) that waited on the row lock of the same key held by
// another process answers from the committed row (a replay), not with 40001.
func TestRolesRoleIsolationDefault(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.NewDB(t)
	appURL := pgtest.LoginRole(t, db, "idem_app")
	admin := pgtest.Connect(t, db)
	pgtest.Exec(t, admin, `ALTER ROLE `+roleOf(t, appURL)+` SET default_transaction_isolation = 'repeatable read'`)
	app := newPool(t, appURL)

	var level string
	job := idem.Job{Principal: "p", Key: "iso-1", Action: "a", Input: map[string]int{"n": 1}}
	if _, _, err := idem.Do(ctx, app, job, idem.TxOptions{}, func(ctx context.Context, tx pgx.Tx) (int, error) {
		return 1, tx.QueryRow(ctx, `SELECT current_setting('transaction_isolation')`).Scan(&level)
	}); err != nil {
		t.Fatal(err)
	}
	if level != "read committed" {
		t.Errorf("Do with the zero TxOptions ran at %q, documented READ COMMITTED", level)
	}

	// The middleware's unit of work (docs/sql-api.md: "Claim under READ COMMITTED (the Go
	// driver's default)").
	m, err := idem.New(ctx, idem.Options{DB: app, Principal: alice, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	var mwLevel string
	srv := httptest.NewServer(m.Route(idem.Route{Action: "POST /x"})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_ = idem.TxFrom(r.Context()).QueryRow(r.Context(), `SELECT current_setting('transaction_isolation')`).Scan(&mwLevel)
		w.WriteHeader(http.StatusCreated)
	})))
	defer srv.Close()
	if st, _, body := pgtest.Send(t, ctx, "POST", srv.URL, `{}`, "Idempotency-Key", "mw-1"); st != 201 {
		t.Fatalf("a keyed request: %d %s", st, body)
	}
	if mwLevel != "read committed" {
		t.Errorf("the middleware's unit of work ran at %q, documented READ COMMITTED (the Go driver's default)", mwLevel)
	}

	// Two "processes" (two gates, two pools) with the same job.
	other := newPool(t, appURL)
	job2 := idem.Job{Principal: "p", Key: "iso-2", Action: "a", Input: map[string]int{"n": 2}, Gate: idem.NewGate(idem.GateOptions{})}
	release := make(chan struct{})
	first := make(chan error, 1)
	started := make(chan struct{})
	go func() {
		_, _, err := idem.Do(ctx, app, job2, idem.TxOptions{MaxAttempts: 1}, func(ctx context.Context, tx pgx.Tx) (int, error) {
			close(started)
			<-release
			return 7, nil
		})
		first <- err
	}()
	<-started
	job2b := job2
	job2b.Gate = idem.NewGate(idem.GateOptions{})
	job2b.LockTimeout = 20 * time.Second
	type res struct {
		v        int
		replayed bool
		err      error
	}
	second := make(chan res, 1)
	go func() {
		v, replayed, err := idem.Do(ctx, other, job2b, idem.TxOptions{MaxAttempts: 1}, func(ctx context.Context, tx pgx.Tx) (int, error) {
			return 8, nil
		})
		second <- res{v, replayed, err}
	}()
	pgtest.WaitFor(t, admin, pgtest.KeyWaiters)
	close(release)
	if err := <-first; err != nil {
		t.Fatalf("the first Do: %v", err)
	}
	r := <-second
	if r.err != nil || !r.replayed || r.v != 7 {
		t.Errorf("the duplicate Do that waited on the row lock (zero isolation, MaxAttempts 1): %d replayed=%v %v; want 7 replayed (READ COMMITTED never raises 40001)",
			r.v, r.replayed, r.err)
	}
}

// TestRolesHostileSearchPathOfTheAppRole: docs/sql-api.md: every function "pins search_path =
// pg_catalog, pg_temp and qualifies every name"; docs/sql-api.md (the roles): the application logs in as a
// member of idem_app. A login role in idem_app whose search_path puts a schema of its own first
// (before pg_catalog), holding functions and operators named like those the SQL API uses, must
// not get any of them run by the API (which runs as the owner): every call of the API below,
// made with that search_path, succeeds, and no function or operator of the role's schema ran.
// Passes; pins the promise for every function of the application's and the operators' API.
func TestRolesHostileSearchPathOfTheAppRole(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.NewDB(t)
	appURL := pgtest.LoginRole(t, db, "idem_app")
	opsURL := pgtest.LoginRole(t, db, "idem_operator")
	admin := pgtest.Connect(t, db)
	app := roleOf(t, appURL)
	pgtest.Exec(t, admin, `CREATE SCHEMA evilschema AUTHORIZATION `+app+`;
		GRANT USAGE ON SCHEMA evilschema TO PUBLIC`)
	// The role's own objects: each raises, so that a call of one fails the API's call.
	c := pgtest.Connect(t, appURL)
	for _, sig := range []struct{ name, args, ret string }{
		{"now", "", "timestamptz"}, {"clock_timestamp", "", "timestamptz"}, {"statement_timestamp", "", "timestamptz"},
		{"transaction_timestamp", "", "timestamptz"}, {"sha256", "bytea", "bytea"}, {"length", "text", "integer"},
		{"octet_length", "bytea", "integer"}, {"octet_length", "text", "integer"}, {"hashtext", "text", "integer"},
		{"set_config", "text, text, boolean", "text"}, {"current_setting", "text", "text"},
		{"current_setting", "text, boolean", "text"}, {"pg_try_advisory_xact_lock", "bigint", "boolean"},
		{"pg_advisory_xact_lock", "bigint", "void"}, {"encode", "bytea, text", "text"}, {"decode", "text, text", "bytea"},
		{"convert_to", "text, text", "bytea"}, {"nextval", "regclass", "bigint"}, {"lower", "text", "text"},
		{"substr", "text, integer, integer", "text"}, {"left", "text, integer", "text"}, {"md5", "text", "text"},
		{"jsonb_typeof", "jsonb", "text"}, {"to_jsonb", "anyelement", "jsonb"}, {"greatest_ts", "", "timestamptz"},
		{"hmac", "bytea, bytea, text", "bytea"}, {"digest", "bytea, text", "bytea"}, {"pg_relation_size", "regclass", "bigint"},
		{"pg_total_relation_size", "regclass", "bigint"}, {"pg_is_in_recovery", "", "boolean"},
		{"txid_current", "", "bigint"}, {"pg_current_xact_id", "", "xid8"}, {"array_length", "anyarray, integer", "integer"},
		{"cardinality", "anyarray", "integer"}, {"extract_epoch", "interval", "numeric"}, {"int8send", "bigint", "bytea"},
		{"format", "text, integer", "text"},
	} {
		pgtest.Exec(t, c, `CREATE FUNCTION evilschema.`+sig.name+`(`+sig.args+`) RETURNS `+sig.ret+` LANGUAGE plpgsql AS
			$$BEGIN RAISE EXCEPTION 'evilschema.`+sig.name+` ran as %', current_user; END$$`)
	}
	for _, op := range []struct{ name, l, r, ret string }{
		{"=", "text", "text", "boolean"}, {"=", "bigint", "bigint", "boolean"}, {"=", "bytea", "bytea", "boolean"},
		{"<>", "bytea", "bytea", "boolean"}, {"<", "timestamptz", "timestamptz", "boolean"},
		{"<=", "timestamptz", "timestamptz", "boolean"}, {">", "timestamptz", "timestamptz", "boolean"},
		{">=", "timestamptz", "timestamptz", "boolean"}, {"+", "timestamptz", "interval", "timestamptz"},
		{"-", "timestamptz", "timestamptz", "interval"}, {"||", "text", "text", "text"}, {"||", "bytea", "bytea", "bytea"},
		{"+", "bigint", "bigint", "bigint"}, {"+", "integer", "integer", "integer"}, {"<", "integer", "integer", "boolean"},
		{"=", "integer", "integer", "boolean"}, {"->>", "jsonb", "text", "text"}, {"<>", "text", "text", "boolean"},
	} {
		fn := fmt.Sprintf("evilschema_op_%d", len(op.l)*100+len(op.r)*10+len(op.name))
		fn = fmt.Sprintf("%s_%x", fn, []byte(op.name+op.l+op.r))
		pgtest.Exec(t, c, `CREATE FUNCTION evilschema.`+fn+`(`+op.l+`, `+op.r+`) RETURNS `+op.ret+` LANGUAGE plpgsql AS
			$$BEGIN RAISE EXCEPTION 'evilschema operator `+op.name+`(`+op.l+`, `+op.r+`) ran as %', current_user; END$$;
			CREATE OPERATOR evilschema.`+op.name+` (LEFTARG = `+op.l+`, RIGHTARG = `+op.r+`, FUNCTION = evilschema.`+fn+`)`)
	}
	pgtest.Exec(t, admin, `ALTER ROLE `+app+` SET search_path = evilschema, pg_catalog, public`)
	pgtest.Exec(t, admin, `ALTER ROLE `+roleOf(t, opsURL)+` SET search_path = evilschema, pg_catalog, public`)
	pgtest.Exec(t, admin, `GRANT USAGE ON SCHEMA evilschema TO `+roleOf(t, opsURL))

	a := pgtest.Connect(t, appURL)
	o := pgtest.Connect(t, opsURL)
	var sp string
	if err := a.QueryRow(ctx, `SHOW search_path`).Scan(&sp); err != nil || !strings.HasPrefix(sp, "evilschema") {
		t.Fatalf("the app role's search_path: %q %v", sp, err)
	}
	// The role's own operator is the one its own statements use: the shadowing works.
	if _, err := a.Exec(ctx, `SELECT 'a'::text = 'b'::text`); err == nil || !strings.Contains(err.Error(), "evilschema") {
		t.Fatalf("the hostile operator is not in effect for the role's own statements: %v", err)
	}
	fp := `pg_catalog.sha256(pg_catalog.convert_to('x', 'UTF8'))`
	steps := []struct {
		conn *pgx.Conn
		sql  string
	}{
		{a, `SELECT * FROM idem.idem_defaults()`},
		{a, `SELECT * FROM idem.idem_version()`},
		{a, `SELECT idem.idem_serves_version(1)`},
		{a, `BEGIN`},
		{a, `SELECT pg_catalog.set_config('roles.attempt', b.attempt::text, false) FROM idem.idem_begin(p_principal => 'p', p_key => 'tx',
			p_action => 'POST /x', p_request_sha256 => ` + fp + `,
			p_request_fields => '{"a":"0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"}') AS b`},
		{a, `SELECT idem.idem_complete(p_principal => 'p', p_key => 'tx', p_attempt => pg_catalog.current_setting('roles.attempt')::bigint,
			p_status => 201, p_headers => '{"Content-Type":"application/json"}', p_body => '\x7b7d')`},
		{a, `ROLLBACK`},
		{a, `BEGIN`},
		{a, `SELECT * FROM idem.idem_begin(p_principal => 'p', p_key => 'tx', p_action => 'POST /x', p_request_sha256 => ` + fp + `)`},
		{a, `SAVEPOINT s`},
		{a, `ROLLBACK TO SAVEPOINT s`},
		{a, `SELECT idem.idem_save_final(p_principal => 'p', p_key => 'tx', p_action => 'POST /x', p_request_sha256 => ` + fp + `,
			p_ttl => interval '1 hour', p_status => 422, p_headers => '{}', p_body => '\x7b7d')`},
		{a, `COMMIT`},
		{a, `SELECT * FROM idem.idem_begin(p_principal => 'p', p_key => 'tx', p_action => 'POST /x', p_request_sha256 => ` + fp + `)`},
		{a, `SELECT * FROM idem.idem_begin(p_principal => 'p', p_key => 'tx', p_action => 'POST /y', p_request_sha256 => ` + fp + `)`},
		{a, `SELECT * FROM idem.idem_begin_steps(p_principal => 'p', p_key => 'lease', p_action => 'POST /x', p_request_sha256 => ` + fp + `,
			p_lease => interval '1 minute')`},
		{a, `SELECT idem.idem_extend('p', 'lease', (SELECT k.attempt FROM idem.idem_key('p', 'lease') AS k), interval '2 minutes')`},
		{a, `SELECT idem.idem_step('p', 'lease', (SELECT k.attempt FROM idem.idem_key('p', 'lease') AS k), 'one', '{"id":1}')`},
		{a, `SELECT * FROM idem.idem_recovery('p', 'lease', (SELECT k.attempt FROM idem.idem_key('p', 'lease') AS k))`},
		{a, `SELECT idem.idem_yield('p', 'lease', (SELECT k.attempt FROM idem.idem_key('p', 'lease') AS k))`},
		{a, `SELECT * FROM idem.idem_begin(p_principal => 'p', p_key => 'lease', p_action => 'POST /x', p_request_sha256 => ` + fp + `,
			p_lease => interval '1 minute')`},
		{a, `SELECT idem.idem_release('p', 'lease', (SELECT k.attempt FROM idem.idem_key('p', 'lease') AS k))`},
		{a, `SELECT * FROM idem.idem_begin(p_principal => 'p', p_key => 'stuck', p_action => 'POST /x', p_request_sha256 => ` + fp + `,
			p_lease => interval '1 minute')`},
		{a, `SELECT idem.idem_cleanup(100)`},
		{a, `SELECT * FROM idem.idem_health()`},
		{a, `SELECT * FROM idem.idem_replication()`},
		{a, `SELECT * FROM idem.idem_summary()`},
		{a, `SELECT * FROM idem.idem_summary(true)`},
		{a, `SELECT * FROM idem.idem_key('p', 'tx')`},
		{o, `SELECT * FROM idem.idem_stuck()`},
		{o, `SELECT idem.idem_key_body('p', 'tx')`},
		{o, `SELECT * FROM idem.idem_summary()`},
		{o, `SELECT * FROM idem.idem_health()`},
		{o, `SELECT idem.idem_release_stuck('p', 'stuck', (SELECT k.attempt FROM idem.idem_key('p', 'stuck') AS k), 'roles')`},
		// A procedure that commits has no SET clause: it names its operators and functions
		// with their schema (it ran the role's own + and < before).
		{a, `CALL idem.idem_cleanup_all(10)`},
	}
	for _, s := range steps {
		if _, err := s.conn.Exec(ctx, s.sql); err != nil {
			who := "app"
			if s.conn == o {
				who = "operator"
			}
			t.Errorf("as the %s role with a hostile search_path: %s\n  -> %v", who, strings.Join(strings.Fields(s.sql), " "), err)
			if s.conn == a {
				_, _ = a.Exec(ctx, `ROLLBACK`)
			}
		}
	}
	// Its refusal of a bad batch size is its own (it called the role's better-matching
	// format(text, integer)).
	if _, err := a.Exec(ctx, `CALL idem.idem_cleanup_all(0)`); err == nil || !strings.Contains(err.Error(), "p_batch_size must be at least 1") {
		t.Errorf("idem_cleanup_all(0) as the app role with a hostile search_path: %v; want its own 22023", err)
	}
}

// TestRolesEveryEntryPointAsDocumented: docs/sql-api.md (the roles): "A database owner without superuser
// installs the API ... the application logs in as a member of idem_app and never needs more";
// docs/operations.md "Who may do what" and "Cleanup" (REVOKE CONNECT ... FROM PUBLIC, then grant
// it to the login roles). Schema idem installed by an owner that is no superuser; PUBLIC keeps
// neither CONNECT nor TEMP on the database; the service's login role is a member of idem_app
// with CONNECT, the operator's of idem_operator with CONNECT. Then the middleware (a
// transactional route, its replay and a final 422; a lease route with a step), Do, DoLease,
// Begin/Complete, SaveFinal, Release, Yield, Extend, the cleaner's pass and Cleanup, the health,
// summary and story as the application; the stuck list, the story and the release as the
// operator; and the metrics' HealthCollector. Passes; pins the whole set of entry points under
// the documented least privilege with a non-superuser owner.
func TestRolesEveryEntryPointAsDocumented(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.NewEmptyDB(t)
	ownerURL := pgtest.OwnerRole(t, db)
	owner := pgtest.Connect(t, ownerURL)
	if err := idemmigrate.Migrate(ctx, owner, idemmigrate.Options{}); err != nil {
		t.Fatalf("migrate as an owner without superuser: %v", err)
	}
	admin := pgtest.Connect(t, db)
	var dbname string
	if err := admin.QueryRow(ctx, `SELECT current_database()`).Scan(&dbname); err != nil {
		t.Fatal(err)
	}
	appURL := pgtest.LoginRole(t, db, "idem_app")
	opsURL := pgtest.LoginRole(t, db, "idem_operator")
	pgtest.Exec(t, admin, fmt.Sprintf(`REVOKE CONNECT, TEMP ON DATABASE %s FROM PUBLIC;
		GRANT CONNECT ON DATABASE %[1]s TO %s, %s`, dbname, roleOf(t, appURL), roleOf(t, opsURL)))
	t.Cleanup(func() {
		c, err := pgx.Connect(context.Background(), db)
		if err == nil {
			_, _ = c.Exec(context.Background(), fmt.Sprintf(`REVOKE ALL ON DATABASE %s FROM %s, %s`, dbname, roleOf(t, appURL), roleOf(t, opsURL)))
			c.Close(context.Background())
		}
	})
	app := newPool(t, appURL)
	ops := newPool(t, opsURL)
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))

	// The middleware.
	m, err := idem.New(ctx, idem.Options{DB: app, Principal: alice, Logger: quiet})
	if err != nil {
		t.Fatalf("New as the application: %v", err)
	}
	mux := http.NewServeMux()
	mux.Handle("POST /tx", m.Route(idem.Route{Required: true})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var n int
		if err := idem.TxFrom(r.Context()).QueryRow(r.Context(), `SELECT 1`).Scan(&n); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte(`{"ok":true}`))
	})))
	mux.Handle("POST /final", m.Route(idem.Route{Required: true})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(422)
		_, _ = w.Write([]byte(`{"no":true}`))
	})))
	mux.Handle("POST /lease", m.Route(idem.Route{Required: true, Lease: 5 * time.Second})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		v, err := idem.Step(r.Context(), "one", func(ctx context.Context, tx pgx.Tx) (int, error) { return 41, nil })
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusCreated)
		_, _ = fmt.Fprintf(w, `{"v":%d}`, v)
	})))
	srv := httptest.NewServer(mux)
	defer srv.Close()
	for _, c := range []struct {
		path string
		want int
	}{{"/tx", 201}, {"/final", 422}, {"/lease", 201}} {
		for i := 0; i < 2; i++ {
			st, h, body := pgtest.Send(t, ctx, "POST", srv.URL+c.path, `{}`, "Idempotency-Key", "k"+c.path)
			if st != c.want || (i == 1) != (h.Get("Idempotent-Replayed") == "true") {
				t.Errorf("%s as the application, try %d: %d %v %s", c.path, i, st, h, body)
			}
		}
	}

	// Do, DoLease.
	if v, _, err := idem.Do(ctx, app, idem.Job{Principal: "p", Key: "do", Action: "a"}, idem.TxOptions{},
		func(context.Context, pgx.Tx) (int, error) { return 3, nil }); err != nil || v != 3 {
		t.Errorf("Do as the application: %d %v", v, err)
	}
	if v, _, err := idem.DoLease(ctx, app, idem.Job{Principal: "p", Key: "dolease", Action: "a", Lease: 5 * time.Second},
		func(ctx context.Context, c idem.LeaseClaim) (int, error) {
			return idem.Step(ctx, "s", func(ctx context.Context, tx pgx.Tx) (int, error) { return 4, nil })
		}); err != nil || v != 4 {
		t.Errorf("DoLease as the application: %d %v", v, err)
	}

	// Begin, Complete, SaveFinal, Release, Yield, Extend.
	fp := idem.ComputeFingerprint("POST", "/b", []byte(`{}`)).Sum
	if err := pgx.BeginFunc(ctx, app, func(tx pgx.Tx) error {
		d, err := idem.Begin(ctx, tx, idem.Claim{Principal: "p", Key: "b1", Action: "POST /b", Fingerprint: fp})
		if err != nil {
			return err
		}
		return idem.Complete(ctx, tx, "p", "b1", d.Attempt, idem.Response{Status: 201, Body: []byte(`{}`)})
	}); err != nil {
		t.Errorf("Begin and Complete as the application: %v", err)
	}
	if err := pgx.BeginFunc(ctx, app, func(tx pgx.Tx) error {
		_, err := idem.SaveFinal(ctx, tx, idem.Claim{Principal: "p", Key: "b2", Action: "POST /b", Fingerprint: fp},
			idem.Response{Status: 422, Body: []byte(`{}`)})
		return err
	}); err != nil {
		t.Errorf("SaveFinal as the application: %v", err)
	}
	lease := func(key string) idem.Decision {
		d, err := idem.Begin(ctx, app, idem.Claim{Principal: "p", Key: key, Action: "POST /b", Fingerprint: fp, Lease: time.Minute})
		if err != nil || d.Outcome != idem.Claimed {
			t.Fatalf("a lease claim as the application: %+v %v", d, err)
		}
		return d
	}
	d := lease("l1")
	if _, err := idem.Extend(ctx, app, "p", "l1", d.Attempt, 2*time.Minute); err != nil {
		t.Errorf("Extend as the application: %v", err)
	}
	if err := idem.RecordStep(ctx, app, "p", "l1", d.Attempt, "s1", nil); err != nil {
		t.Errorf("RecordStep as the application: %v", err)
	}
	if ok, err := idem.Yield(ctx, app, "p", "l1", d.Attempt); err != nil || !ok {
		t.Errorf("Yield as the application: %v %v", ok, err)
	}
	d = lease("l2")
	if ok, err := idem.Release(ctx, app, "p", "l2", d.Attempt); err != nil || !ok {
		t.Errorf("Release as the application: %v %v", ok, err)
	}

	// Cleanup.
	pgtest.InsertExpired(t, owner, "p", 30)
	c, err := idem.NewCleaner(app, idem.CleanerOptions{BatchSize: 10, Duty: 1, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	if n, ran, err := c.Pass(ctx); err != nil || !ran || n != 30 {
		t.Errorf("a cleaner's pass as the application: %d %v %v", n, ran, err)
	}
	pgtest.InsertExpired(t, owner, "p", 5)
	if n, err := idem.Cleanup(ctx, app, 10); err != nil || n != 5 {
		t.Errorf("Cleanup as the application: %d %v", n, err)
	}

	// The operators' reads as both roles, and the operator's release.
	for name, q := range map[string]idem.Querier{"application": app, "operator": ops} {
		if _, err := idem.ReadHealth(ctx, q); err != nil {
			t.Errorf("ReadHealth as the %s: %v", name, err)
		}
		if _, err := idem.ReadSummary(ctx, q, true); err != nil {
			t.Errorf("ReadSummary as the %s: %v", name, err)
		}
		if _, ok, err := idem.ReadKey(ctx, q, "p", "b1"); err != nil || !ok {
			t.Errorf("ReadKey as the %s: %v %v", name, ok, err)
		}
		if err := idem.CheckSchema(ctx, q); err != nil {
			t.Errorf("CheckSchema as the %s: %v", name, err)
		}
	}
	d = lease("l3")
	stuck, err := idem.ReadStuck(ctx, ops, 0, 10)
	if err != nil || len(stuck) != 1 {
		t.Errorf("ReadStuck as the operator: %+v %v", stuck, err)
	}
	if err := idem.ReleaseStuck(ctx, ops, "p", "l3", d.Attempt, "roles"); err != nil {
		t.Errorf("ReleaseStuck as the operator: %v", err)
	}
	if _, err := idem.ReadStuck(ctx, app, 0, 10); !errors.Is(err, idem.ErrPermissionDenied) {
		t.Errorf("ReadStuck as the application: %v, want ErrPermissionDenied", err)
	}

	// The key gauges.
	reg := prometheus.NewRegistry()
	reg.MustRegister(idemprom.NewHealthCollector(app, time.Second, quiet))
	mfs, err := reg.Gather()
	if err != nil || len(mfs) == 0 {
		t.Errorf("the HealthCollector as the application: %d families, %v", len(mfs), err)
	}
}

package main

// Findings of an adversarial review of the reference server's operations, each a test that
// failed before its fix.

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestCleanupCommandWaitsForTheLock: `server cleanup` is one full pass. When another
// process's batch holds the cleanup lock (a running server's scheduled cleaner, or an operator
// pausing the cleaners), the command's batches wait for it and then delete every expired key.
// Before, the pass was skipped, and the command printed "deleted 0 expired keys" and exited 0
// with every expired key still there.
func TestCleanupCommandWaitsForTheLock(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	ctx := context.Background()
	id, _ := s.principal("expired")
	pgtest.InsertExpired(t, s.pool, id, 50)
	holder, err := s.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// docs/operations.md's statement that pauses every cleaner, with its decimal literal.
	if _, err := holder.Exec(ctx, `SELECT pg_advisory_xact_lock(29665259344325742)`); err != nil {
		t.Fatal(err)
	}
	if strconv.FormatInt(idem.CleanupLock, 10) != "29665259344325742" {
		t.Fatalf("idem.CleanupLock is %d, docs/operations.md says 29665259344325742", idem.CleanupLock)
	}
	const hold = 400 * time.Millisecond
	released := make(chan struct{})
	go func() {
		defer close(released)
		time.Sleep(hold)
		_ = holder.Rollback(ctx)
	}()
	defer func() { <-released }()
	var out bytes.Buffer
	c := NewMain(&out, io.Discard)
	if err := c.ParseFlags([]string{"cleanup"}, serverEnv(s.db, nil)); err != nil {
		t.Fatal(err)
	}
	began := time.Now()
	err = c.Run(ctx)
	took := time.Since(began)
	_ = c.Close()
	left := s.count(`SELECT count(*) FROM idem.idempotency_keys WHERE principal_id = $1`, id)
	if err != nil || left != 0 || !strings.HasPrefix(out.String(), "deleted 50 expired keys") {
		t.Fatalf("server cleanup while the lock was held: %v, printed %q, %d expired keys left; want all 50 deleted", err, out.String(), left)
	}
	if took < hold/2 {
		t.Fatalf("server cleanup ended after %v, before the lock's holder (%v): it did not wait", took, hold)
	}
}

// TestPrincipalNameCountsCharacters: `principal create NAME` takes 1 to 100 characters, as
// the ledger's table and the API do; it counted bytes, and refused a 60-character name in a
// script of two bytes a character. Invalid UTF-8 and control characters are refused.
func TestPrincipalNameCountsCharacters(t *testing.T) {
	for name, ok := range map[string]bool{
		strings.Repeat("é", 100): true, strings.Repeat("é", 101): false, strings.Repeat("a", 100): true,
		"": false, "a\x00b": false, "a\nb": false, "\xff": false,
	} {
		m := NewMain(io.Discard, io.Discard)
		err := m.ParseFlags([]string{"principal", "create", name}, func(string) string { return "" })
		if (err == nil) != ok {
			t.Errorf("principal create %q: %v, want accepted %v", name, err, ok)
		}
	}
}

// TestStartCheckCatchesTheseToo: a bad value stops the start with a message that names the
// variable, before the database is opened. A LISTEN_ADDR whose port cannot exist was found
// only by net.Listen, after the private cluster was created and migrated; a blank
// DATABASE_URL was taken as set (pgx's defaults, not the private cluster) and a blank
// IDEM_DATA_DIR named a directory of spaces. LOG_LEVEL takes the four documented names, in any
// case and with spaces around them, and nothing else.
func TestStartCheckCatchesTheseToo(t *testing.T) {
	for _, tc := range []struct{ name, value, want string }{
		{"LISTEN_ADDR", "127.0.0.1:99999", "LISTEN_ADDR"},
		{"LISTEN_ADDR", "127.0.0.1:http-alt-nope", "LISTEN_ADDR"},
		{"LISTEN_ADDR", "127.0.0.1:-1", "LISTEN_ADDR"},
		{"LOG_LEVEL", "info+2", "LOG_LEVEL"}, // slog's offsets: not one of the documented four
		{"LOG_LEVEL", "warning", "LOG_LEVEL"},
	} {
		m := NewMain(io.Discard, io.Discard)
		err := m.ParseFlags(nil, func(k string) string {
			if k == tc.name {
				return tc.value
			}
			return ""
		})
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s=%q: %v, want an error naming %s", tc.name, tc.value, err, tc.want)
		}
	}
	for _, tc := range []struct{ name, value string }{{"DATABASE_URL", "   "}, {"IDEM_DATA_DIR", " \t "}, {"LISTEN_ADDR", " 127.0.0.1:0 "}, {"LOG_LEVEL", " Warn "}} {
		m := NewMain(io.Discard, io.Discard)
		if err := m.ParseFlags(nil, func(k string) string {
			if k == tc.name {
				return tc.value
			}
			return ""
		}); err != nil {
			t.Fatalf("%s=%q: %v", tc.name, tc.value, err)
		}
		d := defaultConfig()
		switch {
		case tc.name == "DATABASE_URL" && m.Config.DatabaseURL != "":
			t.Errorf("DATABASE_URL=%q is taken as set (%q), want the private cluster", tc.value, m.Config.DatabaseURL)
		case tc.name == "IDEM_DATA_DIR" && m.Config.DataDir != d.DataDir:
			t.Errorf("IDEM_DATA_DIR=%q gives the directory %q, want the default %q", tc.value, m.Config.DataDir, d.DataDir)
		case tc.name == "LISTEN_ADDR" && m.Config.ListenAddr != "127.0.0.1:0":
			t.Errorf("LISTEN_ADDR=%q gives %q", tc.value, m.Config.ListenAddr)
		case tc.name == "LOG_LEVEL" && m.Config.LogLevel != slog.LevelWarn:
			t.Errorf("LOG_LEVEL=%q gives %v", tc.value, m.Config.LogLevel)
		}
	}
}

// TestMigrateGrantsAnotherAppRole (D152): IDEM_APP_ROLE is the role `migrate` grants the SQL
// API and the ledger to. On a database migrated before under idem_app, a migrate with another
// role gave it only the functions' EXECUTE (the install runs every time; the migrations that
// grant the schemas and the ledger's tables ran once), so a server logging in as a member of
// it could not start. Now it gets what idem_app has, privilege for privilege; a role that does
// not exist yet is created, as on a first install.
func TestMigrateGrantsAnotherAppRole(t *testing.T) {
	t.Parallel()
	db := pgtest.NewEmptyDB(t)
	admin := pgtest.Connect(t, db)
	migrate := func(role string) {
		t.Helper()
		m := NewMain(io.Discard, io.Discard)
		env := map[string]string{}
		if role != "" {
			env["IDEM_APP_ROLE"] = role
		}
		if err := m.ParseFlags([]string{"migrate"}, serverEnv(db, env)); err != nil {
			t.Fatal(err)
		}
		err := m.Run(context.Background())
		_ = m.Close()
		if err != nil {
			t.Fatalf("migrate with IDEM_APP_ROLE=%q: %v", role, err)
		}
	}
	migrate("")
	for _, role := range []string{"review_app_b", "review_app_c"} {
		t.Cleanup(func() {
			c := pgtest.Connect(t, db)
			_, _ = c.Exec(context.Background(), `DROP OWNED BY `+role+`; DROP ROLE IF EXISTS `+role)
		})
	}
	pgtest.Exec(t, admin, `DROP ROLE IF EXISTS review_app_c; DROP ROLE IF EXISTS review_app_b; CREATE ROLE review_app_b NOLOGIN`)
	for _, role := range []string{"review_app_b", "review_app_c"} { // c does not exist before its migrate
		migrate(role)
		rows, err := admin.Query(context.Background(), `
			SELECT what, mine, theirs FROM (
			  SELECT c.oid::regclass::text || ' ' || p.priv AS what,
			         CASE WHEN c.relkind = 'S' THEN has_sequence_privilege($1, c.oid, 'USAGE') ELSE has_table_privilege($1, c.oid, p.priv) END AS mine,
			         CASE WHEN c.relkind = 'S' THEN has_sequence_privilege('idem_app', c.oid, 'USAGE') ELSE has_table_privilege('idem_app', c.oid, p.priv) END AS theirs
			    FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace
			   CROSS JOIN unnest(ARRAY['SELECT', 'INSERT', 'UPDATE', 'DELETE']) AS p(priv)
			   WHERE n.nspname IN ('idem', 'ledger', 'provider', 'river') AND c.relkind IN ('r', 'p', 'v', 'S')
			  UNION ALL
			  SELECT 'schema ' || n.nspname, has_schema_privilege($1, n.oid, 'USAGE'), has_schema_privilege('idem_app', n.oid, 'USAGE')
			    FROM pg_namespace AS n WHERE n.nspname IN ('idem', 'ledger', 'provider', 'river')
			  UNION ALL
			  SELECT p.oid::regprocedure::text, has_function_privilege($1, p.oid, 'EXECUTE'), has_function_privilege('idem_app', p.oid, 'EXECUTE')
			    FROM pg_proc AS p WHERE p.pronamespace = 'idem'::regnamespace) AS x
			 WHERE mine IS DISTINCT FROM theirs`, role)
		if err != nil {
			t.Fatal(err)
		}
		var diff []string
		for rows.Next() {
			var what string
			var mine, theirs bool
			if err := rows.Scan(&what, &mine, &theirs); err != nil {
				t.Fatal(err)
			}
			diff = append(diff, fmt.Sprintf("%s: %v (idem_app %v)", what, mine, theirs))
		}
		if err := rows.Err(); err != nil {
			t.Fatal(err)
		}
		if len(diff) > 0 {
			t.Fatalf("after migrate with IDEM_APP_ROLE=%s its privileges differ from idem_app's:\n%s", role, strings.Join(diff, "\n"))
		}
		var out bytes.Buffer
		m := NewMain(&out, io.Discard)
		if err := m.ParseFlags([]string{"principal", "create", "x"}, serverEnv(pgtest.LoginRole(t, db, role), nil)); err != nil {
			t.Fatal(err)
		}
		err = m.Run(context.Background())
		_ = m.Close()
		if err != nil || !strings.HasPrefix(out.String(), "principal ") {
			t.Fatalf("principal create as a member of %s: %v %q", role, err, out.String())
		}
	}
}

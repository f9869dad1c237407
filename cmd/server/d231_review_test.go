package main

// A review of D231/D232 (helper session): the reference server's connection settings. It found
// the start's pooler probe sent in pgx's simple protocol, which pgx refuses under
// standard_conforming_strings off (serve and migrate failed on such a database), and a DateStyle
// named in DATABASE_URL's options replaced by ISO; both fixed.

import (
	"context"
	"fmt"
	"io"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/internal/pgtest"
)

// d231With adds a parameter to a connection string in either form.
func d231With(connStr, key, value string) string {
	if u, err := url.Parse(connStr); err == nil && (u.Scheme == "postgres" || u.Scheme == "postgresql") {
		q := u.Query()
		q.Set(key, value)
		u.RawQuery = q.Encode()
		return u.String()
	}
	return connStr + " " + key + "='" + value + "'"
}

// d231Migrated is a database migrated by `server migrate`, and its name.
func d231Migrated(t *testing.T) (db, name string) {
	t.Helper()
	db = pgtest.NewEmptyDB(t)
	mig := NewMain(io.Discard, io.Discard)
	if err := mig.ParseFlags([]string{"migrate"}, serverEnv(db, nil)); err != nil {
		t.Fatal(err)
	}
	if err := mig.Run(context.Background()); err != nil {
		t.Fatalf("migrate: %v", err)
	}
	_ = mig.Close()
	if err := pgtest.Connect(t, db).QueryRow(context.Background(), `SELECT current_database()`).Scan(&name); err != nil {
		t.Fatal(err)
	}
	return db, name
}

// d231Serve starts the server like serveWith, but returns serve's error instead of failing
// the test when it does not start.
func d231Serve(t *testing.T, db string, env map[string]string) (*testServer, error) {
	t.Helper()
	m := NewMain(io.Discard, io.Discard)
	if err := m.ParseFlags(nil, serverEnv(db, env)); err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- m.Run(ctx) }()
	var addr string
	select {
	case addr = <-m.Addr:
	case err := <-done:
		cancel()
		_ = m.Close()
		return nil, err
	case <-time.After(60 * time.Second):
		cancel()
		return nil, fmt.Errorf("serve did not start in 60 s")
	}
	var once sync.Once
	shutdown := func() error {
		var err error
		once.Do(func() {
			cancel()
			err = <-done
			_ = m.Close()
		})
		return err
	}
	t.Cleanup(func() { _ = shutdown() })
	return &testServer{t: t, url: "http://" + addr, db: db, main: m, shutdown: shutdown}, nil
}

// d231Principal creates a principal directly in db.
func d231Principal(t *testing.T, db, name string) string {
	t.Helper()
	p, err := pgxpool.New(context.Background(), db)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	_, token, err := createPrincipal(context.Background(), p, name)
	if err != nil {
		t.Fatal(err)
	}
	return token
}

// d231AccountAndReplay creates an account under a key and repeats it: 201 and its replay.
func d231AccountAndReplay(t *testing.T, s *testServer, token string) {
	t.Helper()
	r := s.call("POST", "/v1/accounts", token, "acc-1", `{"name":"café","currency":"EUR"}`, "Content-Type", "application/json")
	again := s.call("POST", "/v1/accounts", token, "acc-1", `{"name":"café","currency":"EUR"}`, "Content-Type", "application/json")
	if r.status != 201 || again.status != 201 || again.body != r.body || again.header.Get("Idempotent-Replayed") != "true" {
		t.Errorf("an account and its replay: %d %s / %d %s (replayed %q); want 201 and its replay",
			r.status, r.body, again.status, again.body, again.header.Get("Idempotent-Replayed"))
	}
}

// TestServerStartsOnADatabaseWithoutStandardConformingStrings: D231 lists
// standard_conforming_strings = off among the legacy settings a database may carry ("any role
// may SET them, and ALTER ROLE or ALTER DATABASE gives them to every session") and makes the SQL
// API read the same under it; docs/operations.md says pgx needs it on "for pgx's simple protocol
// only ... prefer default_query_exec_mode=exec", i.e. not in pgx's default mode. The reference
// server with a plain DATABASE_URL (pgx's default mode, no pooler) on such a database should
// start and serve.
func TestServerStartsOnADatabaseWithoutStandardConformingStrings(t *testing.T) {
	t.Parallel()
	db, name := d231Migrated(t)
	pgtest.Exec(t, pgtest.Connect(t, db), `ALTER DATABASE "`+name+`" SET standard_conforming_strings = off`)
	s, err := d231Serve(t, db, nil)
	if err != nil {
		t.Fatalf("serve with a plain DATABASE_URL on a database with standard_conforming_strings = off: %v; want it to start", err)
	}
	d231AccountAndReplay(t, s, d231Principal(t, db, "scs"))
}

// TestServerMigrateOnADatabaseWithoutStandardConformingStrings: the same for
// `server migrate` (docs/sql-api.md "Installing": server migrate installs the SQL API and the
// ledger), into a fresh database that a DBA set up for a legacy application.
func TestServerMigrateOnADatabaseWithoutStandardConformingStrings(t *testing.T) {
	t.Parallel()
	db := pgtest.NewEmptyDB(t)
	admin := pgtest.Connect(t, db)
	var name string
	if err := admin.QueryRow(context.Background(), `SELECT current_database()`).Scan(&name); err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, admin, `ALTER DATABASE "`+name+`" SET standard_conforming_strings = off`)
	// First with default_query_exec_mode=exec (no probe of the pooler), then as docs/sql-api.md
	// gives it: a plain DATABASE_URL.
	for _, url := range []string{d231With(db, "default_query_exec_mode", "exec"), db} {
		mig := NewMain(io.Discard, io.Discard)
		if err := mig.ParseFlags([]string{"migrate"}, serverEnv(db, map[string]string{"DATABASE_URL": url})); err != nil {
			t.Fatal(err)
		}
		err := mig.Run(context.Background())
		_ = mig.Close()
		if err != nil {
			t.Errorf("server migrate (DATABASE_URL %s) into a database with standard_conforming_strings = off: %v; want it installed", url, err)
		}
	}
}

// TestServerBehindPgBouncerOnALegacyDatabase: the server through PgBouncer (the form
// docs/operations.md "Behind PgBouncer" gives) on a database set to a legacy application's
// DateStyle, bytea_output, IntervalStyle, TimeZone and client_encoding: its startup parameters
// (DateStyle, client_encoding) go through PgBouncer, and it serves and replays (operations.md:
// "a role or database with a legacy DateStyle or bytea_output = 'escape' replays alike; the
// reference server also asks for the ISO DateStyle when it connects (a startup parameter
// PgBouncer passes on)").
func TestServerBehindPgBouncerOnALegacyDatabase(t *testing.T) {
	t.Parallel()
	bb := behindPgBouncer(t)
	admin := pgtest.Connect(t, bb.db)
	var name string
	if err := admin.QueryRow(context.Background(), `SELECT current_database()`).Scan(&name); err != nil {
		t.Fatal(err)
	}
	for _, set := range []string{"DateStyle = 'SQL, DMY'", "bytea_output = 'escape'", "IntervalStyle = 'sql_standard'",
		"TimeZone = 'Asia/Kathmandu'", "client_encoding = 'LATIN1'"} {
		pgtest.Exec(t, admin, `ALTER DATABASE "`+name+`" SET `+set)
	}
	for _, c := range []struct{ name, url string }{
		{"documented", bb.via},
		{"detected", strings.Replace(bb.via, "&default_query_exec_mode=exec", "", 1)},
	} {
		t.Run(c.name, func(t *testing.T) {
			s, err := d231Serve(t, bb.db, map[string]string{"DATABASE_URL": c.url})
			if err != nil {
				t.Fatalf("serve through PgBouncer (%s): %v", c.url, err)
			}
			token := d231Principal(t, bb.db, "bounced-"+c.name)
			d231AccountAndReplay(t, s, token)
			var style, enc string
			if err := s.main.pool.QueryRow(context.Background(), `SELECT current_setting('DateStyle'), current_setting('client_encoding')`).Scan(&style, &enc); err != nil {
				t.Fatal(err)
			}
			if style != "ISO, MDY" || enc != "UTF8" {
				t.Errorf("the server's sessions through PgBouncer: DateStyle %q, client_encoding %q; want ISO, MDY and UTF8", style, enc)
			}
		})
	}
}

// TestServerKeepsTheDateStyleDatabaseURLNames: docs/operations.md "Behind PgBouncer": the
// reference server asks for the ISO DateStyle when it connects "unless DATABASE_URL names one"
// (cmd/server/database.go: "unless DATABASE_URL names a DateStyle itself"). Named as a
// parameter, and as libpq's options=-c DateStyle=... (which pgx passes on as the startup
// parameter "options").
func TestServerKeepsTheDateStyleDatabaseURLNames(t *testing.T) {
	t.Parallel()
	db, _ := d231Migrated(t)
	for _, c := range []struct{ name, url string }{
		{"parameter", d231With(db, "DateStyle", "German, DMY")},
		{"options", d231With(db, "options", "-c DateStyle=German,DMY")},
	} {
		t.Run(c.name, func(t *testing.T) {
			s, err := d231Serve(t, db, map[string]string{"DATABASE_URL": c.url})
			if err != nil {
				t.Fatalf("serve: %v", err)
			}
			var style string
			if err := s.main.pool.QueryRow(context.Background(), `SHOW DateStyle`).Scan(&style); err != nil {
				t.Fatal(err)
			}
			if style != "German, DMY" {
				t.Errorf("DATABASE_URL %q: the server's sessions have DateStyle %q; want the one it names, German, DMY", c.url, style)
			}
		})
	}
}

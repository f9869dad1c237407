// Package idemtest gives the tests of a service that uses package idem a real PostgreSQL with
// schema idem installed, a fresh database per test, found as this project's own tests find
// theirs. The decisions are PL/pgSQL functions, so there is no in-memory stand-in: a test
// runs against the database that production runs against (a clone of a migrated template
// costs tens of milliseconds).
//
//	func TestMain(m *testing.M) { os.Exit(idemtest.Main(m)) }
//
//	func TestOrders(t *testing.T) {
//		pool := idemtest.NewPool(t)                 // migrated, as its owner
//		app := idemtest.AppPool(t, pool)            // the same database as a member of idem_app
//		m, err := idem.New(context.Background(), idem.Options{DB: app, Principal: userOf})
//		...
//	}
//
// The server is found in this order:
//
//  1. TEST_DATABASE_URL: an existing server; its role must be allowed to create databases and
//     roles;
//  2. a PostgreSQL container (testcontainers-go, postgres:15), when a Docker engine answers
//     (PGTEST_NO_DOCKER=1 skips this step);
//  3. a private throwaway cluster from the local PostgreSQL server binaries (initdb and
//     pg_ctl in PG_BINDIR, else on the PATH, else in the newest /usr/lib/postgresql/N/bin;
//     as root, run as the postgres user), removed when the tests end.
//
// When none can be had, the test fails with a message that says what failed and what to do
// (a server that does not answer, a container that did not start: PGTEST_NO_DOCKER=1 goes on
// to the local binaries; no binaries: how to get them); it never skips.
//
// It imports testcontainers-go (and with it a Docker client): a service's go.mod gains those
// modules when its tests import this package; its binaries do not link them.
package idemtest

import (
	"context"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/internal/pgtest"
)

// Main runs a package's tests and then stops the server it started, if any. Call it from
// TestMain: func TestMain(m *testing.M) { os.Exit(idemtest.Main(m)) }.
func Main(m *testing.M) int { return pgtest.Main(m) }

// NewDB creates a database for this test with schema idem installed (at this module's
// version), drops it when the test ends, and returns its connection string, as the role that
// owns schema idem (TEST_DATABASE_URL's role, or a superuser). Each database is an
// installation of its own, with its own installation secret, as a database of its own is in
// production: the same principal, key and generation get other provider keys in each (the
// databases are copies of one template, which a copy's CALL idem.idem_new_installation_secret()
// makes distinct), so tests that share a fake provider do not see each other's keys.
func NewDB(t testing.TB) string {
	t.Helper()
	url := pgtest.NewDB(t)
	if err := ownInstallation(url); err != nil {
		t.Fatalf("idemtest: %v", err)
	}
	return url
}

// ownInstallation gives the database url names a secret of its own (it was cloned from the
// migrated template, with the template's).
func ownInstallation(url string) error {
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, `CALL idem.idem_new_installation_secret()`); err != nil {
		return fmt.Errorf("a secret of its own for the test's database: %w", err)
	}
	return nil
}

// NewEmptyDB creates an empty database for this test (no schema idem: for tests of a migrate
// step), drops it when the test ends, and returns its connection string as the role that
// created and owns it: TEST_DATABASE_URL's role, or the superuser of the container or cluster
// this package started. For a migrate step run as a plain owner, as in production, pass the
// string to OwnerURL.
func NewEmptyDB(t testing.TB) string {
	t.Helper()
	return pgtest.NewEmptyDB(t)
}

// NewPool creates a database with NewDB and returns a pool on it (at most 8 connections, as
// the owner), closed when the test ends. pool.Config().ConnString() is the owner's connection
// string (for AppURL, or a migrate step of the service's own tables).
func NewPool(t testing.TB) *pgxpool.Pool {
	t.Helper()
	pool, url := pgtest.NewPool(t, 8)
	if err := ownInstallation(url); err != nil {
		t.Fatalf("idemtest: %v", err)
	}
	return pool
}

// AppURL returns the connection string of the database url names as a new login role that is
// only a member of the application role idem_app (what a service in production logs in as),
// dropped when the test ends. Grant it the privileges on the service's own tables as the
// service's migrate step grants its login role (not idem_app: that role holds the SQL API
// only, docs/http.md "Two roles"). The role's name is the URL's user (pgx.ParseConfig's User),
// or, on a pool, current_user. Grant what the service's statements use, the sequences of its
// serial columns too (nextval), or its inserts fail and the requests get 500:
//
//	var role string
//	if err := app.QueryRow(ctx, "SELECT current_user").Scan(&role); err != nil {
//		t.Fatal(err)
//	}
//	r := pgx.Identifier{role}.Sanitize()
//	if _, err := owner.Exec(ctx, "GRANT SELECT, INSERT ON orders TO "+r+"; GRANT USAGE ON SEQUENCE orders_id_seq TO "+r); err != nil {
//		t.Fatal(err)
//	}
func AppURL(t testing.TB, url string) string {
	t.Helper()
	return pgtest.LoginRole(t, url, "idem_app")
}

// OwnerURL returns the connection string of the database url names as a new login role that
// owns it and is nothing more (not a superuser, no CREATEDB, no CREATEROLE): the role a
// deployment runs its migrate step as, once a superuser made the roles idem_app and
// idem_operator (docs/sql-api.md, "Installing without a superuser"; both exist on the test
// server). The databases of NewDB and NewEmptyDB belong to the test server's own role, a
// superuser where this package started the server: test a migrate step as production runs it
// on NewEmptyDB's database through OwnerURL. The role is dropped when the test ends (what it
// owns goes back to the test server's role first).
func OwnerURL(t testing.TB, url string) string {
	t.Helper()
	return pgtest.OwnerRole(t, url)
}

// AppPool returns a pool on owner's database as a new login role that is only a member of
// idem_app (AppURL), closed when the test ends.
func AppPool(t testing.TB, owner *pgxpool.Pool) *pgxpool.Pool {
	t.Helper()
	pool, err := pgxpool.New(context.Background(), AppURL(t, owner.Config().ConnConfig.ConnString()))
	if err != nil {
		t.Fatalf("idemtest: %v", err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// ExampleDB creates a database with schema idem installed for an Example function (which has
// no testing.T) and returns its connection string; it is dropped when the test binary ends.
// Call it only from a package whose TestMain calls Main. Where no server can be had (or the
// database cannot be created) it panics, which ends the whole test binary with the reason: an
// Example has no testing.T to fail alone. A private cluster it started is stopped all the same.
func ExampleDB() string {
	url := pgtest.ExampleDB()
	if err := ownInstallation(url); err != nil {
		panic(fmt.Sprintf("idemtest: %v", err))
	}
	return url
}

package pgtest

import (
	"context"
	"fmt"
	"net/url"
	"os"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
)

var loginRoles atomic.Int64

// LoginRole creates a login role that is only a member of group (idem_app, idem_operator, or
// a role of the test's own): not the owner of anything, not a superuser, as docs/http.md
// recommends for a service; and returns the connection string of db as that role. The role is
// dropped when the test ends.
func LoginRole(t testing.TB, db, group string) string {
	t.Helper()
	owner := Connect(t, db)
	name := fmt.Sprintf("idem_login_%d_%d", os.Getpid(), loginRoles.Add(1))
	Exec(t, owner, fmt.Sprintf(`CREATE ROLE %s LOGIN PASSWORD 'app-secret' NOSUPERUSER NOCREATEDB NOCREATEROLE IN ROLE %s`, name, group))
	t.Cleanup(func() { dropRole(t, db, name, "") })
	return AsRole(t, db, name, "app-secret")
}

// DropRoleAtEnd drops the role name, which the test made on db's server (from a doc's block,
// say), when the test ends, with what it owns and the privileges granted to it; the test fails
// when it cannot.
func DropRoleAtEnd(t testing.TB, db, name string) {
	t.Helper()
	t.Cleanup(func() { dropRole(t, db, name, "") })
}

// dropRole drops a role the test made, first what it owns (reassigned to the test's role when
// reassign is set) and the privileges granted to it, and fails the test when it cannot: a
// login role with a known password must not stay on a shared server. A role that is not a
// superuser (CREATEROLE and CREATEDB, as TEST_DATABASE_URL's may be) may drop what another
// role owns only as a member of it: it makes itself one first.
func dropRole(t testing.TB, db, name, reassign string) {
	ctx := context.Background()
	c, err := pgx.Connect(ctx, db)
	if err != nil {
		// a server the test stopped (a failover's old primary) takes its roles with it
		t.Logf("pgtest: drop role %s: %v", name, err)
		return
	}
	defer c.Close(ctx)
	var super bool
	if err := c.QueryRow(ctx, `SELECT rolsuper FROM pg_roles WHERE rolname = current_user`).Scan(&super); err != nil {
		t.Errorf("pgtest: drop role %s: %v", name, err)
		return
	}
	stmts := []string{}
	if !super {
		stmts = append(stmts, `GRANT `+name+` TO current_user`)
	}
	if reassign != "" {
		stmts = append(stmts, `REASSIGN OWNED BY `+name+` TO `+reassign)
	}
	stmts = append(stmts, `DROP OWNED BY `+name, `DROP ROLE `+name)
	for _, stmt := range stmts {
		if _, err := c.Exec(ctx, stmt); err != nil {
			t.Errorf("pgtest: drop role %s: %s: %v", name, stmt, err)
			return
		}
	}
}

// AsRole returns the connection string of db as role with this password: db's own string,
// its other settings kept (TLS, connect_timeout, application_name), with the user and the
// password replaced.
func AsRole(t testing.TB, db, role, password string) string {
	t.Helper()
	if _, err := pgx.ParseConfig(db); err != nil {
		t.Fatal(err)
	}
	if strings.HasPrefix(db, "postgres://") || strings.HasPrefix(db, "postgresql://") {
		u, err := url.Parse(db)
		if err != nil {
			t.Fatal(err)
		}
		u.User = url.UserPassword(role, password)
		return u.String()
	}
	// Keyword/value: a keyword given again takes the last value.
	quote := func(v string) string { return "'" + strings.NewReplacer(`\`, `\\`, `'`, `\'`).Replace(v) + "'" }
	return db + " user=" + quote(role) + " password=" + quote(password)
}

// OwnerRole creates a login role that owns db and is nothing more (not a superuser, no
// CREATEROLE, no CREATEDB): the role a deployment runs its migrate step as, after a
// superuser made it (and the roles idem_app and idem_operator, which exist on the test
// server). It returns the connection string of db as that role; the role is dropped when the
// test ends (what it owns goes back to the test's role first).
func OwnerRole(t testing.TB, db string) string {
	t.Helper()
	admin := Connect(t, db)
	cfg, err := pgx.ParseConfig(db)
	if err != nil {
		t.Fatal(err)
	}
	name := fmt.Sprintf("idem_owner_%d_%d", os.Getpid(), loginRoles.Add(1))
	Exec(t, admin, fmt.Sprintf(`CREATE ROLE %s LOGIN PASSWORD 'app-secret' NOSUPERUSER NOCREATEDB NOCREATEROLE`, name))
	var super bool
	if err := admin.QueryRow(context.Background(), `SELECT rolsuper FROM pg_roles WHERE rolname = current_user`).Scan(&super); err != nil {
		t.Fatal(err)
	}
	if !super {
		// A role that may create roles but is no superuser (TEST_DATABASE_URL's may be) gives
		// a database away only to a role it is a member of.
		Exec(t, admin, `GRANT `+name+` TO current_user`)
	}
	Exec(t, admin, fmt.Sprintf(`ALTER DATABASE %s OWNER TO %s`, pgx.Identifier{cfg.Database}.Sanitize(), name))
	t.Cleanup(func() { dropRole(t, db, name, "current_user") })
	return AsRole(t, db, name, "app-secret")
}

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
	t.Cleanup(func() {
		ctx := context.Background()
		c, err := pgx.Connect(ctx, db)
		if err != nil {
			return
		}
		defer c.Close(ctx)
		_, _ = c.Exec(ctx, `DROP OWNED BY `+name+`; DROP ROLE `+name)
	})
	return AsRole(t, db, name, "app-secret")
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
	Exec(t, admin, fmt.Sprintf(`CREATE ROLE %s LOGIN PASSWORD 'app-secret' NOSUPERUSER NOCREATEDB NOCREATEROLE;
		ALTER DATABASE %s OWNER TO %[1]s`, name, cfg.Database))
	t.Cleanup(func() {
		ctx := context.Background()
		c, err := pgx.Connect(ctx, db)
		if err != nil {
			return
		}
		defer c.Close(ctx)
		_, _ = c.Exec(ctx, `REASSIGN OWNED BY `+name+` TO current_user; DROP OWNED BY `+name+`; DROP ROLE `+name)
	})
	return AsRole(t, db, name, "app-secret")
}

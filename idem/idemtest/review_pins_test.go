package idemtest_test

import (
	"context"
	"fmt"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/idem/idemtest"
)

// TestHelpersAreWhatTheySay: NewDB "returns its connection string, as the role that
// owns schema idem"; NewEmptyDB "an empty database ... (no schema idem) ... as its owner";
// NewPool "(at most 8 connections, as the owner)"; AppURL "a new login role that is only a
// member of the application role idem_app ... The role's name is the URL's user (pgx.ParseConfig's
// User)", "dropped when the test ends"; AppPool "closed when the test ends". Run in parallel
// subtests; afterwards no role, database or goroutine of theirs is left.
func TestHelpersAreWhatTheySay(t *testing.T) {
	ctx := context.Background()
	admin := idemtest.NewPool(t)
	baseline := runtime.NumGoroutine()
	const n = 4
	var roles, dbs, empties [n]string
	t.Run("group", func(t *testing.T) {
		for i := range n {
			t.Run(fmt.Sprint(i), func(t *testing.T) {
				t.Parallel()
				// NewDB: the URL's role owns schema idem.
				url := idemtest.NewDB(t)
				c, err := pgx.Connect(ctx, url)
				if err != nil {
					t.Fatal(err)
				}
				defer c.Close(ctx)
				var ownsSchema bool
				if err := c.QueryRow(ctx, `SELECT nspowner = (SELECT oid FROM pg_roles WHERE rolname = current_user) FROM pg_namespace WHERE nspname = 'idem'`).Scan(&ownsSchema); err != nil || !ownsSchema {
					t.Errorf("NewDB's role does not own schema idem: %v %v", ownsSchema, err)
				}
				if err := idem.CheckSchema(ctx, c); err != nil {
					t.Errorf("NewDB at this module's version: %v", err)
				}
				// NewEmptyDB: no schema idem, its owner.
				eurl := idemtest.NewEmptyDB(t)
				ec, err := pgx.Connect(ctx, eurl)
				if err != nil {
					t.Fatal(err)
				}
				defer ec.Close(ctx)
				var hasIdem, owner bool
				if err := ec.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_namespace WHERE nspname = 'idem'),
					(SELECT datdba = (SELECT oid FROM pg_roles WHERE rolname = current_user) FROM pg_database WHERE datname = current_database())`).Scan(&hasIdem, &owner); err != nil {
					t.Fatal(err)
				}
				if hasIdem || !owner {
					t.Errorf("NewEmptyDB: schema idem %v (want none), its owner %v (want true)", hasIdem, owner)
				}
				empties[i] = ec.Config().Database
				// NewPool: at most 8 connections, as the owner.
				pool := idemtest.NewPool(t)
				if mc := pool.Config().MaxConns; mc != 8 {
					t.Errorf("NewPool's MaxConns %d, want 8", mc)
				}
				dbs[i] = pool.Config().ConnConfig.Database
				// AppURL: the URL's user is the role, only a member of idem_app.
				aurl := idemtest.AppURL(t, pool.Config().ConnConfig.ConnString())
				cfg, err := pgx.ParseConfig(aurl)
				if err != nil {
					t.Fatal(err)
				}
				app := idemtest.AppPool(t, pool)
				var cur string
				var super, createrole, createdb bool
				var groups []string
				if err := app.QueryRow(ctx, `SELECT current_user, rolsuper, rolcreaterole, rolcreatedb,
					ARRAY(SELECT g.rolname FROM pg_auth_members m JOIN pg_roles g ON g.oid = m.roleid WHERE m.member = r.oid ORDER BY 1)
					FROM pg_roles r WHERE rolname = current_user`).Scan(&cur, &super, &createrole, &createdb, &groups); err != nil {
					t.Fatal(err)
				}
				if super || createrole || createdb || len(groups) != 1 || groups[0] != "idem_app" {
					t.Errorf("AppPool's role %s: superuser %v createrole %v createdb %v, member of %v; want only a member of idem_app", cur, super, createrole, createdb, groups)
				}
				ac, err := pgx.ConnectConfig(ctx, cfg)
				if err != nil {
					t.Fatal(err)
				}
				var acur string
				if err := ac.QueryRow(ctx, `SELECT current_user`).Scan(&acur); err != nil {
					t.Fatal(err)
				}
				ac.Close(ctx)
				if acur != cfg.User {
					t.Errorf("AppURL's user %q but current_user %q", cfg.User, acur)
				}
				roles[i] = cur + "," + acur
				// The app role may not read the key table (the SQL API only).
				if _, err := app.Exec(ctx, `SELECT count(*) FROM idem.idempotency_keys`); err == nil {
					t.Errorf("AppPool's role reads idem.idempotency_keys")
				}
			})
		}
	})
	for i := range n {
		var left int
		r1, r2, _ := strings.Cut(roles[i], ",")
		if err := admin.QueryRow(ctx, `SELECT (SELECT count(*) FROM pg_database WHERE datname = ANY($1))
			+ (SELECT count(*) FROM pg_roles WHERE rolname = ANY($2))`,
			[]string{dbs[i], empties[i]}, []string{r1, r2}).Scan(&left); err != nil {
			t.Fatal(err)
		}
		if left != 0 {
			t.Errorf("subtest %d: %d of its databases (%s, %s) or roles (%s, %s) left after it ended", i, left, dbs[i], empties[i], r1, r2)
		}
	}
	deadline := time.Now().Add(5 * time.Second)
	for runtime.NumGoroutine() > baseline+2 {
		if time.Now().After(deadline) {
			buf := make([]byte, 1<<16)
			t.Errorf("goroutines: %d after the subtests, %d before\n%s", runtime.NumGoroutine(), baseline, buf[:runtime.Stack(buf, true)])
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
}

package idemtest_test

import (
	"context"
	"fmt"
	"os"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/idem/idemtest"
)

// TestAppURLRoleIsDroppedByANonSuperuser: TEST_DATABASE_URL may name a role that is no superuser
// but may create databases and roles, as the package's doc allows. AppURL's login role (a
// password everyone can read in this repository, a member of idem_app) stayed on the server
// after its test: its cleanup's DROP OWNED was refused to a role that is not a member of it,
// took the DROP ROLE with it, and the error was dropped too (D245). The creating role here
// holds a table the login role was granted, so DROP OWNED has work to do.
func TestAppURLRoleIsDroppedByANonSuperuser(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := idemtest.NewDB(t)
	admin, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close(ctx)
	creator := fmt.Sprintf("idemtest_creator_%d", os.Getpid())
	if _, err := admin.Exec(ctx, `CREATE ROLE `+creator+` LOGIN PASSWORD 'creator' CREATEDB CREATEROLE;
		DO $$ BEGIN EXECUTE format('GRANT ALL ON DATABASE %I TO `+creator+`', current_database()); END $$;
		GRANT CREATE ON SCHEMA public TO `+creator); err != nil {
		t.Fatal(err)
	}
	defer func() {
		if _, err := admin.Exec(ctx, `DROP OWNED BY `+creator+`; DROP ROLE `+creator); err != nil {
			t.Error(err)
		}
	}()
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	asCreator := fmt.Sprintf("host=%s port=%d dbname=%s user=%s password=creator", cfg.Host, cfg.Port, cfg.Database, creator)
	var login string
	t.Run("a test", func(t *testing.T) {
		app, err := pgx.Connect(ctx, idemtest.AppURL(t, asCreator))
		if err != nil {
			t.Fatal(err)
		}
		defer app.Close(ctx)
		if err := app.QueryRow(ctx, `SELECT current_user`).Scan(&login); err != nil {
			t.Fatal(err)
		}
		c, err := pgx.Connect(ctx, asCreator)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close(ctx)
		if _, err := c.Exec(ctx, `CREATE TABLE public.creators_table (x int); GRANT SELECT ON public.creators_table TO `+login); err != nil {
			t.Fatal(err)
		}
	})
	var n int
	if err := admin.QueryRow(ctx, `SELECT count(*) FROM pg_roles WHERE rolname = $1`, login).Scan(&n); err != nil || n != 0 {
		t.Fatalf("login role %q (password app-secret, a member of idem_app) is still on the server after its test ended: %d, %v", login, n, err)
	}
}

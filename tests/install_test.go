package tests

import (
	"context"
	"errors"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/idem/idemmigrate"
	"github.com/pgidem/pgidem/internal/pgcluster"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// docSQL returns the sql block of docs/sql-api.md between the markers named name.
func docSQL(t *testing.T, name string) string {
	t.Helper()
	raw, err := os.ReadFile("../docs/sql-api.md")
	if err != nil {
		t.Fatal(err)
	}
	_, block := replaceBlock(t, string(raw), "<!-- "+name+":begin", "<!-- "+name+":end -->", "")
	block = strings.TrimPrefix(strings.TrimSpace(block), "```sql")
	return strings.TrimSuffix(strings.TrimSpace(block), "```")
}

// TestInstallWithoutSuperuser installs the SQL API as an owner that is no superuser, on a
// cluster of its own (the roles idem_app and idem_operator exist nowhere yet), running the
// blocks of docs/sql-api.md ("Installing without a superuser") as the roles they name:
//
//   - before the superuser step, the install fails through psql (sql/idem.sql) and through Go
//     (idemmigrate.Migrate) alike, with SQLSTATE 42501 and a hint that names the step, and
//     leaves nothing behind;
//   - after it, shop_owner installs through both; the login roles of the doc work: shop_app
//     checks the schema and claims a key, ops_alice lists the claims in progress, and neither may
//     do the other's part;
//   - an owner with CREATEROLE instead installs under roles it creates itself.
func TestInstallWithoutSuperuser(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	c, stop, err := pgcluster.StartTemp(ctx, "idem-install-", map[string]string{"fsync": "off"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(stop)
	admin := pgtest.Connect(t, c.ConnString("postgres"))
	as := func(db, role string) string { return c.ConnString(db) + " user=" + role + " password=change-me" }

	// Before the superuser step: an owner with no other privilege.
	pgtest.Exec(t, admin, `CREATE ROLE early_owner LOGIN`)
	pgtest.Exec(t, admin, `CREATE DATABASE early OWNER early_owner`)
	out, err := psqlCommand(t, as("early", "early_owner"), "-v", "ON_ERROR_STOP=1", "-f", "../sql/idem.sql").CombinedOutput()
	if err == nil || !strings.Contains(string(out), `the role "idem_app" does not exist, and the installing role early_owner may not create it`) ||
		!strings.Contains(string(out), `HINT:  Have a superuser run once: CREATE ROLE "idem_app" NOLOGIN; CREATE ROLE "idem_operator" NOLOGIN;`) ||
		!strings.Contains(string(out), "Installing without a superuser") {
		t.Fatalf("psql -f sql/idem.sql before the superuser step: %v\n%s", err, out)
	}
	early := pgtest.Connect(t, as("early", "early_owner"))
	err = idemmigrate.Migrate(ctx, early, idemmigrate.Options{})
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "42501" || !strings.Contains(pgErr.Hint, "ALTER ROLE early_owner CREATEROLE") {
		t.Fatalf("idemmigrate.Migrate before the superuser step: %v", err)
	}
	// A program that prints the error shows the hint (pgconn's Error() leaves it out).
	if !strings.Contains(err.Error(), "(hint: ") || !strings.Contains(err.Error(), "ALTER ROLE early_owner CREATEROLE") {
		t.Fatalf("idemmigrate.Migrate's error does not show its hint: %v", err)
	}
	if n := pgtest.Count(t, early, `SELECT count(*) FROM pg_namespace WHERE nspname = 'idem'`); n != 0 {
		t.Fatal("the failed install left schema idem behind")
	}

	// The documented superuser step and login roles, verbatim.
	psql(t, c.ConnString("postgres"), []byte(docSQL(t, "superuser-step")), "-v", "ON_ERROR_STOP=1")
	psql(t, c.ConnString("postgres"), []byte(docSQL(t, "login-roles")), "-v", "ON_ERROR_STOP=1")
	pgtest.Exec(t, admin, `CREATE DATABASE shop_go OWNER shop_owner`)

	// The owner installs: psql into shop, Go into shop_go.
	psql(t, as("shop", "shop_owner"), nil, "-v", "ON_ERROR_STOP=1", "-f", "../sql/idem.sql")
	if err := idemmigrate.Migrate(ctx, pgtest.Connect(t, as("shop_go", "shop_owner")), idemmigrate.Options{}); err != nil {
		t.Fatalf("idemmigrate.Migrate as shop_owner after the superuser step: %v", err)
	}
	for _, db := range []string{"shop", "shop_go"} {
		owner := pgtest.Connect(t, as(db, "shop_owner"))
		var schemaOwner string
		if err := owner.QueryRow(ctx, `SELECT nspowner::regrole::text FROM pg_namespace WHERE nspname = 'idem'`).Scan(&schemaOwner); err != nil || schemaOwner != "shop_owner" {
			t.Fatalf("%s: schema idem owned by %q, %v", db, schemaOwner, err)
		}
		app := pgtest.Connect(t, as(db, "shop_app"))
		if err := idem.CheckSchema(ctx, app); err != nil {
			t.Fatalf("%s: CheckSchema as shop_app: %v", db, err)
		}
		d, err := idem.Begin(ctx, app, idem.Claim{Principal: "p", Key: "k", Action: "POST /x", Lease: time.Minute,
			Fingerprint: idem.ComputeFingerprint("POST", "/x", nil).Sum})
		if err != nil || d.Outcome != idem.Claimed {
			t.Fatalf("%s: a lease claim as shop_app: %+v %v", db, d, err)
		}
		ops := pgtest.Connect(t, as(db, "ops_alice"))
		if stuck, err := idem.ReadStuck(ctx, ops, 0, 0); err != nil || len(stuck) != 1 || stuck[0].Attempt != d.Attempt {
			t.Fatalf("%s: the claims in progress as ops_alice: %+v %v", db, stuck, err)
		}
		if _, err := idem.ReadStuck(ctx, app, 0, 0); !errors.Is(err, idem.ErrPermissionDenied) {
			t.Fatalf("%s: shop_app listed the stuck claims: %v", db, err)
		}
		if _, err := idem.Begin(ctx, ops, idem.Claim{Principal: "p", Key: "k2", Action: "POST /x"}); !errors.Is(err, idem.ErrPermissionDenied) {
			t.Fatalf("%s: ops_alice claimed a key: %v", db, err)
		}
		if _, err := app.Exec(ctx, `SELECT * FROM idem.idempotency_keys`); err == nil {
			t.Fatalf("%s: shop_app reads the key table", db)
		}
	}

	// The other superuser step: an owner with CREATEROLE creates the roles as it installs.
	pgtest.Exec(t, admin, `CREATE ROLE cr_owner LOGIN CREATEROLE`)
	pgtest.Exec(t, admin, `CREATE DATABASE cr OWNER cr_owner`)
	cr := pgtest.Connect(t, as("cr", "cr_owner"))
	if err := idemmigrate.Migrate(ctx, cr, idemmigrate.Options{AppRole: "cr_app", OperatorRole: "cr_ops"}); err != nil {
		t.Fatalf("idemmigrate.Migrate as an owner with CREATEROLE: %v", err)
	}
	pgtest.Exec(t, cr, `CREATE ROLE cr_service LOGIN IN ROLE cr_app`)
	svc, err := pgx.Connect(ctx, as("cr", "cr_service"))
	if err != nil {
		t.Fatal(err)
	}
	defer svc.Close(ctx)
	if err := idem.CheckSchema(ctx, svc); err != nil {
		t.Fatalf("CheckSchema as the service of the CREATEROLE owner: %v", err)
	}
}

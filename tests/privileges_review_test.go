package tests

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgidem/pgidem/idem/idemmigrate"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// privRoutinesOf lists the routines of schema idem that role may EXECUTE (directly granted, or
// through PUBLIC), sorted.
func privRoutinesOf(t *testing.T, conn *pgx.Conn, role string) string {
	t.Helper()
	rows, err := conn.Query(context.Background(), `
	SELECT p.oid::regprocedure::text FROM pg_proc p
	 WHERE p.pronamespace = 'idem'::regnamespace
	   AND has_function_privilege($1, p.oid, 'EXECUTE')
	 ORDER BY 1`, role)
	if err != nil {
		t.Fatal(err)
	}
	lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return strings.Join(lines, "\n")
}

func privOwner(t *testing.T, db string) (string, *pgx.Conn, string) {
	t.Helper()
	ownerURL := pgtest.OwnerRole(t, db)
	c := pgtest.Connect(t, ownerURL)
	var owner string
	if err := c.QueryRow(context.Background(), `SELECT current_user`).Scan(&owner); err != nil {
		t.Fatal(err)
	}
	return ownerURL, c, owner
}

// baseline: what idem_app and idem_operator may run after a plain install.
func privBaseline(t *testing.T) (app, op, others string) {
	t.Helper()
	db := pgtest.NewEmptyDB(t)
	_, c, _ := privOwner(t, db)
	if err := idemmigrate.Migrate(context.Background(), c, idemmigrate.Options{}); err != nil {
		t.Fatal(err)
	}
	return privRoutinesOf(t, c, "idem_app"), privRoutinesOf(t, c, "idem_operator"), othersPrivileges(t, c)
}

const privHostileDefaults = `
	ALTER DEFAULT PRIVILEGES GRANT ALL ON TABLES TO PUBLIC, idem_app, idem_operator;
	ALTER DEFAULT PRIVILEGES GRANT ALL ON SEQUENCES TO PUBLIC, idem_app, idem_operator;
	ALTER DEFAULT PRIVILEGES GRANT EXECUTE ON FUNCTIONS TO PUBLIC, idem_app, idem_operator;
	ALTER DEFAULT PRIVILEGES GRANT ALL ON TYPES TO PUBLIC, idem_app, idem_operator;
	ALTER DEFAULT PRIVILEGES GRANT ALL ON SCHEMAS TO PUBLIC, idem_app, idem_operator;`

const privHostileSchemaDefaults = `
	ALTER DEFAULT PRIVILEGES IN SCHEMA idem GRANT ALL ON TABLES TO PUBLIC, idem_app, idem_operator;
	ALTER DEFAULT PRIVILEGES IN SCHEMA idem GRANT ALL ON SEQUENCES TO PUBLIC, idem_app, idem_operator;
	ALTER DEFAULT PRIVILEGES IN SCHEMA idem GRANT EXECUTE ON FUNCTIONS TO PUBLIC, idem_app, idem_operator;
	ALTER DEFAULT PRIVILEGES IN SCHEMA idem GRANT ALL ON TYPES TO PUBLIC, idem_app, idem_operator;`

// TestPrivilegesDefaultsToPublicAppOperatorGiveExactlyTheAPI: default privileges (global, and for
// schema idem, created beforehand by the owner) that give tables, sequences, functions, types
// and schemas to PUBLIC, idem_app and idem_operator: after Migrate, idem_app and idem_operator
// may run exactly what a plain install gives them, no relation of idem is readable by others,
// and a member of idem_app can claim; a member of idem_operator can run the operator functions.
func TestPrivilegesDefaultsToPublicAppOperatorGiveExactlyTheAPI(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	wantApp, wantOp, wantOthers := privBaseline(t)
	for _, inSchema := range []bool{false, true} {
		t.Run(fmt.Sprintf("inSchema=%v", inSchema), func(t *testing.T) {
			db := pgtest.NewEmptyDB(t)
			_, c, _ := privOwner(t, db)
			pgtest.Exec(t, c, privHostileDefaults)
			if inSchema {
				pgtest.Exec(t, c, `CREATE SCHEMA idem`)
				pgtest.Exec(t, c, privHostileSchemaDefaults)
			}
			if err := idemmigrate.Migrate(ctx, c, idemmigrate.Options{}); err != nil {
				t.Fatal(err)
			}
			privCheckExact(t, db, c, wantApp, wantOp, wantOthers)
		})
	}
}

func privCheckExact(t *testing.T, db string, c *pgx.Conn, wantApp, wantOp, wantOthers string) {
	t.Helper()
	ctx := context.Background()
	if got := privRoutinesOf(t, c, "idem_app"); got != wantApp {
		t.Errorf("idem_app may run:\n%s\nwant (plain install):\n%s", got, wantApp)
	}
	if got := privRoutinesOf(t, c, "idem_operator"); got != wantOp {
		t.Errorf("idem_operator may run:\n%s\nwant (plain install):\n%s", got, wantOp)
	}
	got := othersPrivileges(t, c)
	// Schema USAGE/CREATE lines are checked separately; keep relation and routine lines.
	filter := func(s string) string {
		var out []string
		for _, l := range strings.Split(s, "\n") {
			if !strings.HasPrefix(l, "schema ") {
				out = append(out, l)
			}
		}
		return strings.Join(out, "\n")
	}
	if filter(got) != filter(wantOthers) {
		t.Errorf("privileges held by others:\n%s\nwant (plain install):\n%s", got, wantOthers)
	}
	if n := pgtest.Count(t, c, `SELECT count(*) FROM pg_namespace n, aclexplode(n.nspacl) a WHERE n.nspname = 'idem' AND a.privilege_type = 'CREATE' AND a.grantee <> n.nspowner`); n != 0 {
		t.Errorf("%d roles besides the owner may CREATE in schema idem", n)
	}
	app := pgtest.Connect(t, pgtest.LoginRole(t, db, "idem_app"))
	if err := privClaim(ctx, app, "k1"); err != nil {
		t.Errorf("a claim as a member of idem_app: %v", err)
	}
	for _, sql := range []string{`SELECT count(*) FROM idem.idempotency_keys`, `SELECT idem.installation_secret_values()`, `SELECT idem.idem_key_body('p', 'k1')`} {
		_, err := app.Exec(ctx, sql)
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "42501" {
			t.Errorf("member of idem_app ran %s: %v", sql, err)
		}
	}
	op := pgtest.Connect(t, pgtest.LoginRole(t, db, "idem_operator"))
	for _, sql := range []string{`SELECT * FROM idem.idem_summary()`, `SELECT * FROM idem.idem_stuck()`, `SELECT idem.idem_key_body('p', 'k1')`, `SELECT * FROM idem.idem_health()`} {
		if _, err := op.Exec(ctx, sql); err != nil {
			t.Errorf("member of idem_operator: %s: %v", sql, err)
		}
	}
}

// TestPrivilegesBundleWithDefaults: the same through the psql bundle sql/idem.sql.
func TestPrivilegesBundleWithDefaults(t *testing.T) {
	t.Parallel()
	wantApp, wantOp, wantOthers := privBaseline(t)
	db := pgtest.NewEmptyDB(t)
	ownerURL, c, _ := privOwner(t, db)
	pgtest.Exec(t, c, privHostileDefaults)
	pgtest.Exec(t, c, `CREATE SCHEMA idem`)
	pgtest.Exec(t, c, privHostileSchemaDefaults)
	if b, err := psqlCommand(t, ownerURL, "-q", "-v", "ON_ERROR_STOP=1", "-f", "../sql/idem.sql").CombinedOutput(); err != nil {
		t.Fatalf("sql/idem.sql: %v\n%s", err, b)
	}
	// and again (a re-install)
	if b, err := psqlCommand(t, ownerURL, "-q", "-v", "ON_ERROR_STOP=1", "-f", "../sql/idem.sql").CombinedOutput(); err != nil {
		t.Fatalf("sql/idem.sql again: %v\n%s", err, b)
	}
	privCheckExact(t, db, c, wantApp, wantOp, wantOthers)
}

// TestPrivilegesEarlierAppRoleKeepsItsAPI: install.sql: "an install for another application or
// operator role ... gives it everything the first one got. The earlier roles keep their
// grants." The owner's default privileges give EXECUTE on functions to idem_app (the first
// install's app role) — or to idem_operator; a second install for another app role (operator
// role) took the first's API away (D191's first take-back revoked every default-ACL grantee's
// EXECUTE on every routine); it reaches only the routines an install creates now.
func TestPrivilegesEarlierAppRoleKeepsItsAPI(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for _, first := range []string{"idem_app", "idem_operator"} {
		t.Run(first, func(t *testing.T) {
			db := pgtest.NewEmptyDB(t)
			_, c, _ := privOwner(t, db)
			pgtest.Exec(t, c, `ALTER DEFAULT PRIVILEGES GRANT EXECUTE ON FUNCTIONS TO `+first)
			if err := idemmigrate.Migrate(ctx, c, idemmigrate.Options{}); err != nil {
				t.Fatal(err)
			}
			before := privRoutinesOf(t, c, first)
			second := scratchRole(t, db, "pv_second", "NOLOGIN")
			opts := idemmigrate.Options{AppRole: second}
			if first == "idem_operator" {
				opts = idemmigrate.Options{OperatorRole: second}
			}
			if err := idemmigrate.Migrate(ctx, c, opts); err != nil {
				t.Fatal(err)
			}
			if after := privRoutinesOf(t, c, first); after != before {
				t.Errorf("after an install for %s, %s may run:\n%s\nbefore it could run:\n%s", second, first, after, before)
			}
			if first == "idem_app" {
				app := pgtest.Connect(t, pgtest.LoginRole(t, db, "idem_app"))
				if err := privClaim(ctx, app, "k1"); err != nil {
					t.Errorf("a claim as a member of the first app role after an install for a second one: %v", err)
				}
			}
		})
	}
}

// TestPrivilegesNewInstallationSecretWithDefaults: idem_new_installation_secret as the owner,
// default privileges (global and for schema idem) on sequences to PUBLIC, idem_app, a login:
// the four new sequences are the owner's alone; the services still claim.
func TestPrivilegesNewInstallationSecretWithDefaults(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.NewEmptyDB(t)
	_, c, _ := privOwner(t, db)
	if err := idemmigrate.Migrate(ctx, c, idemmigrate.Options{}); err != nil {
		t.Fatal(err)
	}
	svc := scratchRole(t, db, "pv_svc", "LOGIN IN ROLE idem_app")
	pgtest.Exec(t, c, fmt.Sprintf(`ALTER DEFAULT PRIVILEGES GRANT ALL ON SEQUENCES TO PUBLIC, idem_app; ALTER DEFAULT PRIVILEGES GRANT ALL ON SEQUENCES TO %s WITH GRANT OPTION;
		ALTER DEFAULT PRIVILEGES IN SCHEMA idem GRANT ALL ON SEQUENCES TO PUBLIC, idem_operator, %[1]s`, svc))
	pgtest.Exec(t, c, `CALL idem.idem_new_installation_secret('5 seconds')`)
	if got := othersPrivileges(t, c); strings.Contains(got, "installation_secret") {
		t.Errorf("after idem_new_installation_secret with default privileges, others hold:\n%s", got)
	}
	app := pgtest.Connect(t, pgtest.AsRole(t, db, svc, "scratch-secret"))
	if err := privClaim(ctx, app, "k2"); err != nil {
		t.Errorf("claim after a new secret: %v", err)
	}
	// and a re-install afterwards
	if err := idemmigrate.Migrate(ctx, c, idemmigrate.Options{}); err != nil {
		t.Fatal(err)
	}
	if got := othersPrivileges(t, c); strings.Contains(got, "installation_secret") {
		t.Errorf("after a re-install, others hold:\n%s", got)
	}
}

// TestPrivilegesColumnGrantsOnKeyTable: D191 "the tables and sequences of schema idem are the
// owner's alone (every other grantee's privileges on them are revoked, deliberate grants
// included)". A column grant on the key table's body is such a grant; it survived every
// install (its grantee was in no table's ACL, only in the column's).
func TestPrivilegesColumnGrantsOnKeyTable(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.NewEmptyDB(t)
	_, c, _ := privOwner(t, db)
	if err := idemmigrate.Migrate(ctx, c, idemmigrate.Options{}); err != nil {
		t.Fatal(err)
	}
	svc := scratchRole(t, db, "pv_col", "LOGIN IN ROLE idem_app")
	pgtest.Exec(t, c, `GRANT SELECT (response_body) ON idem.idempotency_keys TO `+svc)
	if err := idemmigrate.Migrate(ctx, c, idemmigrate.Options{}); err != nil {
		t.Fatal(err)
	}
	app := pgtest.Connect(t, pgtest.AsRole(t, db, svc, "scratch-secret"))
	_, err := app.Exec(ctx, `SELECT response_body FROM idem.idempotency_keys`)
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "42501" {
		t.Errorf("after a re-install, a column grant on the bodies still reads them: %v", err)
	}
}

// TestPrivilegesGrantOptionChain: default privileges give a login SELECT on tables WITH GRANT
// OPTION (a login that hands its reads on to a reporting role); it did hand the key table on.
// A re-install failed ("dependent privileges exist"); it succeeds and takes both back.
func TestPrivilegesGrantOptionChain(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.NewEmptyDB(t)
	_, c, _ := privOwner(t, db)
	svc := scratchRole(t, db, "pv_go", "LOGIN IN ROLE idem_app")
	rep := scratchRole(t, db, "pv_rep", "NOLOGIN")
	pgtest.Exec(t, c, `ALTER DEFAULT PRIVILEGES GRANT SELECT ON TABLES TO `+svc+` WITH GRANT OPTION`)
	pgtest.Exec(t, c, `ALTER DEFAULT PRIVILEGES GRANT EXECUTE ON FUNCTIONS TO `+svc+` WITH GRANT OPTION`)
	if err := idemmigrate.Migrate(ctx, c, idemmigrate.Options{}); err != nil {
		t.Fatalf("first install: %v", err)
	}
	// What a 0.2.0 install under those defaults left (the grant option), and the hand-on.
	pgtest.Exec(t, c, `GRANT SELECT ON idem.idempotency_keys TO `+svc+` WITH GRANT OPTION`)
	sc := pgtest.Connect(t, pgtest.AsRole(t, db, svc, "scratch-secret"))
	pgtest.Exec(t, sc, `GRANT SELECT ON idem.idempotency_keys TO `+rep)
	if err := idemmigrate.Migrate(ctx, c, idemmigrate.Options{}); err != nil {
		t.Fatalf("re-install after a grant-option hand-on: %v", err)
	}
	if n := pgtest.Count(t, c, `SELECT count(*) FROM pg_class c, aclexplode(c.relacl) a WHERE c.oid = 'idem.idempotency_keys'::regclass AND a.grantee <> c.relowner`); n != 0 {
		t.Errorf("%d grants on the key table survive a re-install", n)
	}
}

// privClaim claims a key in a transaction and rolls it back.
func privClaim(ctx context.Context, c *pgx.Conn, key string) error {
	tx, err := c.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(ctx)
	var outcome string
	return tx.QueryRow(ctx, `SELECT outcome FROM idem.idem_begin('p', $1, 'POST /x', sha256('x'))`, key).Scan(&outcome)
}

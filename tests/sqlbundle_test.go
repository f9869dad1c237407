package tests

import (
	"context"
	"os"
	"strconv"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/tern/v2/migrate"

	"github.com/pgidem/pgidem/internal/pgtest"
	idemsql "github.com/pgidem/pgidem/sql"
)

// bundle is the generated psql file (make sql; internal/tools/sqlbundle).
const bundle = "../sql/idem.sql"

// installBundle runs `psql -v ON_ERROR_STOP=1 -f sql/idem.sql` against url, as the docs tell a
// DBA to, and returns psql's output and error.
func installBundle(t *testing.T, url string) (string, error) {
	t.Helper()
	out, err := psqlCommand(t, url, "-v", "ON_ERROR_STOP=1", "-f", bundle).CombinedOutput()
	return string(out), err
}

func mustInstallBundle(t *testing.T, url string) {
	t.Helper()
	if out, err := installBundle(t, url); err != nil {
		t.Fatalf("psql -f sql/idem.sql: %v\n%s", err, out)
	}
}

// installed describes schema idem beyond catalog(): function bodies and comments, the
// comments of relations, the version table's columns and content, the schema's owner.
func installed(t *testing.T, conn *pgx.Conn) string {
	t.Helper()
	rows, err := conn.Query(context.Background(), `
	SELECT line FROM (
	  -- The lists of the installation's secrets are data written as functions: their bodies
	  -- hold the first tokens, which depend on the database's history, not on the install path.
	  SELECT 'source ' || p.oid::regprocedure::text || ' md5 '
	         || CASE WHEN p.proname LIKE 'installation\_secret\_%' THEN 'data' ELSE md5(p.prosrc) END
	         || coalesce(' comment ' || obj_description(p.oid, 'pg_proc'), '') AS line
	    FROM pg_proc p WHERE p.pronamespace = 'idem'::regnamespace
	  UNION ALL
	  SELECT 'relation idem.' || c.relname || ' kind ' || c.relkind::text || ' owner ' || c.relowner::regrole
	         || coalesce(' comment ' || obj_description(c.oid, 'pg_class'), '')
	    FROM pg_class c WHERE c.relnamespace = 'idem'::regnamespace
	  UNION ALL
	  SELECT 'version table column ' || a.attname || ' ' || format_type(a.atttypid, a.atttypmod)
	         || CASE WHEN a.attnotnull THEN ' NOT NULL' ELSE '' END
	         || coalesce(' DEFAULT ' || pg_get_expr(d.adbin, d.adrelid), '')
	    FROM pg_attribute a LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
	   WHERE a.attrelid = 'idem.schema_version'::regclass AND a.attnum > 0 AND NOT a.attisdropped
	  UNION ALL
	  SELECT 'version table row ' || version FROM idem.schema_version
	  UNION ALL
	  SELECT 'schema idem owner ' || nspowner::regrole FROM pg_namespace WHERE nspname = 'idem'
	) s ORDER BY 1`)
	if err != nil {
		t.Fatal(err)
	}
	lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return catalog(t, conn) + strings.Join(lines, "\n") + "\n"
}

// sameCatalog fails the test when the two descriptions differ, showing the first lines that do.
func sameCatalog(t *testing.T, what, got, want string) {
	t.Helper()
	if got == want {
		return
	}
	g, w := strings.Split(got, "\n"), strings.Split(want, "\n")
	for i := 0; i < max(len(g), len(w)); i++ {
		var gl, wl string
		if i < len(g) {
			gl = g[i]
		}
		if i < len(w) {
			wl = w[i]
		}
		if gl != wl {
			t.Fatalf("%s: the catalogs differ at line %d:\n  sql/idem.sql:      %s\n  idemsql.Migrate:   %s", what, i+1, gl, wl)
		}
	}
}

// TestSQLBundleMatchesMigrate installs sql/idem.sql with psql into an empty database, twice,
// and idemsql.Migrate into another, and compares what pg_catalog says of schema idem in
// both: tables, columns, constraints, indexes, the sequence, the role, grants, functions
// with their bodies and comments, and tern's version table with its one row. Then each
// database gets the other installer (psql after Migrate, Migrate after psql): both see the
// version the other left and change nothing.
func TestSQLBundleMatchesMigrate(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	byPsql := pgtest.NewEmptyDB(t)
	for run, migrations := range []int{idemsql.Version(), 0} {
		out, err := installBundle(t, byPsql)
		if err != nil {
			t.Fatalf("run %d of sql/idem.sql: %v\n%s", run+1, err, out)
		}
		// Each migration that runs ends with UPDATE idem.schema_version.
		if n := strings.Count(out, "UPDATE 1"); n != migrations {
			t.Fatalf("run %d of sql/idem.sql applied %d migrations, want %d:\n%s", run+1, n, migrations, out)
		}
	}
	connPsql := pgtest.Connect(t, byPsql)
	byGo := pgtest.NewEmptyDB(t)
	connGo := pgtest.Connect(t, byGo)
	if err := idemsql.Migrate(ctx, connGo, idemsql.Options{}); err != nil {
		t.Fatal(err)
	}
	want := installed(t, connGo)
	if !strings.Contains(want, "version table row "+strconv.Itoa(idemsql.Version())+"\n") {
		t.Fatalf("idemsql.Migrate left no version %d:\n%s", idemsql.Version(), want)
	}
	sameCatalog(t, "sql/idem.sql run twice", installed(t, connPsql), want)

	if err := idemsql.Migrate(ctx, connPsql, idemsql.Options{}); err != nil {
		t.Fatalf("idemsql.Migrate after sql/idem.sql: %v", err)
	}
	sameCatalog(t, "idemsql.Migrate after sql/idem.sql", installed(t, connPsql), want)
	mustInstallBundle(t, byGo)
	sameCatalog(t, "sql/idem.sql after idemsql.Migrate", installed(t, connGo), want)
}

// TestSQLBundleUpgrades: a database that release 0.1.0 installed (tern applied migrations 1
// and 2 only, as idemsql.Migrate does, then 0.1.0's functions) and that holds a completed
// key is upgraded by sql/idem.sql: only the migrations after 2 run (1 and 2 would fail on the
// tables they create), the catalog is then that of a fresh install, and the key still replays.
func TestSQLBundleUpgrades(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.NewEmptyDB(t)
	conn := pgtest.Connect(t, url)
	data := map[string]any{"app_role": idemsql.DefaultAppRole}
	pgtest.Exec(t, conn, `CREATE SCHEMA IF NOT EXISTS idem`)
	m, err := migrate.NewMigrator(ctx, conn, idemsql.VersionTable)
	if err != nil {
		t.Fatal(err)
	}
	m.Data = data
	if err := m.LoadMigrations(idemsql.Migrations()); err != nil {
		t.Fatal(err)
	}
	if err := m.MigrateTo(ctx, 2); err != nil {
		t.Fatal(err)
	}
	code, err := migrate.LoadCodePackage(os.DirFS("../internal/release010/sql/idem/functions"))
	if err != nil {
		t.Fatal(err)
	}
	if err := migrate.InstallCodePackage(ctx, conn, data, code); err != nil {
		t.Fatalf("0.1.0 functions: %v", err)
	}
	pgtest.Exec(t, conn, `BEGIN;
		SELECT idem.idem_begin('p', 'k-old', 'POST /t', sha256('body'));
		SELECT idem.idem_complete('p', 'k-old', 1, 201, '{"Content-Type": "application/json"}', '{"id":1}');
		COMMIT`)

	out, err := installBundle(t, url)
	if err != nil {
		t.Fatalf("psql -f sql/idem.sql on a 0.1.0 database: %v\n%s", err, out)
	}
	if n := strings.Count(out, "UPDATE 1"); n != idemsql.Version()-2 {
		t.Fatalf("%d migrations ran, want %d (those after 0.1.0's two):\n%s", n, idemsql.Version()-2, out)
	}
	fresh := pgtest.Connect(t, pgtest.NewEmptyDB(t))
	if err := idemsql.Migrate(ctx, fresh, idemsql.Options{}); err != nil {
		t.Fatal(err)
	}
	sameCatalog(t, "0.1.0 upgraded by sql/idem.sql", installed(t, conn), installed(t, fresh))
	var outcome, body string
	if err := conn.QueryRow(ctx, `SELECT outcome, convert_from(response_body, 'UTF8')
		FROM idem.idem_begin(p_principal => 'p', p_key => 'k-old', p_action => 'POST /t', p_request_sha256 => sha256('body'))`).
		Scan(&outcome, &body); err != nil {
		t.Fatal(err)
	}
	if outcome != "replay" || body != `{"id":1}` {
		t.Fatalf("the key stored by 0.1.0: %s %s, want a replay of {\"id\":1}", outcome, body)
	}
}

// TestSQLBundleRefusesNewerDatabase: on a database whose schema version is above the file's,
// sql/idem.sql stops with a message and changes nothing (its one transaction rolls back).
func TestSQLBundleRefusesNewerDatabase(t *testing.T) {
	t.Parallel()
	url := pgtest.NewDB(t)
	conn := pgtest.Connect(t, url)
	newer := idemsql.Version() + 1
	pgtest.Exec(t, conn, `UPDATE idem.schema_version SET version = $1`, newer)
	pgtest.Exec(t, conn, `COMMENT ON FUNCTION idem.idem_defaults() IS 'untouched'`)
	out, err := installBundle(t, url)
	if err == nil || !strings.Contains(out, "newer than this file") {
		t.Fatalf("sql/idem.sql on a newer database: %v\n%s", err, out)
	}
	if n := pgtest.Count(t, conn, `SELECT version FROM idem.schema_version`); n != newer {
		t.Fatalf("version %d, want %d", n, newer)
	}
	var comment string
	if err := conn.QueryRow(context.Background(), `SELECT obj_description('idem.idem_defaults()'::regprocedure, 'pg_proc')`).Scan(&comment); err != nil || comment != "untouched" {
		t.Fatalf("the functions were re-installed: comment %q (%v)", comment, err)
	}
}

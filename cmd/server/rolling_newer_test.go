package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/tern/v2/migrate"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/idem/idemmigrate"
	"github.com/pgidem/pgidem/internal/pgcluster"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// r2Catalog is what an install writes: the version tables, and every function of schemas
// idem and ledger with its source, configuration and privileges.
func r2Catalog(t *testing.T, s *testServer) string {
	t.Helper()
	var out string
	if err := s.pool.QueryRow(context.Background(), `SELECT
		(SELECT version FROM idem.schema_version)::text || '/' || (SELECT version FROM ledger.schema_version)::text || E'\n' ||
		(SELECT string_agg(p.oid::regprocedure::text || ' ' || md5(p.prosrc) || ' ' || coalesce(p.proacl::text, '-') || ' ' ||
			coalesce(p.proconfig::text, '-') || ' ' || pg_get_userbyid(p.proowner), E'\n' ORDER BY p.oid::regprocedure::text)
		 FROM pg_proc AS p WHERE p.pronamespace IN ('idem'::regnamespace, 'ledger'::regnamespace))`).Scan(&out); err != nil {
		t.Fatal(err)
	}
	return out
}

func r2RepoRoot(t *testing.T) string {
	t.Helper()
	_, file, _, ok := runtime.Caller(0)
	if !ok {
		t.Fatal("no caller")
	}
	return filepath.Join(filepath.Dir(file), "..", "..")
}

// TestOlderMigrateOnANewerDatabaseChangesNothing: docs/operations.md (Upgrades), refuseNewer
// ("nothing was changed"), sql/idem.sql ("newer than this file"): this release's three
// installers run on a database that the next release migrated (and that serves this release)
// refuse, and change nothing: the newer release's functions, its idem_serves_version and
// ledger.serves_version stay, and this release's running server stays healthy.
func TestOlderMigrateOnANewerDatabaseChangesNothing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := startServer(t, nil)
	appURL := pgtest.LoginRole(t, s.db, "idem_app")
	var log bytes.Buffer
	old := serveWith(t, appURL, s.db, nil, &log)
	asNextRelease(t, s, idem.SchemaVersion(), countMigrations(ledgerFS()))
	before := r2Catalog(t, s)

	out, errOut, err := runMain(t, []string{"migrate"}, serverEnv(s.db, nil))
	if err == nil {
		t.Errorf("this release's `server migrate` on a newer database succeeded:\n%s%s", out, errOut)
	}
	if after := r2Catalog(t, s); after != before {
		t.Errorf("`server migrate` (%v) changed the newer database:\nbefore:\n%s\nafter:\n%s", err, before, after)
	}

	conn := pgtest.Connect(t, s.db)
	if err := idemmigrate.Migrate(ctx, conn, idemmigrate.Options{}); err == nil {
		t.Errorf("idemmigrate.Migrate on a newer database succeeded")
	}
	if after := r2Catalog(t, s); after != before {
		t.Errorf("idemmigrate.Migrate changed the newer database:\nbefore:\n%s\nafter:\n%s", before, after)
	}

	cmd := exec.Command("psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", s.db, "-f", "sql/idem.sql")
	cmd.Dir = r2RepoRoot(t)
	psqlOut, psqlErr := cmd.CombinedOutput()
	if psqlErr == nil {
		t.Errorf("psql -f sql/idem.sql on a newer database succeeded:\n%s", psqlOut)
	}
	if after := r2Catalog(t, s); after != before {
		t.Errorf("psql -f sql/idem.sql changed the newer database:\nbefore:\n%s\nafter:\n%s", before, after)
	}

	if h := old.call("GET", "/healthz", "", "", ""); h.status != 200 {
		t.Errorf("this release's server after its own installers ran on the newer database: /healthz %d %s", h.status, h.body)
	}
}

// TestOlderLibraryMigrateBesideANewerOne: "safe to run ... from several processes at once
// (they take turns on tern's advisory lock)". This release's idemmigrate.Migrate starts while
// the next release's migrate holds tern's lock and has not committed (this one reads version 7
// before it waits); once the newer one commits, this one must refuse, not install its
// functions over the newer ones.
func TestOlderLibraryMigrateBesideANewerOne(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := startServer(t, nil)
	next := idem.SchemaVersion() + 1
	newer := pgtest.Connect(t, s.db)
	tx, err := newer.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, fmt.Sprintf(`SELECT pg_advisory_xact_lock(%d);
		UPDATE idem.schema_version SET version = %[2]d;
		CREATE OR REPLACE FUNCTION idem.idem_version(OUT functions_version integer, OUT schema_version integer)
			LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
			AS $$ SELECT %[2]d, (SELECT v.version FROM idem.schema_version AS v) $$;
		CREATE OR REPLACE FUNCTION idem.idem_serves_version(p_version integer) RETURNS boolean
			LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$ SELECT p_version BETWEEN 5 AND %[2]d $$`,
		9628173550095224, next)); err != nil {
		t.Fatal(err)
	}
	older := pgtest.Connect(t, s.db)
	done := make(chan error, 1)
	go func() { done <- idemmigrate.Migrate(ctx, older, idemmigrate.Options{}) }()
	pgtest.WaitUntilBlocked(t, s.pool, older.PgConn().PID())
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	before := r2Catalog(t, s)
	var mErr error
	select {
	case mErr = <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("the older migrate did not end")
	}
	if mErr == nil {
		t.Errorf("this release's Migrate, begun before the newer one committed, succeeded after it")
	}
	if after := r2Catalog(t, s); after != before {
		t.Errorf("this release's Migrate (%v) changed the newer installation:\nbefore:\n%s\nafter:\n%s", mErr, before, after)
	}
	var functions int
	if err := s.pool.QueryRow(ctx, `SELECT functions_version FROM idem.idem_version()`).Scan(&functions); err != nil || functions != next {
		t.Errorf("idem_version's functions after both migrates: %d (%v); want %d", functions, err, next)
	}
}

// TestCommandsOnANewerDatabaseThatServesThisOne: docs/operations.md: "`serve`, `cleanup`
// and `principal create` refuse a database whose schema or functions belong to another
// release ..., with one exception: a database that a newer release migrated and that says it
// still serves this release". The commands, as the application role.
func TestCommandsOnANewerDatabaseThatServesThisOne(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	appURL := pgtest.LoginRole(t, s.db, "idem_app")
	asNextRelease(t, s, idem.SchemaVersion(), countMigrations(ledgerFS()))
	for _, args := range [][]string{{"principal", "create", "bob"}, {"cleanup"}, {"keys"}} {
		out, errOut, err := runMain(t, args, serverEnv(appURL, nil))
		if err != nil {
			t.Errorf("server %s on a newer database that serves this release: %v\n%s%s", strings.Join(args, " "), err, out, errOut)
		}
	}
}

// TestNextLedgerMigrateKeepsOldServersHealthy: docs/operations.md, "A rolling upgrade": "1.
// Run the new release's `server migrate` while the old servers keep serving ... From this
// release on, the old servers' `/healthz` stays 200 through step 1 (with a `note`), so a load
// balancer or a readiness probe keeps them in service". The next release's migrate is this
// release's code (m.migrate) with more ledger migrations: migrateLedger commits them one by
// one (tern, a transaction each, retried on lock timeouts for seconds), and it wrote the new
// ledger.serves_version (ledgerServes) only afterwards: from the first new migration's commit
// to that statement, the old servers saw a ledger one version on whose serves_version was
// still their own (it does not serve the new version): /healthz 503, and a restart refused.
// The migrate writes it first now (TestMigrateWritesWhatTheLedgerServesBeforeItsMigrations).
//
// Here the next release writes it, then has two ledger migrations, the second taking a second;
// migrateLedger (the production function) runs them; /healthz is polled meanwhile.
func TestNextLedgerMigrateKeepsOldServersHealthy(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := startServer(t, nil)
	appURL := pgtest.LoginRole(t, s.db, "idem_app")
	var log bytes.Buffer
	old := serveWith(t, appURL, s.db, nil, &log)
	n := countMigrations(ledgerFS())

	conn := pgtest.Connect(t, s.db)
	mig, err := migrate.NewMigrator(ctx, conn, ledgerVersionTable)
	if err != nil {
		t.Fatal(err)
	}
	mig.Data = map[string]any{"app_role": "idem_app"}
	if err := mig.LoadMigrations(ledgerFS()); err != nil {
		t.Fatal(err)
	}
	mig.AppendMigration("next_a", `CREATE TABLE ledger.next_a (id bigint)`, "")
	mig.AppendMigration("next_b", `SELECT pg_sleep(1.5); CREATE TABLE ledger.next_b (id bigint)`, "")
	if len(mig.Migrations) != n+2 {
		t.Fatalf("%d migrations", len(mig.Migrations))
	}
	// The next release's migrate writes its ledger.serves_version first (ledgerServes), as this
	// release's does, then runs its migrations.
	pgtest.Exec(t, s.pool, fmt.Sprintf(`CREATE OR REPLACE FUNCTION ledger.serves_version(p_version integer) RETURNS boolean
		LANGUAGE sql STABLE PARALLEL SAFE SET search_path = pg_catalog, pg_temp AS $$ SELECT p_version BETWEEN %d AND %d $$`,
		ledgerOldestServed, n+2))
	done := make(chan error, 1)
	go func() { done <- migrateLedger(ctx, conn, mig) }()
	var statuses []string
	bad := 0
	for finished := false; !finished; {
		select {
		case err := <-done:
			if err != nil {
				t.Fatalf("the next release's ledger migrations: %v", err)
			}
			finished = true
		default:
			h := old.call("GET", "/healthz", "", "", "")
			if h.status != 200 {
				bad++
				if len(statuses) < 3 {
					statuses = append(statuses, fmt.Sprintf("%d %s", h.status, strings.TrimSpace(h.body)))
				}
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	if h := old.call("GET", "/healthz", "", "", ""); h.status != 200 {
		t.Fatalf("/healthz after the next release's migrate: %d %s", h.status, h.body)
	}
	if bad > 0 {
		t.Errorf("while the next release's ledger migrations ran, this release's /healthz answered %d polls not 200, e.g. %v; "+
			"want 200 through the next release's migrate", bad, statuses)
	}
}

// TestPrivateClusterCommandOnANewerDatabase: docs/operations.md: "`serve`, `cleanup` and
// `principal create` refuse a database whose schema or functions belong to another release
// ..., with one exception: a database that a newer release migrated and that says it still
// serves this release ... There this release starts and serves as before". Without
// DATABASE_URL every command first migrates the private cluster (openDatabase: "the embedded
// default is always up to date"), and this release's migrate refused the newer database, so
// the command stopped before its check. The migrate is skipped for a newer database that
// serves this release now.
func TestPrivateClusterCommandOnANewerDatabase(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	c, stop, err := r2StartTempCluster(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(stop)
	env := map[string]string{"DATABASE_URL": "", "IDEM_DATA_DIR": c.Dir, "LISTEN_ADDR": "127.0.0.1:0", "CLEANUP_INTERVAL": "0"}
	getenv := func(k string) string { return env[k] }
	if out, errOut, err := runMain(t, []string{"migrate"}, getenv); err != nil {
		t.Fatalf("migrate the private cluster: %v\n%s%s", err, out, errOut)
	}
	owner, err := pgx.Connect(ctx, c.ConnString("postgres"))
	if err != nil {
		t.Fatal(err)
	}
	defer owner.Close(ctx)
	next, nextLedger := idem.SchemaVersion()+1, countMigrations(ledgerFS())+1
	if _, err := owner.Exec(ctx, fmt.Sprintf(`
		UPDATE idem.schema_version SET version = %[1]d;
		CREATE OR REPLACE FUNCTION idem.idem_version(OUT functions_version integer, OUT schema_version integer)
			LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
			AS $$ SELECT %[1]d, (SELECT v.version FROM idem.schema_version AS v) $$;
		CREATE OR REPLACE FUNCTION idem.idem_serves_version(p_version integer) RETURNS boolean
			LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$ SELECT p_version BETWEEN 5 AND %[1]d $$;
		UPDATE ledger.schema_version SET version = %[2]d;
		CREATE OR REPLACE FUNCTION ledger.serves_version(p_version integer) RETURNS boolean
			LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$ SELECT p_version BETWEEN 5 AND %[2]d $$`, next, nextLedger)); err != nil {
		t.Fatal(err)
	}
	if err := checkMigrated(ctx, owner); err != nil {
		t.Fatalf("checkMigrated on the newer private cluster: %v", err)
	}
	out, errOut, err := runMain(t, []string{"principal", "create", "carol"}, getenv)
	if err != nil {
		t.Errorf("`principal create` on the private cluster a newer release migrated (which serves this one): %v\n%s%s", err, out, errOut)
	}
}

func r2StartTempCluster(ctx context.Context) (*pgcluster.Cluster, func(), error) {
	return pgcluster.StartTemp(ctx, "newer-", map[string]string{"fsync": "off"})
}

// TestAnotherAppRoleServesThroughTheNextReleasesMigrate: with IDEM_APP_ROLE naming another
// role than idem_app (D152), the servers log in as members of that role alone; after the next
// release's migrate (which serves this one) /healthz stays 200 with its note.
func TestAnotherAppRoleServesThroughTheNextReleasesMigrate(t *testing.T) {
	t.Parallel()
	db := pgtest.NewEmptyDB(t)
	role := fmt.Sprintf("svc_app_%d", os.Getpid())
	t.Cleanup(func() {
		ctx := context.Background()
		c, err := pgx.Connect(ctx, db)
		if err != nil {
			return
		}
		defer c.Close(ctx)
		_, _ = c.Exec(ctx, `DROP OWNED BY `+role+`; DROP ROLE IF EXISTS `+role)
	})
	env := map[string]string{"IDEM_APP_ROLE": role}
	if out, errOut, err := runMain(t, []string{"migrate"}, serverEnv(db, env)); err != nil {
		t.Fatalf("migrate: %v\n%s%s", err, out, errOut)
	}
	login := pgtest.LoginRole(t, db, role)
	var log bytes.Buffer
	s := serveWith(t, login, db, env, &log)
	if h := s.call("GET", "/healthz", "", "", ""); h.status != 200 {
		t.Fatalf("/healthz before: %d %s", h.status, h.body)
	}
	asNextRelease(t, s, idem.SchemaVersion(), countMigrations(ledgerFS()))
	if h := s.call("GET", "/healthz", "", "", ""); h.status != 200 || !strings.Contains(h.body, "newer release") {
		t.Errorf("/healthz as a member of IDEM_APP_ROLE=%s after the next release's migrate: %d %s; want 200 with a note", role, h.status, h.body)
	}
	if err := checkMigrated(context.Background(), pgtest.Connect(t, login)); err != nil {
		t.Errorf("checkMigrated as a member of %s: %v", role, err)
	}
}

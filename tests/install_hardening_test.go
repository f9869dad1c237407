package tests

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/idem/idemmigrate"
	"github.com/pgidem/pgidem/internal/pgtest"
	"github.com/pgidem/pgidem/internal/release010"
	"github.com/pgidem/pgidem/internal/release020"
)

var scratchRoleSeq int

// scratchRole creates a role (name made unique in the cluster) with the given options, dropped
// (with what it owns and its grants in db) when the test ends.
func scratchRole(t *testing.T, db, prefix, opts string) string {
	t.Helper()
	scratchRoleSeq++
	name := fmt.Sprintf("%s_%d_%d", prefix, os.Getpid(), scratchRoleSeq)
	admin := pgtest.Connect(t, db)
	pgtest.Exec(t, admin, fmt.Sprintf(`CREATE ROLE %s %s PASSWORD 'scratch-secret'`, name, opts))
	t.Cleanup(func() {
		ctx := context.Background()
		c, err := pgx.Connect(ctx, db)
		if err != nil {
			return
		}
		defer c.Close(ctx)
		_, _ = c.Exec(ctx, `REASSIGN OWNED BY `+name+` TO current_user; DROP OWNED BY `+name+`; DROP ROLE `+name)
	})
	return name
}

// install020Bundle installs release 0.2.0's SQL API (its sql/idem.sql, from git history) into url.
func install020Bundle(t *testing.T, url string) {
	t.Helper()
	out, err := exec.Command("git", "-C", "..", "show", release020.Commit+":sql/idem.sql").Output()
	if err != nil {
		t.Fatalf("git show 0.2.0's sql/idem.sql: %v", err)
	}
	f := filepath.Join(t.TempDir(), "idem020.sql")
	if err := os.WriteFile(f, out, 0o644); err != nil {
		t.Fatal(err)
	}
	if b, err := psqlCommand(t, url, "-q", "-v", "ON_ERROR_STOP=1", "-f", f).CombinedOutput(); err != nil {
		t.Fatalf("0.2.0's sql/idem.sql: %v\n%s", err, b)
	}
}

// migrateURL runs idemmigrate.Migrate on a connection of its own to url.
func migrateURL(ctx context.Context, url string, opts idemmigrate.Options) error {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	return idemmigrate.Migrate(ctx, conn, opts)
}

// TestConcurrentMigratesFromEveryVersion: idemmigrate.Migrate "is safe to run any number of
// times and from several processes at once". Three connections migrate at once a fresh
// database, one of release 0.1.0 with stored keys, and one of release 0.2.0 with stored keys;
// all must succeed, the schema must be at Version(), and the stored keys must replay.
func TestConcurrentMigratesFromEveryVersion(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	for _, from := range []string{"fresh", "0.1.0", "0.2.0"} {
		url := pgtest.NewEmptyDB(t)
		conn := pgtest.Connect(t, url)
		switch from {
		case "0.1.0":
			if err := release010.Install(ctx, conn); err != nil {
				t.Fatal(err)
			}
			pgtest.Exec(t, conn, `INSERT INTO principals VALUES ('p_x', 'x')`)
			pgtest.Exec(t, conn, `SELECT idem.idem_save_final('p_x', 'k-old', 'POST /t', sha256('old'), '1 day', 422, '{}', 'no')`)
			if err := release010.Fill(ctx, conn, 3000); err != nil {
				t.Fatal(err)
			}
		case "0.2.0":
			install020Bundle(t, url)
			pgtest.Exec(t, conn, `SELECT idem.idem_save_final('p_x', 'k-old', 'POST /t', sha256('old'), '1 day', 422, '{}', 'no')`)
			pgtest.Exec(t, conn, `INSERT INTO idem.idempotency_keys (expires_at, attempt, action_hash, state,
				principal_id, key, request_sha256, response_status, response_headers, response_body)
				SELECT now() + interval '1 day', nextval('idem.attempt_seq'), 1, 'c', 'p_fill', 'fill-' || g,
				       sha256(g::text::bytea), 201, '{}', '\x00' FROM generate_series(1, 3000) AS g`)
		}
		var wg sync.WaitGroup
		errs := make([]error, 3)
		for i := range errs {
			wg.Add(1)
			go func() {
				defer wg.Done()
				errs[i] = migrateURL(ctx, url, idemmigrate.Options{})
			}()
		}
		wg.Wait()
		for i, err := range errs {
			if err != nil {
				t.Errorf("from %s: migrate %d of 3 at once: %v", from, i+1, err)
			}
		}
		if err := idem.CheckSchema(ctx, conn); err != nil {
			t.Errorf("from %s: after three migrates at once: %v", from, err)
		}
		if v := pgtest.Count(t, conn, `SELECT version FROM idem.schema_version`); v != idemmigrate.Version() {
			t.Errorf("from %s: schema version %d, want %d", from, v, idemmigrate.Version())
		}
		if from != "fresh" {
			var outcome string
			if err := conn.QueryRow(ctx, `SELECT outcome FROM idem.idem_begin('p_x', 'k-old', 'POST /t', sha256('old'))`).Scan(&outcome); err != nil || outcome != "replay" {
				t.Errorf("from %s: the key stored before: %q, %v", from, outcome, err)
			}
		}
	}
}

// TestFailedMigrateGivesBackTheLock: several processes "take turns on tern's advisory lock",
// and a failed migrate leaves the database as it was. A migrate that failed inside a migration
// (here the documented failure of an owner without the roles: 42501 with the hint) kept tern's
// session lock on its connection (tern released it in the aborted transaction, which failed):
// another migrate waited until that connection closed. It gives the turn back when it returns.
func TestFailedMigrateGivesBackTheLock(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.NewEmptyDB(t)
	owner := pgtest.OwnerRole(t, db)
	missing := fmt.Sprintf("missing_app_%d", os.Getpid())
	oconn := pgtest.Connect(t, owner)
	err := idemmigrate.Migrate(ctx, oconn, idemmigrate.Options{AppRole: missing})
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "42501" {
		t.Fatalf("migrate as an owner without the role %s: %v, want 42501", missing, err)
	}
	// The failed migrate's connection stays open (a pool's connection, a process that goes on).
	held := pgtest.Count(t, pgtest.Connect(t, db), `SELECT count(*) FROM pg_locks
		WHERE locktype = 'advisory' AND granted AND pid = $1`, int(oconn.PgConn().PID()))
	if held > 0 {
		t.Errorf("the failed migrate's connection still holds %d advisory lock(s) (tern's) after Migrate returned", held)
	}
	// Another process migrates with the default roles (which exist): it must not hang.
	ctx2, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	start := time.Now()
	if err := migrateURL(ctx2, owner, idemmigrate.Options{}); err != nil {
		t.Fatalf("another migrate after a failed one, whose connection is still open: %v after %v", err, time.Since(start).Round(time.Millisecond))
	}
}

// othersPrivileges lists every privilege in schema idem held by a role other than the objects' owner.
func othersPrivileges(t *testing.T, conn *pgx.Conn) string {
	t.Helper()
	rows, err := conn.Query(context.Background(), `
	SELECT kind || ' ' || what || ' ' || privilege_type || ' TO ' || grantee FROM (
	  SELECT 'schema' AS kind, n.nspname AS what, a.privilege_type, coalesce(r.rolname, 'PUBLIC') AS grantee
	    FROM pg_namespace n, aclexplode(coalesce(n.nspacl, acldefault('n', n.nspowner))) a LEFT JOIN pg_roles r ON r.oid = a.grantee
	   WHERE n.nspname = 'idem' AND a.grantee <> n.nspowner
	  UNION ALL
	  SELECT 'relation', c.oid::regclass::text, a.privilege_type, coalesce(r.rolname, 'PUBLIC')
	    FROM pg_class c, aclexplode(coalesce(c.relacl, acldefault(CASE WHEN c.relkind = 'S' THEN 's' ELSE 'r' END::"char", c.relowner))) a
	    LEFT JOIN pg_roles r ON r.oid = a.grantee
	   WHERE c.relnamespace = 'idem'::regnamespace AND c.relkind IN ('r', 'S', 'v', 'm', 'p') AND a.grantee <> c.relowner
	  UNION ALL
	  SELECT 'routine', p.oid::regprocedure::text, a.privilege_type, coalesce(r.rolname, 'PUBLIC')
	    FROM pg_proc p, aclexplode(coalesce(p.proacl, acldefault('f', p.proowner))) a
	    LEFT JOIN pg_roles r ON r.oid = a.grantee
	   WHERE p.pronamespace = 'idem'::regnamespace AND a.grantee <> p.proowner
	) g ORDER BY 1`)
	if err != nil {
		t.Fatal(err)
	}
	lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return strings.Join(lines, "\n")
}

// TestMigrateAsTheAppRoleChangesNothing: "run it as the role that should own schema idem
// (... not the services' role)". A login in idem_app that runs it must fail with a 42501 that
// names what it may not do, and change nothing: on a migrated database and on an empty one.
func TestMigrateAsTheAppRoleChangesNothing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.NewDB(t)
	admin := pgtest.Connect(t, db)
	before := catalog(t, admin) + othersPrivileges(t, admin)
	app := pgtest.Connect(t, pgtest.LoginRole(t, db, "idem_app"))
	err := idemmigrate.Migrate(ctx, app, idemmigrate.Options{})
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "42501" {
		t.Errorf("migrate as the app role on a migrated database: %v, want 42501", err)
	}
	if err == nil || !strings.Contains(err.Error(), "as the role that owns schema idem") {
		t.Errorf("migrate as the app role on a migrated database: %v; want it to say which role runs a migrate", err)
	}
	if after := catalog(t, admin) + othersPrivileges(t, admin); after != before {
		t.Errorf("the app role's failed migrate changed the catalog:\n--- before\n%s\n--- after\n%s", before, after)
	}

	empty := pgtest.NewEmptyDB(t)
	app2 := pgtest.Connect(t, pgtest.LoginRole(t, empty, "idem_app"))
	err = idemmigrate.Migrate(ctx, app2, idemmigrate.Options{})
	if !errors.As(err, &pgErr) || pgErr.Code != "42501" {
		t.Errorf("migrate as the app role on an empty database: %v, want 42501", err)
	}
	t.Logf("as the app role, empty database: %v", err)
	if n := pgtest.Count(t, pgtest.Connect(t, empty), `SELECT count(*) FROM pg_namespace WHERE nspname = 'idem'`); n != 0 {
		t.Error("the app role's failed migrate created schema idem")
	}
}

// TestDefaultPrivilegesDoNotOpenSchemaIdem: the services log in as roles that are members of
// idem_app, and "may call the API, and nothing else of schema idem"; the docs tell the owner to
// grant the service's own tables to the service's login role in the same migrate step, which
// owners commonly do with ALTER DEFAULT PRIVILEGES (every table the owner creates from now on).
// Such a default grant reached schema idem: the service's login read and wrote the key table,
// read the installation's secret, and called provider_key_prefixes, idem_key_body and
// idem_release_stuck. The install takes back what the owner's default privileges gave.
func TestDefaultPrivilegesDoNotOpenSchemaIdem(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.NewEmptyDB(t)
	ownerURL := pgtest.OwnerRole(t, db)
	ownerConn := pgtest.Connect(t, ownerURL)
	var owner string
	if err := ownerConn.QueryRow(ctx, `SELECT current_user`).Scan(&owner); err != nil {
		t.Fatal(err)
	}
	svc := scratchRole(t, db, "shop_login", "LOGIN IN ROLE idem_app")
	// The owner's migrate step: the service's tables, from now on, to the service's login.
	pgtest.Exec(t, ownerConn, fmt.Sprintf(`ALTER DEFAULT PRIVILEGES GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO %s;
		ALTER DEFAULT PRIVILEGES GRANT USAGE, SELECT ON SEQUENCES TO %[1]s;
		ALTER DEFAULT PRIVILEGES GRANT EXECUTE ON FUNCTIONS TO %[1]s`, svc))
	if err := idemmigrate.Migrate(ctx, ownerConn, idemmigrate.Options{}); err != nil {
		t.Fatal(err)
	}
	app := pgtest.Connect(t, pgtest.AsRole(t, db, svc, "scratch-secret"))
	for _, sql := range []string{
		`SELECT count(*) FROM idem.idempotency_keys`,
		`SELECT response_body FROM idem.idempotency_keys`,
		`UPDATE idem.idempotency_keys SET state = 'c' WHERE false`,
		`SELECT last_value FROM idem.installation_secret_1_1`,
		`SELECT secret_seqs FROM idem.installation_secrets`,
		`SELECT idem.provider_key_prefixes()`,
		`SELECT idem.installation_secret_values()`,
		`SELECT idem.idem_key_body('p', 'k')`,
		`SELECT idem.idem_release_stuck('p', 'k', 1)`,
		`SELECT * FROM idem.idem_stuck()`,
	} {
		_, err := app.Exec(ctx, sql)
		var pgErr *pgconn.PgError
		if err == nil || !errors.As(err, &pgErr) || pgErr.Code != "42501" {
			t.Errorf("the service's login (member of idem_app) ran %s: %v", sql, err)
		}
	}
	t.Logf("privileges in schema idem held by others than the owner:\n%s", othersPrivileges(t, ownerConn))
}

// TestMigrateUnderAHostileSearchPath: the installer's session took the database's search_path
// (ALTER DATABASE ... SET search_path = evil, public), where a schema another role controls
// holds functions that match a call more exactly than pg_catalog's (convert_to(text, text)
// beside convert_to(text, name)). Migration 006 called evil.convert_to as the owner, with the
// text whose sha256 is the installation's secret. The migrate pins its search_path: nothing of
// schema evil runs during the migrate, its re-install, or the API's calls.
func TestMigrateUnderAHostileSearchPath(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, ownerURL, calls := hostileSearchPath(t)
	oc := pgtest.Connect(t, ownerURL)
	if err := idemmigrate.Migrate(ctx, oc, idemmigrate.Options{}); err != nil {
		t.Fatalf("migrate under the hostile search_path: %v", err)
	}
	if err := idemmigrate.Migrate(ctx, oc, idemmigrate.Options{}); err != nil { // the re-install
		t.Fatalf("migrate again under the hostile search_path: %v", err)
	}
	var sp string
	if err := oc.QueryRow(ctx, `SHOW search_path`).Scan(&sp); err != nil || !strings.HasPrefix(sp, "evil") {
		t.Errorf("the session's search_path after Migrate: %q %v; want it put back", sp, err)
	}
	app := pgtest.Connect(t, pgtest.LoginRole(t, db, "idem_app"))
	d, err := idem.Begin(ctx, app, idem.Claim{Principal: "p", Key: "k", Action: "POST /x", Lease: time.Minute,
		Fingerprint: idem.ComputeFingerprint("POST", "/x", nil).Sum})
	if err != nil || d.Outcome != idem.Claimed {
		t.Fatalf("a claim: %+v %v", d, err)
	}
	calls()
}

// TestBundleUnderAHostileSearchPath: sql/idem.sql, run with psql as the owner under the same
// hostile search_path as TestMigrateUnderAHostileSearchPath, ran schema evil's convert_to as the
// owner too; it pins its session's search_path first.
func TestBundleUnderAHostileSearchPath(t *testing.T) {
	t.Parallel()
	_, ownerURL, calls := hostileSearchPath(t)
	for range 2 { // the install, and a second run that re-installs the functions
		if b, err := psqlCommand(t, ownerURL, "-q", "-v", "ON_ERROR_STOP=1", "-f", "../sql/idem.sql").CombinedOutput(); err != nil {
			t.Fatalf("sql/idem.sql as the owner: %v\n%s", err, b)
		}
	}
	calls()
}

// hostileSearchPath makes an empty database whose search_path (ALTER DATABASE) names first a
// schema evil of another login, mallory, that holds functions matching calls of the install more
// exactly than pg_catalog's (format, convert_to, hashtextextended), each recording its call.
// It returns the database, its owner (not a superuser) and a check that fails the test when
// any of them ran. The overloads are checked to be reachable from the owner's session first.
func hostileSearchPath(t *testing.T) (db, ownerURL string, check func()) {
	t.Helper()
	ctx := context.Background()
	db = pgtest.NewEmptyDB(t)
	admin := pgtest.Connect(t, db)
	var dbname string
	if err := admin.QueryRow(ctx, `SELECT current_database()`).Scan(&dbname); err != nil {
		t.Fatal(err)
	}
	mallory := scratchRole(t, db, "mallory", "LOGIN")
	pgtest.Exec(t, admin, fmt.Sprintf(`CREATE SCHEMA evil AUTHORIZATION %s`, mallory))
	mal := pgtest.Connect(t, pgtest.AsRole(t, db, mallory, "scratch-secret"))
	pgtest.Exec(t, mal, `CREATE TABLE evil.calls (fn text, who text, arg text)`)
	pgtest.Exec(t, mal, `GRANT INSERT ON evil.calls TO PUBLIC; GRANT USAGE ON SCHEMA evil TO PUBLIC`)
	for _, sig := range []string{"text, text", "text, bigint[]", "text, integer", "text, regclass", "text, name"} {
		pgtest.Exec(t, mal, fmt.Sprintf(`CREATE FUNCTION evil.format(f text, a %s) RETURNS text LANGUAGE plpgsql AS $$
			BEGIN
				INSERT INTO evil.calls VALUES ('format(%s)', current_user, left(a::text, 60));
				RETURN pg_catalog.format(f, a);
			END $$`, sig, sig))
	}
	pgtest.Exec(t, mal, `CREATE FUNCTION evil.convert_to(s text, e text) RETURNS bytea LANGUAGE plpgsql AS $$
			BEGIN
				INSERT INTO evil.calls VALUES ('convert_to(text, text)', current_user, left(s, 120));
				RETURN pg_catalog.convert_to(s, e::name);
			END $$`)
	pgtest.Exec(t, mal, `CREATE FUNCTION evil.hashtextextended(s text, seed integer) RETURNS bigint LANGUAGE plpgsql AS $$
			BEGIN
				INSERT INTO evil.calls VALUES ('hashtextextended(text, integer)', current_user, left(s, 60));
				RETURN pg_catalog.hashtextextended(s, seed);
			END $$`)
	pgtest.Exec(t, mal, `GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA evil TO PUBLIC`)
	ownerURL = pgtest.OwnerRole(t, db)
	pgtest.Exec(t, admin, fmt.Sprintf(`ALTER DATABASE %s SET search_path = evil, public`, dbname))

	// The hostile overloads are reachable from the owner's session (else the test proves nothing).
	probe := pgtest.Connect(t, ownerURL)
	var probed string
	if err := probe.QueryRow(ctx, `SELECT format('%s', 'x'::text) || encode(convert_to('a', 'UTF8'), 'hex') || hashtextextended('a', 0)`).Scan(&probed); err != nil {
		t.Fatal(err)
	}
	if n := pgtest.Count(t, admin, `SELECT count(DISTINCT fn) FROM evil.calls
		WHERE fn IN ('convert_to(text, text)', 'hashtextextended(text, integer)')`); n != 2 {
		t.Fatalf("setup: the owner's plain calls of convert_to and hashtextextended reached schema evil's %d of them, want both", n)
	}
	pgtest.Exec(t, admin, `DELETE FROM evil.calls`)
	return db, ownerURL, func() {
		t.Helper()
		rows, err := admin.Query(ctx, `SELECT fn || ' as ' || who || ': ' || coalesce(arg, 'NULL') FROM evil.calls`)
		if err != nil {
			t.Fatal(err)
		}
		calls, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		// What the hostile code saw as the owner: the text whose sha256 is the installation secret?
		leaked := pgtest.Count(t, admin, `SELECT count(*) FROM evil.calls AS c
			WHERE c.fn = 'convert_to(text, text)'
			  AND ('x' || encode(substr(sha256(pg_catalog.convert_to(c.arg, 'UTF8')), 1, 8), 'hex'))::bit(64)::bigint
			      = pg_sequence_last_value('idem.installation_secret_1_1')`)
		if leaked > 0 {
			t.Errorf("schema evil's code was handed the installation secret's source (its sha256 is idem.installation_secret_1_1's value)")
		}
		if len(calls) > 0 {
			t.Errorf("code of schema evil (owned by %s) ran %d times, e.g.:\n%s", mallory, len(calls), strings.Join(calls[:min(len(calls), 6)], "\n"))
		}
	}
}

// TestNewerDatabaseIsLeftAlone: "a database newer than the file is refused and nothing
// changes". A database at schema version Version()+1 whose later release contracted migration
// 007's columns (dropped them) got them back from Migrate's online step, under the key table's
// ACCESS EXCLUSIVE lock, before tern refused the version. It is refused first, with an error
// that says it is newer, and left exactly as it was.
func TestNewerDatabaseIsLeftAlone(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.NewDB(t)
	conn := pgtest.Connect(t, db)
	pgtest.Exec(t, conn, `ALTER TABLE idem.idempotency_keys DROP COLUMN recovery_point, DROP COLUMN recovery_saved`)
	pgtest.Exec(t, conn, `UPDATE idem.schema_version SET version = $1`, idemmigrate.Version()+1)
	before := catalog(t, conn) + othersPrivileges(t, conn)
	err := idemmigrate.Migrate(ctx, conn, idemmigrate.Options{})
	if err == nil {
		t.Fatal("Migrate accepted a database of a newer schema version")
	}
	t.Logf("Migrate on a database at version %d: %v", idemmigrate.Version()+1, err)
	if after := catalog(t, conn) + othersPrivileges(t, conn); after != before {
		t.Errorf("Migrate changed a database of a newer version before refusing it:\n--- before\n%s\n--- after\n%s", before, after)
	}
	if v := pgtest.Count(t, conn, `SELECT version FROM idem.schema_version`); v != idemmigrate.Version()+1 {
		t.Errorf("version %d after the refusal", v)
	}
}

// TestMigrateBesideALongClaim: "no step that grows with the table holds a lock the functions
// wait on", and a migrate that cannot get the key table's lock waits a bounded time. A claim of
// release 0.2.0 stays open in its transaction (a unit of work of 30 s); this tree's migrate
// runs beside it (its online step for 007 needs the key table's ACCESS EXCLUSIVE lock). New
// claims of 0.2.0 meanwhile must not wait behind the migrate's lock request for more than a
// few tens of milliseconds; once the claim commits, the migrate (run again after being cut by
// its context) completes and the key replays. On a database that is already up to date, the
// migrate must not wait for the claim at all.
func TestMigrateBesideALongClaim(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for _, from := range []string{"0.2.0", "current"} {
		url := pgtest.NewEmptyDB(t)
		admin := pgtest.Connect(t, url)
		if from == "0.2.0" {
			install020Bundle(t, url)
		} else if err := idemmigrate.Migrate(ctx, admin, idemmigrate.Options{}); err != nil {
			t.Fatal(err)
		}
		holder := pgtest.Connect(t, url)
		tx, err := holder.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		var attempt int64
		if err := tx.QueryRow(ctx, `SELECT attempt FROM idem.idem_begin('p', 'long', 'POST /x', sha256('long'))`).Scan(&attempt); err != nil {
			t.Fatal(err)
		}
		mctx, cancel := context.WithTimeout(ctx, 3*time.Second)
		done := make(chan error, 1)
		start := time.Now()
		go func() { done <- migrateURL(mctx, url, idemmigrate.Options{}) }()
		claimer := pgtest.Connect(t, url)
		var slowest time.Duration
		n, slow := 0, 0
		for time.Since(start) < 2500*time.Millisecond {
			t0 := time.Now()
			_, err := claimer.Exec(ctx, `SELECT idem.idem_begin('p', $1, 'POST /x', sha256('x'), p_lease => interval '1 minute')`, fmt.Sprintf("k%d", n))
			d := time.Since(t0)
			if err != nil {
				t.Errorf("from %s: a claim beside the migrate: %v after %v", from, err, d)
				break
			}
			slowest = max(slowest, d)
			if d > 100*time.Millisecond {
				slow++
			}
			n++
			time.Sleep(5 * time.Millisecond)
		}
		err = <-done
		cancel()
		t.Logf("from %s: %d claims beside the migrate, %d over 100 ms, slowest %v; migrate beside the open claim: %v after %v",
			from, n, slow, slowest, err, time.Since(start).Round(time.Millisecond))
		// Behind the migrate's lock request a claim waits at most its 20 ms lock timeout, and
		// one in three meets one. A claim's round trip on a loaded machine can take 150 ms
		// now and then (the claims run one after the other, so a stall slows one or two); a
		// lock asked for with a longer timeout slows a good share of them, and one asked for
		// without a timeout holds a claim for the whole migrate (3 s).
		if slowest > time.Second || slow > n/20 {
			t.Errorf("from %s: %d of %d claims waited over 100 ms, the slowest %v, behind the migrate", from, slow, n, slowest)
		}
		if from == "current" && err != nil {
			t.Errorf("from %s: a migrate of an up-to-date database waited for an open claim: %v", from, err)
		}
		if _, err := tx.Exec(ctx, `SELECT idem.idem_complete('p', 'long', $1, 201, '{}', 'done')`, attempt); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		if err := migrateURL(ctx, url, idemmigrate.Options{}); err != nil {
			t.Fatalf("from %s: migrate once the claim committed: %v", from, err)
		}
		var outcome string
		if err := admin.QueryRow(ctx, `SELECT outcome FROM idem.idem_begin('p', 'long', 'POST /x', sha256('long'))`).Scan(&outcome); err != nil || outcome != "replay" {
			t.Errorf("from %s: the long claim's answer after the migrate: %q %v", from, outcome, err)
		}
	}
}

// TestVersionIsTheDatabasesVersion: Version() is "the schema version Migrate brings a
// database to (idem.SchemaVersion)": after Migrate, idem.schema_version and idem_version()
// report it, for the functions and the schema alike.
func TestVersionIsTheDatabasesVersion(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	conn := pgtest.Connect(t, pgtest.NewEmptyDB(t))
	if err := idemmigrate.Migrate(ctx, conn, idemmigrate.Options{}); err != nil {
		t.Fatal(err)
	}
	var fv, sv, tv int
	if err := conn.QueryRow(ctx, `SELECT functions_version, schema_version, (SELECT version FROM idem.schema_version) FROM idem.idem_version()`).Scan(&fv, &sv, &tv); err != nil {
		t.Fatal(err)
	}
	if v := idemmigrate.Version(); fv != v || sv != v || tv != v || idem.SchemaVersion() != v {
		t.Errorf("Version() %d, idem.SchemaVersion() %d, idem_version() (%d, %d), schema_version %d", v, idem.SchemaVersion(), fv, sv, tv)
	}
}

// TestMigrateBesideANewInstallationSecret: the owner's other lever, CALL
// idem.idem_new_installation_secret(), rewrites some of the functions a migrate installs
// (publish_secrets, ALTER FUNCTION idem_begin). Run at once (a copy of a database given its
// secret while a deploy's migrate runs), about one run in seven failed with PostgreSQL's
// internal "tuple concurrently updated". The procedure takes tern's advisory lock: they take
// turns.
func TestMigrateBesideANewInstallationSecret(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.NewDB(t)
	deadline := time.Now().Add(4 * time.Second)
	var wg sync.WaitGroup
	var mu sync.Mutex
	var bad []string
	note := func(who string, err error) {
		var pgErr *pgconn.PgError
		if err != nil && (!errors.As(err, &pgErr) || pgErr.Code == "XX000") {
			mu.Lock()
			bad = append(bad, who+": "+err.Error())
			mu.Unlock()
		}
	}
	runs := [2]int{}
	wg.Add(2)
	go func() {
		defer wg.Done()
		for time.Now().Before(deadline) {
			note("migrate", migrateURL(ctx, url, idemmigrate.Options{}))
			runs[0]++
		}
	}()
	go func() {
		defer wg.Done()
		c, err := pgx.Connect(ctx, url)
		if err != nil {
			note("connect", err)
			return
		}
		defer c.Close(ctx)
		for time.Now().Before(deadline) {
			_, err := c.Exec(ctx, `CALL idem.idem_new_installation_secret(p_wait => interval '2 seconds')`)
			note("idem_new_installation_secret", err)
			runs[1]++
		}
	}()
	wg.Wait()
	t.Logf("%d migrates, %d new secrets", runs[0], runs[1])
	migrates := 0
	for _, b := range bad {
		if strings.HasPrefix(b, "migrate") {
			migrates++
			if migrates == 1 {
				t.Logf("e.g. %s", b)
			}
		}
	}
	if len(bad) > 0 {
		t.Errorf("%d of them (%d migrates) failed with an internal error, e.g.:\n%s", len(bad), migrates, strings.Join(bad[:min(len(bad), 4)], "\n"))
	}
}

// TestUpgradeFrom010UnderAHostileSearchPath: the same as TestMigrateUnderAHostileSearchPath
// on the upgrade from 0.1.0: the online rebuild (idem.rebuild_003, a procedure, which cannot pin
// its search_path with a SET clause) called a function of another role's schema that
// overloads hashtextextended(text, bigint) as hashtextextended(text, integer), once per key.
func TestUpgradeFrom010UnderAHostileSearchPath(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.NewEmptyDB(t)
	admin := pgtest.Connect(t, db)
	if err := release010.Install(ctx, admin); err != nil {
		t.Fatal(err)
	}
	if err := release010.Fill(ctx, admin, 50); err != nil {
		t.Fatal(err)
	}
	var dbname string
	if err := admin.QueryRow(ctx, `SELECT current_database()`).Scan(&dbname); err != nil {
		t.Fatal(err)
	}
	mallory := scratchRole(t, db, "mallory", "LOGIN")
	pgtest.Exec(t, admin, fmt.Sprintf(`CREATE SCHEMA evil AUTHORIZATION %s`, mallory))
	mal := pgtest.Connect(t, pgtest.AsRole(t, db, mallory, "scratch-secret"))
	pgtest.Exec(t, mal, `CREATE TABLE evil.calls (fn text, who text, arg text)`)
	pgtest.Exec(t, mal, `GRANT INSERT ON evil.calls TO PUBLIC; GRANT USAGE ON SCHEMA evil TO PUBLIC`)
	pgtest.Exec(t, mal, `CREATE FUNCTION evil.hashtextextended(s text, seed integer) RETURNS bigint LANGUAGE plpgsql AS $$
			BEGIN
				INSERT INTO evil.calls VALUES ('hashtextextended(text, integer)', current_user, left(s, 60));
				RETURN pg_catalog.hashtextextended(s, seed);
			END $$`)
	pgtest.Exec(t, mal, `GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA evil TO PUBLIC`)
	pgtest.Exec(t, admin, fmt.Sprintf(`ALTER DATABASE %s SET search_path = evil, public`, dbname))
	if err := migrateURL(ctx, db, idemmigrate.Options{}); err != nil {
		t.Fatal(err)
	}
	rows, err := admin.Query(ctx, `SELECT fn || ' as ' || who FROM evil.calls`)
	if err != nil {
		t.Fatal(err)
	}
	calls, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	if len(calls) > 0 {
		t.Errorf("schema evil's code ran %d times during the upgrade from 0.1.0, e.g. %s", len(calls), calls[0])
	}
}

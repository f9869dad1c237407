package idemmigrate_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/idem/idemmigrate"
	"github.com/pgidem/pgidem/internal/pgtest"
	"github.com/pgidem/pgidem/internal/release010"
	"github.com/pgidem/pgidem/internal/release020"
)

// schemaSnapshot describes schema idem: its relations, the key table's columns, the
// triggers on the key table, its routines, its version.
func schemaSnapshot(t *testing.T, conn *pgx.Conn) string {
	t.Helper()
	ctx := context.Background()
	var parts []string
	for _, q := range []string{
		`SELECT 'rel ' || relname || ' ' || relkind::text FROM pg_class WHERE relnamespace = 'idem'::regnamespace ORDER BY 1`,
		`SELECT 'col ' || attname FROM pg_attribute WHERE attrelid = 'idem.idempotency_keys'::regclass AND attnum > 0 AND NOT attisdropped ORDER BY 1`,
		`SELECT 'trg ' || tgname FROM pg_trigger WHERE tgrelid = 'idem.idempotency_keys'::regclass AND NOT tgisinternal ORDER BY 1`,
		`SELECT 'fn ' || p.oid::regprocedure::text || ' ' || md5(p.prosrc) FROM pg_proc p WHERE pronamespace = 'idem'::regnamespace ORDER BY 1`,
		`SELECT 'version ' || version FROM idem.schema_version`,
	} {
		rows, err := conn.Query(ctx, q)
		if err != nil {
			t.Fatal(err)
		}
		lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		parts = append(parts, lines...)
	}
	return strings.Join(parts, "\n")
}

func snapshotDiff(before, after string) (added, removed []string) {
	b, a := map[string]bool{}, map[string]bool{}
	for _, l := range strings.Split(before, "\n") {
		b[l] = true
	}
	for _, l := range strings.Split(after, "\n") {
		a[l] = true
		if !b[l] {
			added = append(added, l)
		}
	}
	for l := range b {
		if !a[l] {
			removed = append(removed, l)
		}
	}
	return added, removed
}

// install020 installs release 0.2.0's sql/idem.sql (from git history) into url.
func install020(t *testing.T, url string) {
	t.Helper()
	out, err := exec.Command("git", "-C", "../..", "show", release020.Commit+":sql/idem.sql").Output()
	if err != nil {
		t.Fatalf("git show 0.2.0's sql/idem.sql: %v", err)
	}
	f := filepath.Join(t.TempDir(), "idem020.sql")
	if err := os.WriteFile(f, out, 0o644); err != nil {
		t.Fatal(err)
	}
	pgtest.Psql(t, url, "-q", "-f", f)
}

// TestFailedMigrateLeavesVersionAndFunctions: Migrate's transaction fails (migration 006 meets
// a table of its name already there) on a database of release 0.2.0 and one of 0.1.0. The
// version and every function that was there are as they were; what was added is only what
// the online steps before the transaction commit on their own (Migrate's doc, docs/operations.md
// "Upgrades"); and once the obstacle is gone the next Migrate goes on from it and completes.
// The doc said "an interruption leaves the database as it was", which those steps break.
func TestFailedMigrateLeavesVersionAndFunctions(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	online := map[string][]string{
		"0.2.0": {"col recovery_point", "col recovery_saved"},
		"0.1.0": {"_v3", "rebuild_003", "attempt_seq", "copy_to_v3", "v3_row"},
	}
	for _, from := range []string{"0.2.0", "0.1.0"} {
		t.Run(from, func(t *testing.T) {
			url := pgtest.NewEmptyDB(t)
			conn := pgtest.Connect(t, url)
			switch from {
			case "0.1.0":
				if err := release010.Install(ctx, conn); err != nil {
					t.Fatal(err)
				}
				if err := release010.Fill(ctx, conn, 200); err != nil {
					t.Fatal(err)
				}
			case "0.2.0":
				install020(t, url)
			}
			// Something in the way of migration 006: the migrate's transaction fails.
			pgtest.Exec(t, conn, `CREATE TABLE idem.installation_secrets (x int)`)
			before := schemaSnapshot(t, conn)
			err := idemmigrate.Migrate(ctx, conn, idemmigrate.Options{})
			if err == nil {
				t.Fatal("Migrate succeeded over a table in the way of migration 006")
			}
			after := schemaSnapshot(t, conn)
			added, removed := snapshotDiff(before, after)
			if len(removed) > 0 {
				t.Errorf("a Migrate that failed (%v) changed or removed what a %s database had:\n  %s", err, from, strings.Join(removed, "\n  "))
			}
			for _, l := range added {
				ok := false
				for _, o := range online[from] {
					ok = ok || strings.Contains(l, o)
				}
				if !ok {
					t.Errorf("a Migrate that failed (%v) added %q to a %s database, which is no online step's", err, l, from)
				}
			}
			pgtest.Exec(t, conn, `DROP TABLE idem.installation_secrets`)
			if err := idemmigrate.Migrate(ctx, conn, idemmigrate.Options{}); err != nil {
				t.Fatalf("the next Migrate: %v", err)
			}
			if err := idem.CheckSchema(ctx, conn); err != nil {
				t.Errorf("after the next Migrate: %v", err)
			}
		})
	}
}

// TestCancelledMigrateRunsAgain: a Migrate of a fresh database whose context ends at
// several points, then a Migrate to completion: the second succeeds, the schema is complete,
// and the connection of the cut one holds no advisory lock (when it is still open) nor keeps
// a changed search_path. Pins "an interruption leaves the version and the functions as they
// were ... safe to run
// any number of times".
func TestCancelledMigrateRunsAgain(t *testing.T) {
	t.Parallel()
	cuts := 0
	for _, d := range []time.Duration{5 * time.Millisecond, 30 * time.Millisecond, 80 * time.Millisecond, 150 * time.Millisecond, 300 * time.Millisecond} {
		url := pgtest.NewEmptyDB(t)
		conn := pgtest.Connect(t, url)
		pgtest.Exec(t, conn, `SET search_path = public`)
		ctx, cancel := context.WithTimeout(context.Background(), d)
		err := idemmigrate.Migrate(ctx, conn, idemmigrate.Options{})
		cancel()
		if err != nil {
			cuts++
			if !conn.IsClosed() {
				var sp string
				if err := conn.QueryRow(context.Background(), `SHOW search_path`).Scan(&sp); err != nil {
					t.Fatalf("cut at %v: the connection is open but unusable: %v", d, err)
				}
				if sp != "public" {
					t.Errorf("cut at %v: search_path is %q after Migrate returned, want public", d, sp)
				}
				if n := pgtest.Count(t, pgtest.Connect(t, url), `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = $1`,
					int(conn.PgConn().PID())); n != 0 {
					t.Errorf("cut at %v: the connection still holds %d advisory locks", d, n)
				}
			}
		}
		c2 := pgtest.Connect(t, url)
		// Bounded: a lock the cut one left held would keep it waiting without end (D268).
		again, stop := context.WithTimeout(context.Background(), time.Minute)
		err = idemmigrate.Migrate(again, c2, idemmigrate.Options{})
		stop()
		if err != nil {
			t.Fatalf("cut at %v, then again: %v", d, err)
		}
		if err := idem.CheckSchema(context.Background(), c2); err != nil {
			t.Fatalf("cut at %v, then again: %v", d, err)
		}
	}
	if cuts == 0 {
		t.Fatal("no migrate was cut")
	}
}

// TestConcurrentMigratesAsOwner: two Migrates at once, as a non-superuser
// owner, on a fresh database, both with the same custom AppRole/OperatorRole (created by a
// superuser first): both succeed, and the custom app role may call the API.
func TestConcurrentMigratesAsOwner(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.NewEmptyDB(t)
	owner := pgtest.OwnerRole(t, url)
	var wg sync.WaitGroup
	errs := make([]error, 2)
	for i := range errs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c, err := pgx.Connect(ctx, owner)
			if err != nil {
				errs[i] = err
				return
			}
			defer c.Close(ctx)
			errs[i] = idemmigrate.Migrate(ctx, c, idemmigrate.Options{})
		}()
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Errorf("migrate %d of 2 at once as the owner: %v", i+1, err)
		}
	}
	app := pgtest.LoginRole(t, url, idemmigrate.DefaultAppRole)
	ac := pgtest.Connect(t, app)
	if err := idem.CheckSchema(ctx, ac); err != nil {
		t.Fatalf("the app role after two migrates at once: %v", err)
	}
	tx, err := ac.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	var outcome string
	if err := tx.QueryRow(ctx, `SELECT outcome FROM idem.idem_begin('p', 'k', 'POST /x', sha256('b'))`).Scan(&outcome); err != nil || outcome != "claimed" {
		t.Fatalf("idem_begin as the app role: %q %v", outcome, err)
	}
	_ = fmt.Sprint()
}

// TestMissingRoleHintEndsTheError: Migrate's doc: "When a role is missing and conn's
// role may not create it, the error (SQLSTATE 42501) carries a hint that names the superuser
// step; the error's text ends with it, "(hint: ...)"." Tried for a missing operator role and a
// missing app role, on an empty database (the migrations create roles) and on a migrated one
// (the install creates them), as an owner without CREATEROLE.
func TestMissingRoleHintEndsTheError(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for _, c := range []struct {
		name     string
		migrated bool
		opts     func(missing string) idemmigrate.Options
	}{
		{"operator/empty", false, func(m string) idemmigrate.Options { return idemmigrate.Options{OperatorRole: m} }},
		{"operator/migrated", true, func(m string) idemmigrate.Options { return idemmigrate.Options{OperatorRole: m} }},
		{"app/migrated", true, func(m string) idemmigrate.Options { return idemmigrate.Options{AppRole: m} }},
	} {
		t.Run(c.name, func(t *testing.T) {
			url := pgtest.NewEmptyDB(t)
			owner := pgtest.OwnerRole(t, url)
			if c.migrated {
				// Migrated by the owner first, with the default roles (which exist).
				if err := migrateAs(ctx, owner); err != nil {
					t.Fatal(err)
				}
			}
			missing := fmt.Sprintf("missing_role_%d_%d", os.Getpid(), time.Now().UnixNano()%1e6)
			conn := pgtest.Connect(t, owner)
			err := idemmigrate.Migrate(ctx, conn, c.opts(missing))
			if err == nil {
				t.Fatalf("Migrate with the missing role %s succeeded as an owner without CREATEROLE", missing)
			}
			msg := err.Error()
			_, hint, ok := strings.Cut(msg, "(hint: ")
			if !ok || !strings.HasSuffix(msg, ")") || !strings.Contains(hint, missing) || !strings.Contains(msg, "42501") {
				t.Errorf("error %q: want SQLSTATE 42501 ending with \"(hint: ...)\" naming %s", msg, missing)
			}
		})
	}
}

func migrateAs(ctx context.Context, url string) error {
	c, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer c.Close(ctx)
	return idemmigrate.Migrate(ctx, c, idemmigrate.Options{})
}

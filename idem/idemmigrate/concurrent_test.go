package idemmigrate_test

import (
	"context"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/idem/idemmigrate"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestFirstInstallsInTwoDatabasesAtOnce: two services' first installs in two databases of one
// cluster at once (or two test packages against one TEST_DATABASE_URL). The roles are the
// cluster's and tern's advisory lock is the database's, so both may find the role missing and
// create it: the second waited on the first's row and failed with 23505 (D245). Both install
// now, in every round.
func TestFirstInstallsInTwoDatabasesAtOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for round := 0; round < 4; round++ {
		opts := idemmigrate.Options{
			AppRole:      fmt.Sprintf("race_app_%d_%d", os.Getpid(), round),
			OperatorRole: fmt.Sprintf("race_op_%d_%d", os.Getpid(), round),
		}
		// registered before the databases are made, so run after they are dropped (cleanups
		// run last first): the roles hold nothing then, and drop
		admin := pgtest.Connect(t, pgtest.NewEmptyDB(t))
		t.Cleanup(func() {
			if _, err := admin.Exec(context.Background(), `DROP ROLE IF EXISTS "`+opts.AppRole+`", "`+opts.OperatorRole+`"`); err != nil {
				t.Errorf("drop the test's roles: %v", err)
			}
		})
		urls := []string{pgtest.NewEmptyDB(t), pgtest.NewEmptyDB(t)}
		conns := []*pgx.Conn{pgtest.Connect(t, urls[0]), pgtest.Connect(t, urls[1])}
		for i, err := range migrateAtOnce(ctx, conns, opts) {
			if err != nil {
				t.Fatalf("round %d: the first install in database %d of 2, at once: %v", round, i+1, err)
			}
			if n := pgtest.Count(t, conns[i], `SELECT count(*) FROM pg_roles WHERE rolname IN ('`+opts.AppRole+`', '`+opts.OperatorRole+`')`); n != 2 {
				t.Fatalf("round %d: database %d sees %d of the two roles", round, i+1, n)
			}
			if n := pgtest.Count(t, conns[i], `SELECT count(*) FROM pg_proc WHERE proname = 'idem_version'
				AND has_function_privilege('`+opts.AppRole+`', oid, 'EXECUTE')`); n != 1 {
				t.Fatalf("round %d: database %d: the application role may not call the functions", round, i+1)
			}
		}
	}
}

// TestMigratesTakeTurnsUnderADatabaseLockTimeout: a lock_timeout the database sets (a DBA's
// guard rail, as a statement_timeout is) cut the wait of the second and third of three
// migrates at once for their turn (55P03, D245). Migrate lifts it while it runs, and puts it
// back.
func TestMigratesTakeTurnsUnderADatabaseLockTimeout(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.NewEmptyDB(t)
	admin := pgtest.Connect(t, url)
	pgtest.Exec(t, admin, `DO $$ BEGIN EXECUTE format('ALTER DATABASE %I SET lock_timeout = ''200ms''', current_database()); END $$`)
	conns := make([]*pgx.Conn, 3)
	for i := range conns {
		conns[i] = pgtest.Connect(t, url)
	}
	for i, err := range migrateAtOnce(ctx, conns, idemmigrate.Options{}) {
		if err != nil {
			t.Errorf("migrate %d of 3 at once, the database's lock_timeout 200ms: %v", i+1, err)
		}
		var lt string
		if err := conns[i].QueryRow(ctx, `SELECT current_setting('lock_timeout')`).Scan(&lt); err != nil || lt != "200ms" {
			t.Errorf("migrate %d: lock_timeout %q after it (%v); want the session's 200ms back", i+1, lt, err)
		}
	}
}

// TestMigrateRefusesAConnectionInATransaction: Migrate's first online step would commit the
// caller's open transaction (its CREATE TABLE survived the caller's ROLLBACK, and Migrate
// returned nil). It refuses now, and changes nothing (D245).
func TestMigrateRefusesAConnectionInATransaction(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.NewEmptyDB(t)
	conn := pgtest.Connect(t, url)
	pgtest.Exec(t, conn, `BEGIN; CREATE TABLE mine (x int)`)
	err := idemmigrate.Migrate(ctx, conn, idemmigrate.Options{})
	if err == nil || !strings.Contains(err.Error(), "in a transaction") {
		t.Fatalf("Migrate inside the caller's transaction: %v; want it refused", err)
	}
	pgtest.Exec(t, conn, `ROLLBACK`)
	other := pgtest.Connect(t, url)
	if n := pgtest.Count(t, other, `SELECT count(*) FROM pg_class WHERE relname = 'mine' OR relnamespace = to_regnamespace('idem')`); n != 0 {
		t.Fatalf("%d relations of the caller's transaction or of schema idem after the refusal and the caller's ROLLBACK; want none", n)
	}
	if err := idemmigrate.Migrate(ctx, conn, idemmigrate.Options{}); err != nil {
		t.Fatalf("Migrate after the caller's ROLLBACK: %v", err)
	}
}

// migrateAtOnce runs Migrate on every connection at once (released together from a barrier)
// and returns their errors.
func migrateAtOnce(ctx context.Context, conns []*pgx.Conn, opts idemmigrate.Options) []error {
	errs := make([]error, len(conns))
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i := range conns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			errs[i] = idemmigrate.Migrate(ctx, conns[i], opts)
		}()
	}
	close(start)
	wg.Wait()
	return errs
}

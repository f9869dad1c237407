package tests

import (
	"context"
	"fmt"
	"os"
	"testing"

	"github.com/pgidem/pgidem/idem/idemmigrate"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestMigrateRestoresSearchPath: Migrate "puts the session's value back when it returns"
// (D191), after success and after each failure.
func TestMigrateRestoresSearchPath(t *testing.T) {
	ctx := context.Background()
	db := pgtest.NewDB(t)
	conn := pgtest.Connect(t, db)
	pgtest.Exec(t, conn, `CREATE SCHEMA callerapp`)
	pgtest.Exec(t, conn, `SET search_path = callerapp, "$user", public`)
	var before string
	read := func() string {
		var s string
		if err := conn.QueryRow(ctx, `SHOW search_path`).Scan(&s); err != nil {
			t.Fatal(err)
		}
		return s
	}
	before = read()
	if err := idemmigrate.Migrate(ctx, conn, idemmigrate.Options{}); err != nil {
		t.Fatal(err)
	}
	if got := read(); got != before {
		t.Errorf("after a migrate that succeeded: search_path %q, want %q", got, before)
	}
	// A migrate that fails in its transaction (an app role that does not exist, which the
	// owner may not create: here the superuser can; use a name that is refused instead).
	err := idemmigrate.Migrate(ctx, conn, idemmigrate.Options{AppRole: fmt.Sprintf("rv_missing_%d", os.Getpid()), OperatorRole: "pg_monitor"})
	t.Logf("failing migrate: %v", err)
	if got := read(); got != before {
		t.Errorf("after a migrate that failed (%v): search_path %q, want %q", err, got, before)
	}
	pgtest.Exec(t, conn, `UPDATE idem.schema_version SET version = $1`, idemmigrate.Version()+1)
	err = idemmigrate.Migrate(ctx, conn, idemmigrate.Options{})
	if err == nil {
		t.Fatal("a newer database was migrated")
	}
	if got := read(); got != before {
		t.Errorf("after a refused newer database: search_path %q, want %q", got, before)
	}
	// The caller's own session lock on tern's number, held around a migrate that fails.
	pgtest.Exec(t, conn, `UPDATE idem.schema_version SET version = $1`, idemmigrate.Version())
	pgtest.Exec(t, conn, `SELECT pg_advisory_lock($1)`, int64(9628173550095224))
	err = idemmigrate.Migrate(ctx, conn, idemmigrate.Options{AppRole: "pg_zz_bad", OperatorRole: "pg_zz_bad2"})
	t.Logf("failing migrate under the caller's lock: %v", err)
	var released bool
	if err := conn.QueryRow(ctx, `SELECT pg_advisory_unlock($1)`, int64(9628173550095224)).Scan(&released); err != nil || !released {
		t.Errorf("the caller's own session lock on tern's number was not held after a failed migrate: %v %v", released, err)
	}
}

// TestFailedTernMigrateKeepsCallersLock: a migration that fails inside tern (an empty
// database, an app role name PostgreSQL reserves) while the caller's session holds tern's lock
// itself: Migrate gives back tern's one, not the caller's.
func TestFailedTernMigrateKeepsCallersLock(t *testing.T) {
	ctx := context.Background()
	db := pgtest.NewEmptyDB(t)
	conn := pgtest.Connect(t, db)
	pgtest.Exec(t, conn, `SELECT pg_advisory_lock($1)`, int64(9628173550095224))
	err := idemmigrate.Migrate(ctx, conn, idemmigrate.Options{AppRole: "pg_zz_bad", OperatorRole: "pg_zz_bad2"})
	t.Logf("failing migrate under the caller's lock: %v", err)
	var released bool
	if err := conn.QueryRow(ctx, `SELECT pg_advisory_unlock($1)`, int64(9628173550095224)).Scan(&released); err != nil || !released {
		t.Errorf("the caller's own session lock on tern's number was not held after a failed migrate: %v %v", released, err)
	}
	var again bool
	_ = conn.QueryRow(ctx, `SELECT pg_advisory_unlock($1)`, int64(9628173550095224)).Scan(&again)
	if again {
		t.Errorf("a lock was still held after the caller's unlock: the failed migrate kept tern's")
	}
}

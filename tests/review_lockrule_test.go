package tests

import (
	"context"
	"strings"
	"testing"

	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestLockRuleCatchesCommonBadMigrations (review finding): TestKeyTableMigrationsStayOnline is
// the only guard of the rule "no O(rows) step under a lock the functions wait on" for later
// migrations (the issue asked for a test that runs each migration of the key table on a large
// table under keyed traffic; the static check stands in for it). Its regular expressions let
// through ordinary ways of writing the very statements it lists. Each migration below holds a
// lock that blocks every claim (SHARE or stronger on idem.idempotency_keys, checked here on a
// real database) or the rows of every key, for a time that grows with the table, and
// blockingSteps finds nothing wrong with it.
func TestLockRuleCatchesCommonBadMigrations(t *testing.T) {
	t.Parallel()
	conn := pgtest.Connect(t, pgtest.NewDB(t))
	ctx := context.Background()
	for _, bad := range []string{
		// an index without a name (PostgreSQL names it): SHARE lock while it is built
		"CREATE INDEX ON idem.idempotency_keys (resource_id);",
		// quoted identifiers, as pg_dump and many tools write them
		`CREATE INDEX keys_resource_idx ON "idem"."idempotency_keys" (resource_id);`,
		// the schema from search_path
		"SET LOCAL search_path = idem;\nCREATE INDEX keys_resource_idx ON idempotency_keys (resource_id);",
		// a serial column: a volatile default, so every row is rewritten under ACCESS EXCLUSIVE
		"ALTER TABLE idem.idempotency_keys ADD COLUMN seq bigserial;",
		// rebuilds the primary key under ACCESS EXCLUSIVE on it and SHARE on the table
		"REINDEX INDEX idem.idempotency_keys_pkey;",
		// one validated constraint beside a NOT VALID one: the first CHECK scans the table
		"ALTER TABLE idem.idempotency_keys ADD CONSTRAINT a CHECK (attempt > 0), ADD CONSTRAINT b CHECK (attempt < 1e15) NOT VALID;",
		// dynamic SQL
		"DO $$\nBEGIN\n    EXECUTE format('CREATE INDEX %I ON %s (resource_id)', 'x', 'idem.idempotency_keys');\nEND\n$$;",
		// writes (and row-locks) every row in the migration's transaction
		"UPDATE ONLY idem.idempotency_keys SET withheld = NULL;",
		"DELETE FROM ONLY idem.idempotency_keys WHERE state = 'r';",
	} {
		// What the statement really locks, on a migrated database.
		tx, err := conn.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(ctx, bad); err != nil {
			t.Fatalf("%s: %v", bad, err)
		}
		var modes []string
		if err := tx.QueryRow(ctx, `SELECT coalesce(array_agg(DISTINCT mode), '{}') FROM pg_locks
			WHERE pid = pg_backend_pid() AND granted AND relation = 'idem.idempotency_keys'::regclass`).Scan(&modes); err != nil {
			t.Fatal(err)
		}
		_ = tx.Rollback(ctx)
		blocksClaims := strings.HasPrefix(bad, "UPDATE") || strings.HasPrefix(bad, "DELETE") // row locks on every key
		for _, m := range modes {
			switch m {
			case "ShareLock", "ShareRowExclusiveLock", "ExclusiveLock", "AccessExclusiveLock":
				blocksClaims = true
			}
		}
		if !blocksClaims {
			t.Fatalf("%s takes only %v: not a blocking migration, the test is wrong", bad, modes)
		}
		if why := blockingSteps(bad); len(why) == 0 {
			t.Errorf("the rule check passed a migration that blocks claims (it holds %v on the key table) for a time that grows with the table:\n%s",
				modes, bad)
		}
	}
}

package main

import (
	"context"
	"strconv"
	"strings"
	"testing"

	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestKeysReleaseBehindALockedTable: docs/operations.md "Maintenance of the key table": behind
// a locked key table the operators' commands wait their lock_timeout, then say the table is
// locked and that nothing was done. `keys release` said only "canceling statement due to
// lock timeout": not which table, nor whether the claim was released. Once the table is free
// the same release goes through, and its answer names where the reason went (PostgreSQL's log:
// the command's process logs nothing, and the server never hears of it).
func TestKeysReleaseBehindALockedTable(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.NewDB(t)
	pool := pgtest.Connect(t, db)
	var attempt int64
	if err := pool.QueryRow(ctx, `SELECT attempt FROM idem.idem_begin('alice', 'locked-release', 'POST /x', sha256('x'),
		p_lease => interval '1 hour')`).Scan(&attempt); err != nil {
		t.Fatal(err)
	}
	ops := pgtest.LoginRole(t, db, "idem_operator")
	locker, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := locker.Exec(ctx, `LOCK TABLE idem.idempotency_keys IN ACCESS EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	_, err = runCommand(t, ops, "keys", "release", "alice", "locked-release", strconv.FormatInt(attempt, 10), "process killed")
	_ = locker.Rollback(ctx)
	if err == nil || !strings.Contains(err.Error(), "the key table is locked") || !strings.Contains(err.Error(), "nothing was released") {
		t.Errorf("keys release behind a locked key table: %v; want it to say the table is locked and nothing was released", err)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem.idempotency_keys WHERE key = 'locked-release' AND lease_expires_at > now() + interval '50 minutes'`); n != 1 {
		t.Fatalf("the claim's lease after the refused release: %d rows still leased, want 1", n)
	}
	out, err := runCommand(t, ops, "keys", "release", "alice", "locked-release", strconv.FormatInt(attempt, 10), "process killed")
	if err != nil || !strings.Contains(out, `reason "process killed", in PostgreSQL's log`) {
		t.Errorf("keys release once the table is free: %q %v", out, err)
	}
}

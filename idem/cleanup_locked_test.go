package idem_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestCleanupBehindALockedTableSaysSo: a cleanup that meets the key table itself locked (VACUUM
// FULL, LOCK TABLE) for longer than its 2 s lock timeout failed with ErrInProgress, "a
// concurrent holder kept the key ... answer 409", which told an operator nothing true: its
// deletes skip the rows requests hold, and only a lock on the table stops them. It says
// ErrStoreBusy now, "the key table is locked" (D246): Cleanup, and a Cleaner's pass.
func TestCleanupBehindALockedTableSaysSo(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	pgtest.InsertExpired(t, pool, "alice", 50)
	cleaner, err := idem.NewCleaner(pool, idem.CleanerOptions{Duty: 1})
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name string
		run  func() error
	}{
		{"Cleanup", func() error { _, err := idem.Cleanup(ctx, pool, 0); return err }},
		{"CleanupPaced", func() error { _, err := idem.CleanupPaced(ctx, pool, 10, 1); return err }},
		{"Cleaner.Pass", func() error { _, _, err := cleaner.Pass(ctx); return err }},
	} {
		locker, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		pgtest.Exec(t, locker, `LOCK TABLE idem.idempotency_keys IN SHARE MODE`)
		start := time.Now()
		err = c.run()
		took := time.Since(start)
		_ = locker.Rollback(ctx)
		if !errors.Is(err, idem.ErrStoreBusy) || errors.Is(err, idem.ErrInProgress) {
			t.Errorf("%s behind a locked key table: after %s %v; want ErrStoreBusy (the key table is locked), not ErrInProgress", c.name, took, err)
		}
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem.idempotency_keys`); n != 50 {
		t.Fatalf("%d keys after the refused passes; want the 50 expired ones still there", n)
	}
	if n, err := idem.Cleanup(ctx, pool, 0); err != nil || n != 50 {
		t.Fatalf("the cleanup once the table is free: %d, %v; want 50", n, err)
	}
}

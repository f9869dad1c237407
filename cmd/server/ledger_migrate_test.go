package main

import (
	"bytes"
	"context"
	"io"
	"io/fs"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/tern/v2/migrate"

	"github.com/pgidem/pgidem/idem/idemmigrate"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestLedgerMigrationGivesWayToARequest: the ledger's migration 006 creates a table whose
// foreign keys lock ledger.principals, ledger.accounts and ledger.payouts (SHARE ROW EXCLUSIVE)
// one after the other, while the previous release serves. A payout of that release holds
// ledger.payouts (its INSERT) and then wants ledger.accounts (its UPDATE). Waiting without
// bound, the migration held accounts while it waited for payouts, and the two deadlocked: one
// of them failed with 40P01 (TestUpgradeFrom020UnderTraffic's migrate did, under load). Now the
// migration's wait is bounded: the request's UPDATE goes through, it commits, and the
// migration runs again and completes.
func TestLedgerMigrationGivesWayToARequest(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.NewEmptyDB(t)
	if out, err := runCommand(t, db, "migrate"); err != nil {
		t.Fatalf("migrate: %v\n%s", err, out)
	}
	conn := pgtest.Connect(t, db)
	// Back to the ledger's version 5, as release 0.2.0 left it.
	mig, err := migrate.NewMigrator(ctx, conn, ledgerVersionTable)
	if err != nil {
		t.Fatal(err)
	}
	mig.Data = map[string]any{"app_role": idemmigrate.DefaultAppRole}
	if err := mig.LoadMigrations(ledgerFS()); err != nil {
		t.Fatal(err)
	}
	if err := mig.MigrateTo(ctx, 5); err != nil {
		t.Fatal(err)
	}
	var account int64
	if err := conn.QueryRow(ctx, `WITH p AS (INSERT INTO ledger.principals (id, name) VALUES ('p1', 'p1') RETURNING id)
		INSERT INTO ledger.accounts (principal_id, name, currency, balance) SELECT id, 'a', 'EUR', 100 FROM p RETURNING id`).Scan(&account); err != nil {
		t.Fatal(err)
	}

	// A payout's transaction, as 0.2.0 runs it: the INSERT into ledger.payouts first.
	request := pgtest.Connect(t, db)
	tx, err := request.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, `INSERT INTO ledger.payouts (principal_id, account_id, amount, provider_ref)
		VALUES ('p1', $1, 1, 'ref-1')`, account); err != nil {
		t.Fatal(err)
	}

	done := make(chan error, 1)
	go func() {
		out, err := runCommand(t, db, "migrate")
		if err != nil {
			t.Logf("migrate: %s", out)
		}
		done <- err
	}()
	// The migration holds ledger.accounts and waits for ledger.payouts.
	pgtest.WaitFor(t, conn, `SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid)
		WHERE NOT l.granted AND l.relation = 'ledger.payouts'::regclass AND a.query LIKE '%payout_reservations%'`)

	// Then the payout's UPDATE of the account.
	began := time.Now()
	if _, err := tx.Exec(ctx, `UPDATE ledger.accounts SET balance = balance - 1, version = version + 1 WHERE id = $1`, account); err != nil {
		t.Fatalf("the request's UPDATE while the migration runs: %v", err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatalf("the request's COMMIT: %v", err)
	}
	if waited := time.Since(began); waited > 800*time.Millisecond {
		t.Errorf("the request waited %v for the migration (its lock timeout is %s)", waited, ledgerLockTimeout)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("migrate: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("migrate did not end")
	}
	if n := pgtest.Count(t, conn, `SELECT count(*) FROM ledger.payouts`); n != 1 {
		t.Errorf("%d payouts, want 1", n)
	}
	var version int
	if err := conn.QueryRow(ctx, `SELECT version FROM `+ledgerVersionTable).Scan(&version); err != nil {
		t.Fatal(err)
	}
	files, err := fs.Glob(ledgerFS(), "*.sql")
	if err != nil {
		t.Fatal(err)
	}
	if version != len(files) {
		t.Errorf("ledger version %d after migrate, want %d", version, len(files))
	}
}

// TestConcurrentMigrates (review finding): docs/operations.md says `server migrate` is safe to
// run from several processes at once. idem's and the ledger's migrations took turns on tern's
// lock, but River's did not, nor the steps between: three migrates at once on a new database
// failed on each other's catalog rows (duplicate key in pg_type or pg_namespace, "relation
// river_migration already exists") in 5 of 6 rounds. Now the whole migrate takes turns.
func TestConcurrentMigrates(t *testing.T) {
	t.Parallel()
	for round := range 3 {
		db := pgtest.NewEmptyDB(t)
		var wg sync.WaitGroup
		errs := make([]error, 3)
		outs := make([]string, 3)
		for i := range errs {
			wg.Add(1)
			go func() {
				defer wg.Done()
				var out bytes.Buffer
				m := NewMain(&out, io.Discard)
				if err := m.ParseFlags([]string{"migrate"}, serverEnv(db, nil)); err != nil {
					errs[i] = err
					return
				}
				errs[i] = m.Run(context.Background())
				_ = m.Close()
				outs[i] = out.String()
			}()
		}
		wg.Wait()
		for i, err := range errs {
			if err != nil {
				t.Fatalf("round %d, migrate %d of 3 at once: %v\n%s", round+1, i+1, err, outs[i])
			}
		}
		if out, err := runCommand(t, db, "migrate"); err != nil {
			t.Fatalf("round %d: a migrate after them: %v\n%s", round+1, err, out)
		}
	}
}

// TestMigrateCutAnywhereRunsAgain: docs/operations.md says a migrate that stops half way (a
// lost connection, a killed process) leaves the idem schema as it was, and to run it again. A
// fresh database's migrate is cut by its context at five points, inside idem's transaction,
// the ledger's migrations and River's; each time the next migrate completes, and a principal
// can be made on the result.
func TestMigrateCutAnywhereRunsAgain(t *testing.T) {
	t.Parallel()
	run := func(db string, limit time.Duration, args ...string) (string, error) {
		var out bytes.Buffer
		m := NewMain(&out, io.Discard)
		if err := m.ParseFlags(args, serverEnv(db, nil)); err != nil {
			t.Fatal(err)
		}
		defer m.Close()
		ctx, cancel := context.WithTimeout(context.Background(), limit)
		defer cancel()
		err := m.Run(ctx)
		return out.String(), err
	}
	cuts := 0
	for _, d := range []time.Duration{20 * time.Millisecond, 60 * time.Millisecond, 120 * time.Millisecond, 200 * time.Millisecond, 300 * time.Millisecond} {
		db := pgtest.NewEmptyDB(t)
		if _, err := run(db, d, "migrate"); err != nil {
			cuts++
		}
		if _, err := run(db, time.Minute, "migrate"); err != nil {
			t.Fatalf("migrate cut at %v, then again: %v", d, err)
		}
		if out, err := run(db, 20*time.Second, "principal", "create", "x"); err != nil || !strings.HasPrefix(out, "principal ") {
			t.Fatalf("principal create after the migrate cut at %v and run again: %v %q", d, err, out)
		}
	}
	if cuts == 0 {
		t.Fatal("no migrate was cut: the cuts came too late to test anything")
	}
}

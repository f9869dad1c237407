package main

import (
	"context"
	"fmt"
	"io"
	"testing"

	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestOlderMigrateOnANewerLedgerKeepsItsAnswer: this release's `server migrate` run on a
// database whose ledger a newer release migrated (and whose idem it left at this release's
// version: a release with a ledger migration only), e.g. an old pod's migrate step during the
// rollout. It must not replace the newer release's ledger.serves_version with this release's
// answer (D204: "The code cannot know what a later release keeps; the later release can"),
// nor take the ledger down.
func TestOlderMigrateOnANewerLedgerKeepsItsAnswer(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := startServer(t, nil)
	next := countMigrations(ledgerFS()) + 1
	// The next release: a contract step, serving its own ledger version only.
	pgtest.Exec(t, s.pool, fmt.Sprintf(`UPDATE ledger.schema_version SET version = %[1]d;
		CREATE OR REPLACE FUNCTION ledger.serves_version(p_version integer) RETURNS boolean
			LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$ SELECT p_version BETWEEN %[1]d AND %[1]d $$`, next))
	if err := checkMigrated(ctx, s.pool); err == nil {
		t.Fatal("checkMigrated before the older migrate: accepted a ledger that serves this release no more")
	}
	out, errOut, err := runMain(t, []string{"migrate"}, serverEnv(s.db, nil))
	t.Logf("this release's migrate on the newer ledger: %v\n%s%s", err, out, errOut)
	var version int32
	if err := s.pool.QueryRow(ctx, `SELECT version FROM ledger.schema_version`).Scan(&version); err != nil {
		t.Fatal(err)
	}
	if int(version) != next {
		t.Errorf("the ledger's version after this release's migrate: %d; want %d", version, next)
	}
	if err := checkMigrated(ctx, s.pool); err == nil {
		t.Errorf("after this release's migrate ran on it, checkMigrated accepts a ledger whose release serves this one no more (ledger.serves_version rewritten by the older release)")
	}
}

// TestMigrateWritesWhatTheLedgerServesBeforeItsMigrations: `server migrate` wrote
// ledger.serves_version after the ledger's migrations, which commit one by one and wait behind
// the running release's locks (retried for seconds): in between, the previous release's servers
// saw a newer ledger beside the previous answer and answered /healthz 503. It is written first
// now: with the ledger's version table locked (the migrations wait), the function is there.
func TestMigrateWritesWhatTheLedgerServesBeforeItsMigrations(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.NewEmptyDB(t)
	conn := pgtest.Connect(t, db)
	pgtest.Exec(t, conn, `CREATE SCHEMA ledger; CREATE TABLE ledger.schema_version (version int4 NOT NULL); INSERT INTO ledger.schema_version VALUES (0)`)
	holder := pgtest.Connect(t, db)
	tx, err := holder.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, tx, `LOCK TABLE ledger.schema_version IN EXCLUSIVE MODE`) // writes wait, reads do not
	m := NewMain(io.Discard, io.Discard)
	if err := m.ParseFlags([]string{"migrate"}, serverEnv(db, nil)); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- m.Run(ctx); _ = m.Close() }()
	pgtest.WaitFor(t, conn, `SELECT count(*) FROM pg_proc WHERE proname = 'serves_version' AND pronamespace = 'ledger'::regnamespace`)
	select {
	case err := <-done:
		t.Fatalf("the migrate ended while the ledger's version table was locked: %v", err)
	default:
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatalf("the migrate after the lock: %v", err)
	}
	var serves bool
	if err := conn.QueryRow(ctx, `SELECT ledger.serves_version($1)`, countMigrations(ledgerFS())).Scan(&serves); err != nil || !serves {
		t.Fatalf("ledger.serves_version(%d) after the migrate: %v %v", countMigrations(ledgerFS()), serves, err)
	}
}

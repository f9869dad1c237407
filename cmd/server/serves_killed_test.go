package main

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestLedgerServesCallKilledIsNotNewer: any *pgconn.PgError of the ledger.serves_version call
// was read as "ledger.serves_version failed: ..." and so errNewer ("the
// database is newer than this server: run the newer server"; migrate.go ledgerServesVersion).
// A backend terminated while that call runs (57P01: a restart, a failover during the rolling
// upgrade) is a database that could not be asked, not a newer ledger that refuses this server:
// checkMigrated must give the database's error (idem.IsUnavailable), as it does for every other
// statement of the check, not errNewer, which makes `serve` refuse to start for good.
func TestLedgerServesCallKilledIsNotNewer(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	s := startServer(t, nil)
	appURL := pgtest.LoginRole(t, s.db, "idem_app")
	asNextRelease(t, s, idem.SchemaVersion(), countMigrations(ledgerFS()))
	pgtest.Exec(t, s.pool, `CREATE OR REPLACE FUNCTION ledger.serves_version(p_version integer) RETURNS boolean
		LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$ BEGIN PERFORM pg_sleep(3); RETURN true; END $$`)
	app, err := pgxpool.New(ctx, appURL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(app.Close)
	done := make(chan error, 1)
	go func() { done <- checkMigrated(ctx, app) }()
	pgtest.WaitFor(t, s.pool, `SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'PgSleep' AND query LIKE '%ledger.serves_version%'`)
	pgtest.Exec(t, s.pool, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE wait_event = 'PgSleep' AND query LIKE '%ledger.serves_version%'`)
	err = <-done
	if errors.Is(err, errNewer) || !idem.IsUnavailable(err) {
		t.Errorf("checkMigrated whose ledger.serves_version call was cut off by a terminated backend: %v (errNewer %v, IsUnavailable %v); "+
			"want the database's error", err, errors.Is(err, errNewer), idem.IsUnavailable(err))
	}
}

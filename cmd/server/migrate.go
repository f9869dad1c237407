package main

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/tern/v2/migrate"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/idem/idemmigrate"
)

//go:embed migrations/*.sql
var ledgerMigrations embed.FS

// ledgerVersionTable is the tern version table of the ledger's migrations.
const ledgerVersionTable = "ledger.schema_version"

func ledgerFS() fs.FS {
	sub, _ := fs.Sub(ledgerMigrations, "migrations")
	return sub
}

// ledgerNotNewer refuses a database whose ledger schema is newer than this release's, before
// anything is changed. (0.1.0 kept its version table in public; no release since is older.)
func ledgerNotNewer(ctx context.Context, conn *pgx.Conn) error {
	var exists bool
	if err := conn.QueryRow(ctx, `SELECT to_regclass('`+ledgerVersionTable+`') IS NOT NULL`).Scan(&exists); err != nil {
		return fmt.Errorf("ledger migrate: %w", err)
	}
	if !exists {
		return nil
	}
	var have int32
	if err := conn.QueryRow(ctx, `SELECT coalesce((SELECT version FROM `+ledgerVersionTable+`), 0)`).Scan(&have); err != nil {
		return fmt.Errorf("ledger migrate: read the version: %w", err)
	}
	if n := countMigrations(ledgerFS()); int(have) > n {
		return fmt.Errorf("ledger migrate: the database's ledger is at schema version %d, newer than this release's %d: "+
			"run the migrate of the release that made it (or a later one); nothing was changed", have, n)
	}
	return nil
}

// migrate installs idem (migrations and functions), then the ledger's own migrations, then
// River's (the receipts' job queue, schema river).
func (m *Main) migrate(ctx context.Context) error {
	conn, err := m.pool.Acquire(ctx)
	if err != nil {
		return err
	}
	defer conn.Release()
	// A role's or a database's statement_timeout or lock_timeout, guard rails for the API's
	// queries, would cut the wait for another migrate below and the migrations' long steps;
	// their lock waits are bounded on their own (D227, D245).
	if _, err := conn.Exec(ctx, "SET statement_timeout = 0; SET lock_timeout = 0"); err != nil {
		return err
	}
	defer func() { _, _ = conn.Exec(context.WithoutCancel(ctx), "RESET statement_timeout; RESET lock_timeout") }()
	// One migrate at a time, all of it: idem and the ledger take turns on tern's lock, but the
	// steps between them and River's migrations (CREATE SCHEMA IF NOT EXISTS, River's own
	// tables) do not, and two processes running them at once failed on each other's catalog
	// rows. A session lock on this connection, released at the end (or when it closes).
	if _, err := conn.Exec(ctx, `SELECT pg_advisory_lock(hashtextextended('pgidem server migrate', 0))`); err != nil {
		return fmt.Errorf("migrate: wait for another migrate: %w", err)
	}
	defer func() {
		_, _ = conn.Exec(context.WithoutCancel(ctx), `SELECT pg_advisory_unlock(hashtextextended('pgidem server migrate', 0))`)
	}()
	// A newer release's ledger is refused before idem is touched: idem's migrate would
	// otherwise install this release's functions over the newer release's first, and the
	// ledger's migrations refuse only after (D259).
	if err := ledgerNotNewer(ctx, conn.Conn()); err != nil {
		return err
	}
	if err := idemmigrate.Migrate(ctx, conn.Conn(), idemmigrate.Options{AppRole: m.Config.AppRole}); err != nil {
		return err
	}
	// 0.1.0 kept the ledger's version table in public; it moves with the ledger.
	if _, err := conn.Exec(ctx, `CREATE SCHEMA IF NOT EXISTS ledger;
		DO $$ BEGIN
			IF to_regclass('public.ledger_schema_version') IS NOT NULL AND to_regclass('ledger.schema_version') IS NULL THEN
				ALTER TABLE public.ledger_schema_version SET SCHEMA ledger;
				ALTER TABLE ledger.ledger_schema_version RENAME TO schema_version;
			END IF;
		END $$`); err != nil {
		return fmt.Errorf("ledger migrate: %w", err)
	}
	// What this release's ledger serves, written before its migrations: they commit one by one
	// (retried behind the running release's locks), and a server of the previous release that
	// saw a newer ledger version beside the previous release's answer would refuse it (D204).
	// Not over a newer release's ledger, which keeps its own answer (its migrations refuse
	// this release below).
	var have int32
	var exists bool
	if err := conn.QueryRow(ctx, `SELECT to_regclass('`+ledgerVersionTable+`') IS NOT NULL`).Scan(&exists); err != nil {
		return fmt.Errorf("ledger migrate: %w", err)
	}
	if exists {
		if err := conn.QueryRow(ctx, `SELECT coalesce((SELECT version FROM `+ledgerVersionTable+`), 0)`).Scan(&have); err != nil {
			return fmt.Errorf("ledger migrate: %w", err)
		}
	}
	if int(have) <= countMigrations(ledgerFS()) {
		if _, err := conn.Exec(ctx, ledgerServes(m.Config.AppRole)); err != nil {
			return fmt.Errorf("ledger migrate: %w", err)
		}
	}
	mig, err := migrate.NewMigrator(ctx, conn.Conn(), ledgerVersionTable)
	if err != nil {
		return fmt.Errorf("ledger migrate: %w", err)
	}
	mig.Data = map[string]any{"app_role": m.Config.AppRole}
	if err := mig.LoadMigrations(ledgerFS()); err != nil {
		return fmt.Errorf("ledger migrate: %w", err)
	}
	if err := migrateLedger(ctx, conn.Conn(), mig); err != nil {
		return fmt.Errorf("ledger migrate: %w", err)
	}
	// The ledger's grants to the application role again, on every migrate: the migrations
	// give them once, to the role of the migrate that ran them, and IDEM_APP_ROLE may name
	// another since (D152). The earlier role keeps its grants.
	if _, err := conn.Exec(ctx, ledgerGrants(m.Config.AppRole)); err != nil {
		return fmt.Errorf("ledger migrate: grant to %s: %w", m.Config.AppRole, err)
	}
	if err := m.migrateRiver(ctx); err != nil {
		return err
	}
	m.log.Info("migrated")
	return nil
}

// ledgerGrants is what the ledger's migrations grant the application role, as one
// idempotent script (TestMigrateGrantsAnotherAppRole compares a role given these with one
// given the migrations).
func ledgerGrants(role string) string {
	r := pgx.Identifier{role}.Sanitize()
	return `GRANT USAGE ON SCHEMA ledger, provider TO ` + r + `;
GRANT SELECT, INSERT, UPDATE, DELETE ON ledger.principals, ledger.api_tokens, ledger.accounts, ledger.deposits, ledger.transfers TO ` + r + `;
GRANT SELECT, INSERT, UPDATE ON ledger.payouts, ledger.payout_reservations, provider.payouts TO ` + r + `;
GRANT SELECT ON ledger.schema_version TO ` + r + `;
GRANT USAGE ON ALL SEQUENCES IN SCHEMA ledger TO ` + r + `;
GRANT USAGE ON SEQUENCE provider.payout_ref_seq TO ` + r + `;`
}

// ledgerOldestServed is the oldest ledger version whose server this release's ledger still
// serves: 0.2.0's (5 migrations) keeps working after this release's migrate, as a rolling
// upgrade needs (TestUpgradeMixedServers). Raise it only with a migration that drops what that
// server uses.
const ledgerOldestServed = 5

// ledgerServes is ledger.serves_version, written on every migrate: whether a server whose
// ledger has p_version migrations may run on this database (checkMigrated of an older server
// asks it of a newer ledger). Granted to the application role, which the servers log in as.
func ledgerServes(role string) string {
	return fmt.Sprintf(`CREATE OR REPLACE FUNCTION ledger.serves_version(p_version integer) RETURNS boolean
LANGUAGE sql STABLE PARALLEL SAFE SET search_path = pg_catalog, pg_temp
AS $$ SELECT p_version BETWEEN %d AND %d $$;
COMMENT ON FUNCTION ledger.serves_version(integer) IS 'Whether a server whose ledger has p_version migrations may run on this database.';
REVOKE ALL ON FUNCTION ledger.serves_version(integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ledger.serves_version(integer) TO %s;`,
		ledgerOldestServed, countMigrations(ledgerFS()), pgx.Identifier{role}.Sanitize())
}

// ledgerLockTimeout bounds each lock wait of a ledger migration, ledgerTries its runs.
const (
	ledgerLockTimeout = "200ms"
	ledgerTries       = 10
)

// migrateLedger runs the ledger's migrations while the previous release may be serving. A new
// table's foreign keys take SHARE ROW EXCLUSIVE on the tables they reference, one after the
// other, and a request can hold one of those tables while it waits for another (a payout
// inserts into ledger.payouts, then updates ledger.accounts): waiting without bound, the
// migration deadlocked with such a request, and requests queued behind it. So each lock wait
// is bounded (ledgerLockTimeout), and a migration that meets a lock timeout or a deadlock is
// rolled back (tern runs each in its own transaction) and runs again, after the requests in its
// way are through, up to ledgerTries times.
func migrateLedger(ctx context.Context, conn *pgx.Conn, mig *migrate.Migrator) error {
	if _, err := conn.Exec(ctx, "SET lock_timeout = '"+ledgerLockTimeout+"'"); err != nil {
		return err
	}
	defer func() { _, _ = conn.Exec(context.WithoutCancel(ctx), "RESET lock_timeout") }()
	for try := 1; ; try++ {
		err := mig.Migrate(ctx)
		var pgErr *pgconn.PgError
		if err == nil || try == ledgerTries || ctx.Err() != nil ||
			!errors.As(err, &pgErr) || (pgErr.Code != "55P03" && pgErr.Code != "40P01") {
			return err
		}
		t := time.NewTimer(time.Duration(try) * 100 * time.Millisecond)
		select {
		case <-ctx.Done():
			t.Stop()
			return err
		case <-t.C:
		}
	}
}

// errNotMigrated is what serve, cleanup and principal create say on a database that lacks
// the migrations of this version, or whose SQL API functions are not those of its schema.
var errNotMigrated = errors.New("database not migrated: run `server migrate`")

// errNewer is what they say on a database migrated by a newer release.
var errNewer = errors.New("the database is newer than this server: run the newer server")

// checkMigrated compares the database with the migrations and functions this binary carries:
// idem through idem.idem_version() (the schema's version and the version its installed
// functions belong to, which the application role may call), the ledger through its version
// table. A schema whose functions belong to another version (an install that stopped half
// way) is not migrated.
func checkMigrated(ctx context.Context, db idem.Querier) error {
	if err := checkIdemMigrated(ctx, db); err != nil {
		return err
	}
	wantLedger := countMigrations(ledgerFS())
	// Two statements: a statement that names the version table fails to parse (42P01) where it
	// does not exist, whatever CASE would have skipped (a database with the idem API alone).
	var have int32
	var exists bool
	if err := db.QueryRow(ctx, `SELECT to_regclass('`+ledgerVersionTable+`') IS NOT NULL`).Scan(&exists); err != nil {
		return ledgerCheckError(err)
	}
	if exists {
		if err := db.QueryRow(ctx, `SELECT coalesce((SELECT version FROM `+ledgerVersionTable+`), 0)`).Scan(&have); err != nil {
			return ledgerCheckError(err)
		}
	}
	switch {
	case int(have) < wantLedger:
		return fmt.Errorf("%w (%s is at version %d, this server needs %d)", errNotMigrated, ledgerVersionTable, have, wantLedger)
	case int(have) > wantLedger:
		// A newer release's migrate: it says whether this server may still run on it (a
		// rolling upgrade), as idem.CheckSchema asks the SQL API.
		serves, why, err := ledgerServesVersion(ctx, db, wantLedger, int(have))
		if err != nil {
			return fmt.Errorf("check the migrations: %w", err)
		}
		if !serves {
			return fmt.Errorf("%w (%s is at version %d, this server knows %d%s)", errNewer, ledgerVersionTable, have, wantLedger, why)
		}
	}
	return nil
}

// ledgerCheckError is the error of a failed read of the ledger's version: a role that may not
// read it (a grant revoked by hand, a role the migrations did not grant) is said so, with the
// grant it lacks, and wraps idem.ErrPermissionDenied (so /healthz gives the reason rather than
// "the database does not answer").
func ledgerCheckError(err error) error {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "42501" {
		return fmt.Errorf("%w: this role may not read %s (%s): GRANT USAGE ON SCHEMA ledger and SELECT ON %s to it "+
			"(server migrate grants both to the application role)", idem.ErrPermissionDenied, ledgerVersionTable,
			pgErr.Message, ledgerVersionTable)
	}
	return fmt.Errorf("check the migrations: %w", err)
}

// ledgerServesVersion asks ledger.serves_version whether the ledger at version have serves a
// server of version want, as idem's servesVersion does: the answer counts only when the
// function serves have too (this release's, left in place by a newer migrate that stopped
// before writing its own, answers no), and a missing function, one the role may not call or
// a NULL answer serve nothing (why says which). No statement that can fail on them.
func ledgerServesVersion(ctx context.Context, db idem.Querier, want, have int) (serves bool, why string, err error) {
	var exists, may bool
	if err := db.QueryRow(ctx, `SELECT p IS NOT NULL, p IS NOT NULL AND has_function_privilege(p, 'EXECUTE')
		FROM (SELECT to_regprocedure('ledger.serves_version(integer)') AS p) AS f`).Scan(&exists, &may); err != nil {
		return false, "", err
	}
	switch {
	case !exists:
		return false, "; it has no ledger.serves_version", nil
	case !may:
		return false, "; this role may not call ledger.serves_version", nil
	}
	err = db.QueryRow(ctx, `SELECT coalesce(ledger.serves_version($1) AND ledger.serves_version($2), false)`,
		int32(want), int32(have)).Scan(&serves)
	var pgErr *pgconn.PgError
	switch {
	case functionRaised(err) && errors.As(err, &pgErr):
		return false, "; ledger.serves_version failed: " + pgErr.Message, nil
	case err != nil:
		return false, "", err
	}
	if !serves {
		return false, "; ledger.serves_version says it does not serve this server", nil
	}
	return true, "", nil
}

// newerNote says, when checkMigrated passed on a database that a newer release migrated (which
// still serves this server: a rolling upgrade under way), that this server is due to be
// replaced; "" otherwise, and when it cannot be read.
func newerNote(ctx context.Context, db idem.Querier) string {
	var schema, ledger int32
	if err := db.QueryRow(ctx, `SELECT (SELECT schema_version FROM idem.idem_version()),
		coalesce((SELECT version FROM `+ledgerVersionTable+`), 0)`).Scan(&schema, &ledger); err != nil {
		return ""
	}
	if int(schema) <= idem.SchemaVersion() && int(ledger) <= countMigrations(ledgerFS()) {
		return ""
	}
	return fmt.Sprintf("the database was migrated by a newer release (idem schema version %d, ledger %d; this server knows %d and %d), "+
		"which still serves this one: replace this server with the newer release", schema, ledger, idem.SchemaVersion(), countMigrations(ledgerFS()))
}

// checkIdemMigrated is checkMigrated's half for schema idem (what `server keys` needs): the
// library's own check (idem.CheckSchema), in the server's words.
func checkIdemMigrated(ctx context.Context, db idem.Querier) error {
	err := idem.CheckSchema(ctx, db)
	var se *idem.SchemaError
	switch {
	case err == nil:
		return nil
	case errors.Is(err, idem.ErrPermissionDenied):
		return err
	case !errors.As(err, &se):
		return fmt.Errorf("check the migrations: %w", err)
	case se.Schema == 0:
		// No idem_version() (nothing installed, or a release before 0.2.0).
		return fmt.Errorf("%w (the idem SQL API is missing or older than this server's, which needs schema version %d)", errNotMigrated, se.Want)
	case se.Schema > se.Want:
		return fmt.Errorf("%w (idem is at schema version %d, this server knows %d)", errNewer, se.Schema, se.Want)
	case se.Schema < se.Want:
		return fmt.Errorf("%w (idem is at schema version %d, this server needs %d)", errNotMigrated, se.Schema, se.Want)
	}
	return fmt.Errorf("%w (idem's functions belong to schema version %d, the schema is at %d)", errNotMigrated, se.Functions, se.Schema)
}

func countMigrations(fsys fs.FS) int {
	paths, _ := migrate.FindMigrations(fsys)
	return len(paths)
}

// functionRaised tells whether err is an error a function raised of its own (the database
// answered), not the connection's or the session's: unavailability, a cancel or a statement
// timeout (57), a serialization failure or deadlock (40), a lock timeout (55P03), too little
// of a resource (53). As the library's schema check reads a serves function's error.
func functionRaised(err error) bool {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || idem.IsUnavailable(err) || pgErr.Code == "55P03" {
		return false
	}
	switch pgErr.Code[:2] {
	case "08", "40", "53", "57":
		return false
	}
	return true
}

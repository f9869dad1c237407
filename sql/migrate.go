// Package idemsql carries the SQL of idem (the tern migrations in migrations/ and the
// PL/pgSQL API in functions/) inside the binary and installs it.
//
// The server's migrate command and the test harness both call [Migrate], so what the tests
// run against is exactly what an operator installs.
package idemsql

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"regexp"
	"strings"
	"text/template"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/tern/v2/migrate"

	"github.com/pgidem/pgidem/sql/migrations"
)

//go:embed functions/*.sql functions/include/*.sql
var functionFiles embed.FS

// DefaultAppRole is the NOLOGIN role that is granted EXECUTE on the API functions.
const DefaultAppRole = "idem_app"

// DefaultOperatorRole is the NOLOGIN role of operators: the API's summary, one key's story
// with its body, and the release of a stuck lease claim.
const DefaultOperatorRole = "idem_operator"

// VersionTable is the tern version table of the idem migrations.
const VersionTable = "idem.schema_version"

// Options configure [Migrate]. The zero value installs with the defaults.
type Options struct {
	// AppRole is the role granted USAGE on schema idem and EXECUTE on the API functions.
	// Default DefaultAppRole. It must be a lower-case SQL identifier (a-z, 0-9, _; at most
	// 63 bytes); it is created NOLOGIN when it does not exist.
	AppRole string
	// OperatorRole is the role granted the operators' functions (idem_summary, idem_health,
	// idem_key with bodies, idem_stuck, idem_release_stuck). Default DefaultOperatorRole; the same rules as
	// AppRole, and another name.
	OperatorRole string
}

var roleName = regexp.MustCompile(`^[a-z_][a-z0-9_]{0,62}$`)

// Migrations returns the tern migrations (files named NNN_name.sql).
func Migrations() fs.FS { return migrations.FS() }

// Version is the schema version these migrations bring a database to (the number of
// migrations): idem.schema_version holds it once Migrate has run.
func Version() int { return migrations.Version() }

// Functions returns the tern code package of the SQL API (install.sql and one file per
// function).
func Functions() fs.FS {
	sub, _ := fs.Sub(functionFiles, "functions")
	return sub
}

// TernLock is tern's advisory lock number (github.com/jackc/tern/v2/migrate): Migrate, tern
// and the psql bundle (sql/idem.sql) all take it, so no two of them ever install at once.
const TernLock int64 = 9628173550095224

// Migrate applies every pending migration and then (re)installs the SQL API functions, all in
// one transaction: an interruption (a lost connection, a killed process, an error) leaves
// the database as it was, never a new schema beside old functions, and a run that commits
// leaves idem.idem_version() reporting the same version for both. It is safe to run any
// number of times and from several processes at once (they take turns on tern's advisory
// lock). The connection's role becomes the owner of the schema objects, and the SECURITY
// DEFINER functions run as that role. conn must not be in a transaction.
//
// A migration that rebuilds the key table does it online, before that transaction: a copy
// beside the live table, kept current by a trigger and filled in batches while the previous
// release keeps serving (RebuildOnline), so the transaction only swaps the tables in a lock of
// milliseconds, whatever the table's size; docs/operations.md ("Upgrades") has the figures.
func Migrate(ctx context.Context, conn *pgx.Conn, opts Options) error {
	return withHint(migrate1(ctx, conn, opts))
}

// withHint adds PostgreSQL's hint to err's text (pgconn's Error() leaves it out): the hint of
// a missing role names the superuser step, and a program that prints the error shows it.
func withHint(err error) error {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Hint != "" && !strings.Contains(err.Error(), pgErr.Hint) {
		return fmt.Errorf("%w (hint: %s)", err, pgErr.Hint)
	}
	return err
}

func migrate1(ctx context.Context, conn *pgx.Conn, opts Options) (err error) {
	data, err := TemplateData(opts)
	if err != nil {
		return err
	}
	// The caller's transaction would be committed by the first online step, and its work with
	// it, or end in an error midway (D245).
	if st := conn.PgConn().TxStatus(); st != 'I' {
		return fmt.Errorf("idem migrate: the connection is in a transaction (status %q): "+
			"commit or roll it back first, then migrate; nothing was changed", st)
	}
	restore, err := pinSearchPath(ctx, conn)
	if err != nil {
		return err
	}
	defer func() {
		if rerr := restore(); err == nil {
			err = rerr
		}
	}()
	if _, err := conn.Exec(ctx, EncodingCheck); err != nil {
		return fmt.Errorf("idem migrate: %w", err)
	}
	if err := refuseNewer(ctx, conn); err != nil {
		return err
	}
	if err := RebuildOnline(ctx, conn, data, DefaultRebuildBatch); err != nil {
		return err
	}
	if err := ExpandOnline(ctx, conn, data); err != nil {
		return err
	}
	code, err := migrate.LoadCodePackage(Functions())
	if err != nil {
		return fmt.Errorf("idem migrate: load functions: %w", err)
	}
	install, err := code.Eval(data)
	if err != nil {
		return fmt.Errorf("idem migrate: render functions: %w", err)
	}
	install = pinLocal + install

	// A migration that locks the key table asks for its locks with a short lock timeout, and
	// keeps it: a later step that would wait long while the key table is locked fails instead
	// (55P03), rolling everything back, and the whole transaction runs again, a few times.
	for try := 1; ; try++ {
		err := migrateOnce(ctx, conn, data, install)
		if err == nil || try == 5 || !isLockTimeout(err) || ctx.Err() != nil {
			return err
		}
		t := time.NewTimer(time.Duration(try) * 200 * time.Millisecond)
		select {
		case <-ctx.Done():
			t.Stop()
			return err
		case <-t.C:
		}
	}
}

// isLockTimeout tells whether err is a lock timeout (55P03) that a new try may not meet: not
// the one a migration raises once it gave up asking (its message names the migration).
func isLockTimeout(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "55P03" && !strings.HasPrefix(pgErr.Message, "idem migration")
}

// migrateOnce runs the migrations and the install in one transaction.
func migrateOnce(ctx context.Context, conn *pgx.Conn, data map[string]any, install string) error {
	tx, err := conn.Begin(ctx)
	if err != nil {
		return fmt.Errorf("idem migrate: %w", err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	// First the lock, then everything else: a second migrate waits here until the first has
	// committed, and then finds nothing to do but the (idempotent) function install.
	if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock($1)", TernLock); err != nil {
		return fmt.Errorf("idem migrate: lock: %w", err)
	}
	// tern keeps its version table inside the schema, so the schema comes first.
	if _, err := tx.Exec(ctx, "CREATE SCHEMA IF NOT EXISTS idem"); err != nil {
		return fmt.Errorf("idem migrate: create schema: %w", err)
	}
	// DisableTx: tern runs the migrations in the transaction opened above instead of one
	// each, so they commit together with the functions.
	m, err := migrate.NewMigratorEx(ctx, conn, VersionTable, &migrate.MigratorOptions{DisableTx: true})
	if err != nil {
		// tern takes its lock here too (to create its version table), and releases it with
		// the same context: one that ended in between left the lock held (D268).
		releaseTernLock(ctx, conn, tx)
		return fmt.Errorf("idem migrate: %w", err)
	}
	m.Data = data
	if err := m.LoadMigrations(Migrations()); err != nil {
		return fmt.Errorf("idem migrate: load migrations: %w", err)
	}
	for _, mig := range m.Migrations {
		if DisablesTx(mig) {
			return fmt.Errorf("idem migrate: migration %s disables its transaction, which Migrate does not support", mig.Name)
		}
		// tern runs RESET ALL after each migration, which puts back the session's search_path
		// (the database's or the role's, whatever it names): each migration pins its own.
		mig.UpSQL = pinLocal + mig.UpSQL
	}
	if err := m.Migrate(ctx); err != nil {
		releaseTernLock(ctx, conn, tx)
		return fmt.Errorf("idem migrate: %w", err)
	}
	if _, err := tx.Exec(ctx, install); err != nil {
		return fmt.Errorf("idem migrate: install functions: %w", err)
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("idem migrate: commit: %w", err)
	}
	return nil
}

// releaseTernLock is what a migrate does when tern failed: tern took its advisory lock for the
// session and releases it with the context it was given, in this transaction, which the error
// aborted (or after the context ended): the release failed, and the lock would outlive the
// migrate, holding every later one of this connection's pool or process for ever (a migrate
// waits for its turn without a lock timeout). The transaction is rolled back first, then the
// lock released (at most the one tern took), whatever the context.
func releaseTernLock(ctx context.Context, conn *pgx.Conn, tx pgx.Tx) {
	_ = tx.Rollback(context.WithoutCancel(ctx))
	_, _ = conn.Exec(context.WithoutCancel(ctx), "SELECT pg_catalog.pg_advisory_unlock($1) FROM pg_catalog.pg_locks"+
		" WHERE locktype = 'advisory' AND pid = pg_catalog.pg_backend_pid() AND granted"+
		" AND classid = ($1 >> 32)::oid AND objid = ($1 & 4294967295)::oid AND objsubid = 1 LIMIT 1", TernLock)
}

// pinLocal pins the search_path of a migration's or the install's transaction: PostgreSQL's
// own schema, then nothing but the session's temporary one (searched last), whatever the
// database's or the role's setting names. The SQL of the migrations and the install runs as
// the schema's owner, with calls such as convert_to(text, 'UTF8'): a schema searched before
// pg_catalog's, or even after it, may hold a function that matches such a call more exactly
// (convert_to(text, text)), and it would run as the owner, with the owner's rights and
// arguments (the installation's secret among them).
const pinLocal = "SET LOCAL search_path = pg_catalog, pg_temp;\n"

// pinSearchPath pins the session's search_path (as pinLocal does a transaction's) for the
// statements a migrate sends outside its transaction (the online parts, tern's own), and lifts
// its statement_timeout and lock_timeout: a role's or a database's guard rails for the
// application's queries would cut a migrate's wait for its turn on tern's lock (several
// migrates take turns) and its online steps, whose waits have lock timeouts of their own (D227,
// D245); tern runs RESET ALL after each migration it applies, which gives the rest of its
// transaction the role's or the database's values again. It returns the function that puts
// the session's values back.
func pinSearchPath(ctx context.Context, conn *pgx.Conn) (restore func() error, err error) {
	var old, oldTimeout, oldLockTimeout string
	if err := conn.QueryRow(ctx, "SELECT pg_catalog.current_setting('search_path'), pg_catalog.current_setting('statement_timeout'), "+
		"pg_catalog.current_setting('lock_timeout')").Scan(&old, &oldTimeout, &oldLockTimeout); err != nil {
		return nil, fmt.Errorf("idem migrate: read search_path: %w", err)
	}
	if _, err := conn.Exec(ctx, "SELECT pg_catalog.set_config('search_path', 'pg_catalog, pg_temp', false), "+
		"pg_catalog.set_config('statement_timeout', '0', false), pg_catalog.set_config('lock_timeout', '0', false)"); err != nil {
		return nil, fmt.Errorf("idem migrate: pin search_path: %w", err)
	}
	return func() error {
		if conn.IsClosed() {
			return nil
		}
		if _, err := conn.Exec(context.WithoutCancel(ctx), "SELECT pg_catalog.set_config('search_path', $1, false), "+
			"pg_catalog.set_config('statement_timeout', $2, false), pg_catalog.set_config('lock_timeout', $3, false)",
			old, oldTimeout, oldLockTimeout); err != nil {
			return fmt.Errorf("idem migrate: restore search_path: %w", err)
		}
		return nil
	}, nil
}

// refuseNewer refuses a database whose schema version is above this release's, before
// anything is changed: a later release's migrate belongs to it.
func refuseNewer(ctx context.Context, conn *pgx.Conn) error {
	var exists bool
	if err := conn.QueryRow(ctx, "SELECT pg_catalog.to_regclass('idem.schema_version') IS NOT NULL").Scan(&exists); err != nil || !exists {
		if err != nil {
			return fmt.Errorf("idem migrate: read the version: %w", err)
		}
		return nil
	}
	var version int
	err := conn.QueryRow(ctx, "SELECT v.version FROM idem.schema_version AS v LIMIT 1").Scan(&version)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil
	}
	if err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "42501" {
			return fmt.Errorf("idem migrate: read the version: %w: run the migrate as the role that owns schema idem "+
				"(not the role the services log in as)", err)
		}
		return fmt.Errorf("idem migrate: read the version: %w", err)
	}
	if version > Version() {
		return fmt.Errorf("idem migrate: the database is at schema version %d, newer than this release's %d: "+
			"run the migrate of the release that made it (or a later one); nothing was changed", version, Version())
	}
	return nil
}

// EncodingCheck is a statement that raises 55000 unless the database's encoding is UTF8
// (D232). Keys, principals, field names and stored headers are UTF-8 text, and provider keys
// hash them as UTF-8: in a LATIN1 database a character outside LATIN1 failed a valid request
// with a 500 (a SQL_ASCII one answered 503, retried forever), and a Go service, whose driver
// sends UTF-8 under the database's client_encoding, stored principals that no other client
// could find. Migrate runs it before it changes anything, and sql/idem.sql first; an
// installation of an earlier release in such a database keeps serving as it did, and its
// upgrade is refused.
const EncodingCheck = `DO $idem_encoding$
BEGIN
    IF pg_catalog.current_setting('server_encoding') OPERATOR(pg_catalog.<>) 'UTF8' THEN
        RAISE EXCEPTION 'idem: the database''s encoding is %, and idem needs a UTF8 database (keys, principals, field names and headers are UTF-8 text); nothing was changed',
            pg_catalog.current_setting('server_encoding')
            USING ERRCODE = '55000',
                  HINT = 'Install idem in a database created with ENCODING ''UTF8'' (CREATE DATABASE ... TEMPLATE template0 ENCODING ''UTF8'').';
    END IF;
END
$idem_encoding$`

// DefaultRebuildBatch is how many rows each transaction of an online rebuild copies.
const DefaultRebuildBatch = 5000

// RebuildOnline runs the online part of the key table's rebuilds that the database still
// lacks (migration 003 on a database of 0.1.0: online/003_shadow.sql in a short transaction
// under tern's advisory lock, then CALL idem.rebuild_003(batch), which commits as it goes),
// while the previous release serves. Migrate calls it first; the migration itself then swaps.
// conn must not be in a transaction. Safe to run again, and beside another migrate: what
// another one already swapped in is left alone.
func RebuildOnline(ctx context.Context, conn *pgx.Conn, data map[string]any, batch int) error {
	due := func() (bool, error) {
		var due bool
		err := conn.QueryRow(ctx, `SELECT to_regclass('idem.schema_version') IS NOT NULL
			AND to_regclass('idem.idempotency_keys') IS NOT NULL`).Scan(&due)
		if err != nil || !due {
			return false, err
		}
		err = conn.QueryRow(ctx, `SELECT version BETWEEN 1 AND 2 FROM idem.schema_version`).Scan(&due)
		if err == pgx.ErrNoRows {
			return false, nil
		}
		return due, err
	}
	if ok, err := due(); err != nil || !ok {
		if err != nil {
			return fmt.Errorf("idem migrate: read the version: %w", err)
		}
		return nil
	}
	shadow, err := RenderOnline("online/003_shadow.sql", data)
	if err != nil {
		return fmt.Errorf("idem migrate: %w", err)
	}
	err = pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock($1)", TernLock); err != nil {
			return err
		}
		if ok, err := due(); err != nil || !ok { // another migrate swapped meanwhile
			return err
		}
		_, err := tx.Exec(ctx, shadow)
		return err
	})
	if err != nil {
		return fmt.Errorf("idem migrate: prepare the key table's online rebuild: %w", err)
	}
	if _, err := conn.Exec(ctx, "CALL idem.rebuild_003($1)", batch); err != nil {
		if ok, derr := due(); derr == nil && !ok {
			return nil // another migrate swapped the tables while this one copied
		}
		return fmt.Errorf("idem migrate: the key table's online rebuild: %w", err)
	}
	return nil
}

// ExpandOnline adds the key table's columns of migration 007 (online/007_columns.sql) in a
// statement of its own that commits at once, before Migrate's transaction, while the previous
// release serves: the table's ACCESS EXCLUSIVE lock lasts a catalog change, not the whole
// migrate. It does nothing on a database below schema version 3 or that has them. conn must
// not be in a transaction.
func ExpandOnline(ctx context.Context, conn *pgx.Conn, data map[string]any) error {
	columns, err := RenderOnline("online/007_columns.sql", data)
	if err != nil {
		return fmt.Errorf("idem migrate: %w", err)
	}
	if _, err := conn.Exec(ctx, columns); err != nil {
		return fmt.Errorf("idem migrate: the key table's columns of migration 007: %w", err)
	}
	return nil
}

// RenderOnline renders one of the migrations' shared files under online/ (which tern includes
// into the migrations as templates) with data, as a statement of its own.
func RenderOnline(name string, data map[string]any) (string, error) {
	tmpl := template.New("online")
	entries, err := fs.ReadDir(Migrations(), "online")
	if err != nil {
		return "", fmt.Errorf("idem migrate: %w", err)
	}
	for _, e := range entries {
		body, err := fs.ReadFile(Migrations(), "online/"+e.Name())
		if err != nil {
			return "", fmt.Errorf("idem migrate: %w", err)
		}
		if _, err := tmpl.New("online/" + e.Name()).Parse(string(body)); err != nil {
			return "", fmt.Errorf("idem migrate: %s: %w", e.Name(), err)
		}
	}
	var out strings.Builder
	if err := tmpl.ExecuteTemplate(&out, name, data); err != nil {
		return "", fmt.Errorf("idem migrate: %w", err)
	}
	return out.String(), nil
}

var disableTx = regexp.MustCompile(`(?m)^---- tern: disable-tx ----$`)

// DisablesTx tells whether a migration asks tern to run it outside a transaction (a line
// "---- tern: disable-tx ----"). None of idem's may: Migrate and sql/idem.sql each install
// in one transaction.
func DisablesTx(m *migrate.Migration) bool { return disableTx.MatchString(m.UpSQL) }

// OldestServedVersion is the oldest schema version whose code this release's SQL API still
// serves (idem.idem_serves_version): the code of release 0.2.0 (schema version 5) keeps
// working after this release's migrate, as a rolling upgrade needs. A later release raises it
// only when it drops what that code calls (a contract step).
const OldestServedVersion = 5

// TemplateData is the data the migrations and the functions are rendered with: the roles'
// names (app_role, operator_role), the schema version the functions belong to
// (schema_version, which idem.idem_version() reports), the oldest version whose code they
// serve (oldest_served) and tern's advisory lock (tern_lock).
func TemplateData(opts Options) (map[string]any, error) {
	app, operator := opts.AppRole, opts.OperatorRole
	if app == "" {
		app = DefaultAppRole
	}
	if operator == "" {
		operator = DefaultOperatorRole
	}
	for _, role := range []string{app, operator} {
		if !roleName.MatchString(role) {
			return nil, fmt.Errorf("idem migrate: role %q is not a lower-case SQL identifier", role)
		}
	}
	if app == operator {
		return nil, fmt.Errorf("idem migrate: the application and operator roles must differ, both are %q", app)
	}
	return map[string]any{"app_role": app, "operator_role": operator, "schema_version": Version(), "oldest_served": OldestServedVersion, "tern_lock": TernLock}, nil
}

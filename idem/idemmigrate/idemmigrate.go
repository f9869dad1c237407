// Package idemmigrate installs and upgrades the SQL API of idem (schema idem) in a database:
// the step the schema's owner runs once per release, before the services start, apart from
// the services themselves, which log in as members of the application role and only check
// the version (idem.CheckSchema, which idem.New runs).
//
//	conn, err := pgx.Connect(ctx, ownerURL) // the role that owns schema idem, not the service's
//	if err != nil {
//		return err
//	}
//	defer conn.Close(ctx)
//	if err := idemmigrate.Migrate(ctx, conn, idemmigrate.Options{}); err != nil {
//		return err
//	}
//
// The same SQL is in sql/idem.sql for psql, and the reference server's `server migrate` runs
// it. The migrations create the roles idem_app and idem_operator when they do not exist; an
// owner that is not a superuser needs a superuser to create them first (or CREATEROLE):
// docs/sql-api.md, "Installing without a superuser". It lives in a package of its own so
// that a service that imports package idem does not link tern and its templates.
package idemmigrate

import (
	"context"

	"github.com/jackc/pgx/v5"

	idemsql "github.com/pgidem/pgidem/sql"
)

// Options configure Migrate. The zero value installs with the default roles.
type Options struct {
	// AppRole is the role granted USAGE on schema idem and EXECUTE on the API's functions:
	// the role the services log in as members of. Default "idem_app". A lower-case SQL
	// identifier (a-z, 0-9, _; at most 63 bytes); created NOLOGIN when it does not exist.
	// Grant a service's own tables to the service's login role, not to this role: every
	// member of it, the login role of every service that uses idem on the cluster, would get
	// them.
	AppRole string
	// OperatorRole is the role granted the operators' functions (idem_summary, idem_health,
	// idem_key with bodies, idem_stuck, idem_release_stuck). Default "idem_operator"; the same
	// rules as AppRole, and another name. AppRole is granted idem_summary, idem_health,
	// idem_replication and idem_key without bodies too, so a service's own metrics
	// (idemprom's health collector) read them on its pool.
	OperatorRole string
}

// Migrate applies every pending migration and then (re)installs the SQL API's functions, all
// in one transaction: an interruption leaves the version and the functions as they were. The
// online steps that come before that transaction, so that a running earlier release never
// waits on them, commit on their own and stay (from 0.2.0 the key table's new nullable
// columns; from 0.1.0 the new key table beside the old one and the trigger that fills it:
// docs/operations.md, "Upgrades"); the next run goes on from them. It is safe to run any
// number of times and from several processes at once (they take turns on tern's advisory
// lock, whatever statement_timeout or lock_timeout the role or the database sets: Migrate
// lifts them on conn for its waits for its turn and its online steps, and puts them back;
// tern sets the session's own values again after each migration it applies), also in
// several databases of one cluster at once (a role they all miss, which is the cluster's, is
// created once). conn's role becomes the owner of what it creates, and the SECURITY DEFINER
// functions run with its rights: run it as the role that should own schema idem (not a
// superuser in production, not the services' role). conn must not be in a transaction:
// Migrate refuses one that is, and changes nothing. When a role is missing and conn's role
// may not create it, the error (SQLSTATE 42501) carries a hint that names the superuser step;
// the error's text ends with it, "(hint: ...)".
func Migrate(ctx context.Context, conn *pgx.Conn, opts Options) error {
	return idemsql.Migrate(ctx, conn, idemsql.Options{AppRole: opts.AppRole, OperatorRole: opts.OperatorRole})
}

// Version is the schema version Migrate brings a database to (idem.SchemaVersion).
func Version() int { return idemsql.Version() }

// The roles Migrate grants to by default.
const (
	// DefaultAppRole is the application role: the services log in as members of it.
	DefaultAppRole = idemsql.DefaultAppRole
	// DefaultOperatorRole is the operators' role: people who support the API are members of
	// it.
	DefaultOperatorRole = idemsql.DefaultOperatorRole
)

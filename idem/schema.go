package idem

import (
	"context"
	"errors"

	"github.com/pgidem/pgidem/internal/dbidem"
	"github.com/pgidem/pgidem/sql/migrations"
)

// Two roles: the schema's owner migrates it (package idemmigrate, sql/idem.sql or `server
// migrate`), once per release, before the service starts; the service logs in as a member of
// the application role (idem_app) and only checks the version (CheckSchema, which New runs).

// SchemaVersion is the schema version this package needs: the number of its migrations, which
// idem.idem_version() reports for the schema and for the functions after a migrate of this
// release.
func SchemaVersion() int { return migrations.Version() }

// SchemaError is CheckSchema's answer for a database whose schema idem is not the version this
// package needs; its message says what to run. errors.Is finds ErrNotMigrated in it, or
// ErrSchemaNewer for a newer schema.
type SchemaError struct {
	// Want is the version this package needs (SchemaVersion).
	Want int
	// Schema is the database's version (idem.schema_version); 0 when there is no schema
	// idem, or one older than 0.2.0.
	Schema int
	// Functions is the version the installed functions belong to; 0 when Schema is.
	Functions int
	// Raised is the error a newer schema's idem_serves_version raised instead of answering
	// (it then serves nothing, and the message says so); empty when it answered, or was not
	// asked.
	Raised string
}

// Error says what differs and what to run.
func (e *SchemaError) Error() string { return (*dbidem.SchemaError)(e).Error() }

// Unwrap returns ErrSchemaNewer for a newer schema, else ErrNotMigrated.
func (e *SchemaError) Unwrap() error { return (*dbidem.SchemaError)(e).Unwrap() }

// The errors of the schema check (CheckSchema) and of a role that may not call the SQL API.
var (
	// ErrNotMigrated: the database has no schema idem, an older one, or functions of another
	// version beside it: run the migrate as the schema's owner (CheckSchema's SchemaError
	// says how). At request time (a migrate under running servers) the middleware answers it
	// with 503 store_unavailable, which a client retries against the servers of the new
	// release.
	ErrNotMigrated = dbidem.ErrNotMigrated
	// ErrSchemaNewer: the database's schema idem was installed by a newer release that no
	// longer serves this one's code (idem.idem_serves_version): upgrade this module.
	ErrSchemaNewer = dbidem.ErrSchemaNewer
	// ErrPermissionDenied: the role may not call a function of the SQL API (SQLSTATE 42501):
	// it is not a member of the application role (idem_app), or, for the operators'
	// functions, of the operator role (idem_operator). The middleware answers it with 500
	// idempotency_misconfigured.
	ErrPermissionDenied = dbidem.ErrPermissionDenied
)

// CheckSchema tells whether the database behind q carries the schema this package needs, and
// changes nothing (the application role may call it): nil when the schema and its functions
// are at SchemaVersion, or at a newer release's version whose SQL API still serves this one
// (idem.idem_serves_version: during a rolling upgrade, after the next release's migrate and
// before this process is replaced, it starts and serves as before); a *SchemaError when they
// are missing, older, newer and not serving this version, or of two versions; an error
// wrapping ErrPermissionDenied, naming the GRANT it lacks, when q's role is in neither role
// of the SQL API (idem_version is granted to both); the database's error when it could not be
// asked (IsUnavailable tells); an error naming the setting when the connection's
// client_encoding is not UTF8 (pgx sends Go's strings as UTF-8 whatever the session says: a
// role's or database's client_encoding of LATIN1 stored principals garbled, and a repeat on a
// connection of the other encoding ran again). New, StartCleaner and the first Do or DoLease on a pool run it,
// and then check that the role may call the application's functions (idem_begin; the
// cleaner's idem_cleanup_workers and idem_cleanup_leased): a member of idem_operator alone
// is ErrPermissionDenied there.
func CheckSchema(ctx context.Context, q Querier) error {
	err := dbidem.CheckSchema(ctx, q, SchemaVersion())
	var se *dbidem.SchemaError
	if errors.As(err, &se) {
		return (*SchemaError)(se)
	}
	return err
}

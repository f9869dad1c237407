package dbidem

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// MaxInterval is the longest TTL or lease the SQL API takes: interval '10 years', which
// PostgreSQL counts as 120 months of 30 days (3,600 days). Longer is refused (22023).
const MaxInterval = 120 * 30 * 24 * time.Hour

// MaxLockTimeout is PostgreSQL's largest lock_timeout (INT_MAX milliseconds, about 24 days).
const MaxLockTimeout = (1<<31 - 1) * time.Millisecond

// ErrSchemaNewer: the database's schema idem was installed by a newer release than the code
// that calls it, which does not serve this code's version (idem.idem_serves_version): upgrade
// the code.
var ErrSchemaNewer = errors.New("idem: database schema newer than this code")

// ErrPermissionDenied: the role may not call a function of the SQL API (42501): it is not a
// member of the application role (or, for the operators' functions, of the operator role).
// A deployment error, not a reason to retry.
var ErrPermissionDenied = errors.New("idem: permission denied")

// SchemaError is what CheckSchema finds when the database's schema idem is not the one the
// code needs. It unwraps to ErrNotMigrated, or to ErrSchemaNewer for a newer schema.
type SchemaError struct {
	// Want is the schema version the code needs.
	Want int
	// Schema is the database's (idem.schema_version); 0 when there is no schema idem, or one
	// older than 0.2.0 (which had no idem_version()).
	Schema int
	// Functions is the schema version the installed functions belong to; 0 when Schema is.
	Functions int
	// Raised is the error a newer schema's idem_serves_version raised instead of answering
	// (it then serves nothing); empty when it answered, or was not asked.
	Raised string
}

// migrateHint is how to install or upgrade schema idem, as every error that needs it says.
// A library user has the first two; the reference server's command comes last.
const migrateHint = "as the role that owns schema idem, run idemmigrate.Migrate (package github.com/pgidem/pgidem/idem/idemmigrate) " +
	"or `psql -v ON_ERROR_STOP=1 -f sql/idem.sql` (or, for the reference server, `server migrate`), then start again"

func (e *SchemaError) Error() string {
	switch {
	case e.Schema == 0:
		return fmt.Sprintf("idem: schema idem is not installed in this database (or predates 0.2.0), and this code needs version %d: %s",
			e.Want, migrateHint)
	case e.Schema < e.Want:
		return fmt.Sprintf("idem: schema idem is at version %d and this code needs version %d: %s", e.Schema, e.Want, migrateHint)
	case e.Schema > e.Want && e.Raised != "":
		return fmt.Sprintf("idem: schema idem is at version %d, newer than this code's %d, and its idem_serves_version(%d) raised an error "+
			"instead of answering (%s), so it serves no code of this version: fix or finish that release's install, or upgrade github.com/pgidem/pgidem",
			e.Schema, e.Want, e.Want, e.Raised)
	case e.Schema > e.Want:
		return fmt.Sprintf("idem: schema idem is at version %d, newer than this code's %d: upgrade github.com/pgidem/pgidem", e.Schema, e.Want)
	}
	return fmt.Sprintf("idem: the installed functions belong to schema version %d but the schema is at %d (an install stopped half way): %s",
		e.Functions, e.Schema, migrateHint)
}

// Unwrap returns ErrSchemaNewer for a newer schema, else ErrNotMigrated.
func (e *SchemaError) Unwrap() error {
	if e.Schema > e.Want {
		return ErrSchemaNewer
	}
	return ErrNotMigrated
}

// CheckSchema reads idem.idem_version() and returns nil when both the schema and its
// functions are at version want, or at a newer release's version whose SQL API still serves
// code of version want (idem.idem_serves_version: the previous release during a rolling
// upgrade); a *SchemaError when they are not (missing, older, newer and not serving it, or
// functions of another version beside the schema); an error wrapping ErrPermissionDenied
// when the role may not call the API, naming the grant it lacks; the database's error when
// it cannot be asked (IsUnavailable tells); an error naming the setting when the connection's
// client_encoding is not UTF8 (D232). It changes nothing: the application role may call it.
func CheckSchema(ctx context.Context, q Querier, want int) error {
	var functions, schema int32
	var encoding string
	err := q.QueryRow(ctx, `SELECT functions_version, schema_version, pg_catalog.current_setting('client_encoding')
		FROM idem.idem_version()`).Scan(&functions, &schema, &encoding)
	var pgErr *pgconn.PgError
	switch {
	case err == nil && encoding != "UTF8":
		// pgx sends Go's strings, UTF-8, as text in the session's client_encoding: under
		// LATIN1 a principal "müller" was stored as "mÃ¼ller" (another key than any other
		// client's), and a repeat sent on a connection of the other encoding ran again (D232).
		return fmt.Errorf("idem: the connection's client_encoding is %s, and the Go driver sends and reads UTF-8: "+
			"set client_encoding=UTF8 in the connection string (or drop the role's or the database's client_encoding setting)", encoding)
	case errors.As(err, &pgErr) && (pgErr.Code == "42883" || pgErr.Code == "3F000" || pgErr.Code == "42P01"):
		return &SchemaError{Want: want}
	case errors.As(err, &pgErr) && pgErr.Code == "42501":
		var user string
		_ = q.QueryRow(ctx, `SELECT current_user`).Scan(&user)
		return fmt.Errorf("%w: the role %q may not call the idem SQL API (%s): %s: %w",
			ErrPermissionDenied, user, pgErr.Message, grantAdvice(user), err)
	case err != nil:
		return fmt.Errorf("idem: check the schema version: %w", err)
	case int(schema) == want && int(functions) == want:
		return nil
	case int(schema) > want && int(functions) == int(schema):
		// A newer release's migrate (a rolling upgrade: this code still serves until it is
		// replaced). That release says whether it keeps what this code calls.
		serves, raised, err := servesVersion(ctx, q, want, int(schema))
		switch {
		case err != nil:
			return err
		case serves:
			return nil
		}
		return &SchemaError{Want: want, Schema: int(schema), Functions: int(functions), Raised: raised}
	}
	return &SchemaError{Want: want, Schema: int(schema), Functions: int(functions)}
}

// The functions New, StartCleaner and Do check that their role may call (CheckCall).
const (
	BeginSignature          = "idem.idem_begin(text,text,text,bytea,interval,interval,jsonb,interval)"
	CleanupWorkersSignature = "idem.idem_cleanup_workers(integer,double precision,interval)"
	CleanupLeasedSignature  = "idem.idem_cleanup_leased(uuid,integer,double precision,boolean)"
)

// CheckCall tells whether q's role may call the SQL API's function fn (a signature, as
// to_regprocedure reads it): nil when it may, or when there is no such function (CheckSchema
// tells that); an error wrapping ErrPermissionDenied, naming the grant, when it may not. A
// member of the operator role alone passes CheckSchema (idem_version is granted to both
// roles) and may call none of the application's functions. It changes nothing.
func CheckCall(ctx context.Context, q Querier, fn string) error {
	var may *bool
	var user string
	err := q.QueryRow(ctx, `SELECT has_function_privilege(f.p, 'EXECUTE'), current_user::text
		FROM (SELECT to_regprocedure($1) AS p) AS f`, fn).Scan(&may, &user)
	switch {
	case err != nil:
		return fmt.Errorf("idem: check the role's privileges: %w", err)
	case may != nil && !*may:
		return fmt.Errorf("%w: the role %q may not call %s (a member of idem_operator alone may call only the operators' functions): %s",
			ErrPermissionDenied, user, fn, grantAdvice(user))
	}
	return nil
}

// grantAdvice is how a role gets the application's functions. The schema's owner may not
// grant idem_app unless it has ADMIN OPTION on it (or CREATEROLE): an owner made as
// docs/sql-api.md says has neither. A superuser may.
func grantAdvice(user string) string {
	return fmt.Sprintf("have a superuser (or a role with ADMIN OPTION on idem_app, or CREATEROLE) run GRANT idem_app TO %q "+
		"(idem_app: the application role Migrate granted the API to)", user)
}

// servesVersion asks idem.idem_serves_version whether the installed release serves code of
// version want. Its answer counts only when it also serves its own version (installed): the
// function of an older release left in place (none is ever dropped) answers no for it. A
// function that is missing, or answers NULL, serves nothing. CheckSchema may run in the
// caller's transaction, which it leaves as it was: the function and the privilege are looked
// up before the call, and in a transaction the call runs under a savepoint, rolled back to when
// the newer release's function raises; raised is then its error, which serves nothing.
func servesVersion(ctx context.Context, q Querier, want, installed int) (serves bool, raised string, err error) {
	var exists, may bool
	err = q.QueryRow(ctx, `SELECT p IS NOT NULL, p IS NOT NULL AND has_function_privilege(p, 'EXECUTE')
		FROM (SELECT to_regprocedure('idem.idem_serves_version(integer)') AS p) AS f`).Scan(&exists, &may)
	switch {
	case err != nil:
		return false, "", fmt.Errorf("idem: check the schema version: %w", err)
	case !exists:
		return false, "", nil
	case !may:
		var user string
		_ = q.QueryRow(ctx, `SELECT current_user`).Scan(&user)
		return false, "", fmt.Errorf("%w: the role %q may not call idem.idem_serves_version, which the migrate of the schema's newer "+
			"release (version %d) grants to the application and operator roles (idem_app, idem_operator): make the role a member of one",
			ErrPermissionDenied, user, installed)
	}
	block, known := inTransaction(q)
	if block || !known {
		// Where q does not say, the savepoint asks: outside a transaction block it fails
		// (25P01) and changes nothing.
		_, err := q.Exec(ctx, `SAVEPOINT idem_check_schema`)
		var pgErr *pgconn.PgError
		switch {
		case err == nil:
			block = true
		case !known && errors.As(err, &pgErr) && pgErr.Code == "25P01":
		default:
			return false, "", fmt.Errorf("idem: check the schema version: %w", err)
		}
	}
	err = q.QueryRow(ctx, `SELECT coalesce(idem.idem_serves_version($1) AND idem.idem_serves_version($2), false)`,
		int32(want), int32(installed)).Scan(&serves)
	if block {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) {
			if _, rerr := q.Exec(ctx, `ROLLBACK TO SAVEPOINT idem_check_schema`); rerr != nil {
				return false, "", fmt.Errorf("idem: check the schema version: %w", errors.Join(err, rerr))
			}
		}
		if _, rerr := q.Exec(ctx, `RELEASE SAVEPOINT idem_check_schema`); rerr != nil && err == nil {
			return false, "", fmt.Errorf("idem: check the schema version: %w", rerr)
		}
	}
	switch {
	case functionRaised(err):
		return false, err.Error(), nil // it raised: the database answered, and not yes
	case err != nil:
		return false, "", fmt.Errorf("idem: check the schema version: %w", err)
	}
	return serves, "", nil
}

// functionRaised tells whether err is an error a function raised of its own (the database
// answered), not the connection's or the session's: unavailability (IsUnavailable), a cancel
// or a statement timeout (57), a serialization failure or deadlock (40), a lock timeout
// (55P03), too little of a resource (53). Those ask the question again later.
func functionRaised(err error) bool {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || IsUnavailable(err) || pgErr.Code == "55P03" {
		return false
	}
	switch pgErr.Code[:2] {
	case "08", "40", "53", "57":
		return false
	}
	return true
}

// inTransaction tells whether q's statements run in an open transaction block, where q says
// (known): by its connection's state (pgx.Tx, *pgx.Conn, *pgxpool.Conn); a *pgxpool.Pool runs
// each statement on its own.
func inTransaction(q Querier) (block, known bool) {
	var conn *pgconn.PgConn
	switch c := q.(type) {
	case *pgxpool.Pool:
		return false, true
	case pgx.Tx:
		conn = c.Conn().PgConn()
	case *pgx.Conn:
		conn = c.PgConn()
	case *pgxpool.Conn:
		conn = c.Conn().PgConn()
	default:
		return false, false
	}
	return conn.TxStatus() != 'I', true
}

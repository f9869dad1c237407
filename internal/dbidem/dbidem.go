// Package dbidem is the thin Go driver of the idem SQL API (schema idem, see
// docs/sql-api.md). It calls the PL/pgSQL functions in the caller's pgx transaction and
// maps what they return to Go values; every decision (expiry, fingerprint comparison,
// state transitions, fencing) is made by the functions.
//
// The usual flow, with [RunTx] owning the transaction:
//
//	err := dbidem.RunTx(ctx, pool, dbidem.TxOptions{}, func(tx *dbidem.Tx) error {
//		d, err := tx.Claim(ctx, claim)
//		if err != nil || d.Outcome != dbidem.Claimed {
//			return err // replay, mismatch: answer from d without doing the work
//		}
//		// ... the work, through tx (a pgx.Tx) ...
//		tx.CompleteOnCommit(response)
//		return nil
//	})
//
// Tx.Claim sends BEGIN, idem_begin and a savepoint in one round trip, and RunTx sends the
// completion with COMMIT, so a keyed transaction costs no more round trips than the same
// transaction without a key. [Do] wraps the flow for work that is not HTTP.
package dbidem

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Outcome is what idem_begin decided.
type Outcome string

// The outcomes of [Begin] and [Tx.Claim].
const (
	// Claimed: this transaction holds the key; do the work, then complete it.
	Claimed Outcome = "claimed"
	// Replay: the key was completed for the same request; answer with Decision.Response.
	Replay Outcome = "replay"
	// Mismatch: the key was used for another request; refuse.
	Mismatch Outcome = "mismatch"
	// InProgress: a lease claim on the key is still running; retry after RetryAfter.
	InProgress Outcome = "in_progress"
)

// Reasons a stored response has no body (Response.Withheld).
const (
	// WithheldOneTimeSecret: the response carried a secret that must be sent only once.
	WithheldOneTimeSecret = "one_time_secret"
	// WithheldTooLarge: the body was larger than the storage limit.
	WithheldTooLarge = "too_large"
)

// KeyTable is the key table (schema and name); GuardConstraint is its deferred foreign key
// that refuses to commit a transactional claim without its completion.
const (
	KeyTable        = "idempotency_keys"
	GuardConstraint = "idempotency_keys_claim_completed_in_its_transaction"
)

// Claim is the request that claims a key. A zero TTL or LockTimeout means the SQL API's
// own default (see [ReadDefaults]); a zero Lease means a transactional claim.
type Claim struct {
	// Principal owns the key: 1 to 255 characters.
	Principal string
	// Key is the client's idempotency key: 1 to 255 visible ASCII characters.
	Key string
	// Action names what the request does, for example "POST /v1/transfers".
	Action string
	// Fingerprint is the SHA-256 of the request (canon.Compute).
	Fingerprint [32]byte
	// Fields are the hex SHA-256 of each top-level member of a JSON object body
	// (canon.Fingerprint.Fields; 16 hex digits are enough); nil when unknown. They let a
	// mismatch name what changed.
	Fields map[string]string
	// TTL is how long the key's answer stays replayable after it is stored. 0: the SQL default
	// (24 hours). Sent in whole microseconds, rounded up (as Lease and LockTimeout are).
	TTL time.Duration
	// Lease makes a lease claim that may be committed on its own, for work outside the
	// database; at most TTL. 0: a transactional claim, completed in the same transaction.
	Lease time.Duration
	// LockTimeout bounds the wait for a concurrent holder of the key. 0: the SQL default
	// (2 seconds). Past it the claim returns ErrInProgress and the transaction is aborted.
	LockTimeout time.Duration
}

// Response is a stored HTTP response (or, for [Do], a stored JSON result).
type Response struct {
	// Status is the HTTP status, 100 to 599.
	Status int
	// Header holds the stored headers (an allowlist chosen by the caller), each line as it
	// was: a header with several values comes back with the same values, and bytes that are
	// not UTF-8 come back as they were (docs/sql-api.md, "Stored headers"). A line feed or
	// carriage return inside a line, which no header line can carry, is stored as a space, as
	// net/http sends it.
	Header http.Header
	// Body is the body byte for byte (one stored empty replays as empty, one stored nil as
	// nil); nil when withheld.
	Body []byte
	// ResourceID is the id of what the first request created, when the caller named it.
	ResourceID string
	// Withheld is "" or why Body is not stored: WithheldOneTimeSecret, WithheldTooLarge.
	Withheld string
}

// Decision is what idem_begin answered.
type Decision struct {
	// Outcome is the decision.
	Outcome Outcome
	// Attempt is the fencing token of the claim (Claimed), or of the row's last claim:
	// pass it to Complete or Release. No earlier holder of the key ever had it.
	Attempt int64
	// Response is the stored response (Replay only).
	Response Response
	// ChangedFields names the top-level fields whose hashes differ (Mismatch only), sorted by
	// code point (sort.Strings's order, whatever the database's collation); empty (not nil)
	// when the action, method or path changed; nil when unknown.
	ChangedFields []string
	// RetryAfter is how long the current lease still runs (InProgress only).
	RetryAfter time.Duration
	// ProviderKey is the key to hand an outside provider (a payment provider's own
	// idempotency key) for the work of this request (Claimed, Replay and InProgress): 64 hex
	// digits, the same for every attempt of the request (retries, takeovers of its lease after
	// a crash), different for every other request, including a later one under the same key
	// after this one expired or was released, and for every other principal. It follows the
	// key's generation, not the client's key (docs/sql-api.md, "Generations and provider keys").
	// A transactional claim commits with the work or not at all: when its transaction rolls
	// back, so does its generation, and the next attempt's claim has a new ProviderKey (work
	// outside the database takes a lease).
	ProviderKey string
	// RecoveryPoint is the last step that the key's current generation recorded (RecordStep,
	// Step), told to a takeover of its lease (Claimed) so that it goes on after it; "" when
	// none (a fresh generation always).
	RecoveryPoint string
	// Steps are the steps recorded in the generation, each by name with the JSON value it
	// saved (Claimed by a takeover only; nil when none). Read by Begin, a lease claim and Do's
	// claim, not by Tx.Claim of another transactional claim.
	Steps map[string]json.RawMessage
	// Sent is this process's clock just before the claim was sent. A lease claimed by it runs
	// at least until Sent plus the lease by this process's clock, since the database counts
	// the lease from when it received the claim: the local deadline of KeepAlive
	// (LeaseOptions.Start).
	Sent time.Time
}

// Querier is what the package-level functions need: a pgx.Tx, *pgx.Conn or *pgxpool.Pool.
type Querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// Errors. Each wraps the error it came from (errors.As finds a *pgconn.PgError).
var (
	// ErrInProgress: a concurrent holder kept the key past the lock timeout (SQLSTATE
	// 55P03, or 57014 when the server's statement_timeout ended the wait first: claimError),
	// or (from a Gate) a request of this process holds it. The transaction is aborted; answer
	// 409 and let the client retry.
	ErrInProgress = errors.New("idem: request in progress")
	// ErrClaimLost: Complete found no claim in progress with this attempt (55000): the
	// lease was taken over by a later attempt, or the claim was released or completed.
	ErrClaimLost = errors.New("idem: claim lost")
	// ErrUnknownPrincipal: the principal violates a foreign key that the application put on
	// the key table's principal_id (23503 on the key table, not the guard): answer 401.
	ErrUnknownPrincipal = errors.New("idem: unknown principal")
	// ErrClaimNotCompleted: COMMIT refused a transactional claim without its completion
	// (23503 on GuardConstraint). Everything in the transaction was rolled back.
	ErrClaimNotCompleted = errors.New("idem: claim committed without its completion")
	// ErrInvalidArgument: the functions refused an argument (22004, 22023), or PostgreSQL a
	// text argument it cannot hold (22021: bytes that are not UTF-8, U+0000; 22P05): a caller
	// or configuration error, not a reason to retry.
	ErrInvalidArgument = errors.New("idem: invalid argument")
	// ErrCommitUnknown: the connection failed after COMMIT was sent and before its answer
	// came back: the transaction may or may not have committed. A retry with the same key
	// tells which (it replays, or it runs).
	ErrCommitUnknown = errors.New("idem: commit outcome unknown")
	// ErrMismatch is returned by Do when the key was used with another input.
	ErrMismatch = errors.New("idem: idempotency key reused with another request")
	// ErrNotMigrated: the database has no (or an older) idem schema: run the migrations.
	ErrNotMigrated = errors.New("idem: database not migrated")
	// ErrStoreBusy: a claim's probes (Gate) found the key table itself locked, not a key (a
	// migration's swap, VACUUM FULL, pg_repack, LOCK TABLE): nothing was written; answer 503
	// with Retry-After and let the client retry. A claim does not wait for such a lock, so a
	// locked table costs no pool connections and stalls nothing else; LOCK TABLE ... IN
	// EXCLUSIVE MODE (which lets reads through) is one too, for the claim of a fresh key and of
	// an expired, released or run-out one alike.
	ErrStoreBusy = errors.New("idem: the key table is locked")
)

// claimError is classify for a claim's statement (idem_begin) sent on ctx. A 57014
// (query_canceled) that ctx did not cause is the server ending the claim's wait before its
// lock timeout: a statement_timeout below the lock timeout (a DBA's guard rail), or
// pg_cancel_backend. Another request holds the key all the same: the wait is answered as one
// that ran out, ErrInProgress (D163; for Tx.Claim and Begin too, D227).
func claimError(ctx context.Context, err error) error {
	var pgErr *pgconn.PgError
	if ctx.Err() == nil && errors.As(err, &pgErr) && pgErr.Code == "57014" {
		return fmt.Errorf("%w: the claim was cancelled by the server before its lock timeout "+
			"(a statement_timeout below it?): %w", ErrInProgress, err)
	}
	return classify(err)
}

// classify wraps an error from the SQL API in the sentinel that describes it.
func classify(err error) error {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return err
	}
	switch pgErr.Code {
	case "55P03":
		return fmt.Errorf("%w: %w", ErrInProgress, err)
	case "55000":
		return fmt.Errorf("%w: %w", ErrClaimLost, err)
	case "22004", "22023", "22021", "22P05":
		// 22021 and 22P05: a text argument PostgreSQL cannot hold (bytes that are not UTF-8,
		// U+0000), refused before the function runs; as final as the functions' own refusals.
		return fmt.Errorf("%w: %w", ErrInvalidArgument, err)
	case "23503":
		switch {
		case isGuardViolation(pgErr):
			return fmt.Errorf("%w: %w", ErrClaimNotCompleted, err)
		case isKeyTableViolation(pgErr):
			return fmt.Errorf("%w: %w", ErrUnknownPrincipal, err)
		}
	case "42883", "3F000", "42P01":
		// undefined_function, invalid_schema_name, undefined_table: no idem schema here.
		return fmt.Errorf("%w: %w", ErrNotMigrated, err)
	case "42501":
		// insufficient_privilege: the role is not a member of the role the API is granted to.
		return fmt.Errorf("%w: %w", ErrPermissionDenied, err)
	}
	return err
}

// The forms of a foreign-key violation (23503) on the key table. PostgreSQL names the schema,
// table and constraint in the error's fields. A Citus worker's error reaches the client
// through the coordinator without them (only the code, message, detail and where survive),
// and names the shard: constraint "idempotency_keys_claim_completed_in_its_transaction_102017"
// on table "idempotency_keys_102017". So the fields decide where they are set, and where they
// are empty the identifiers in the message (which are not translated) and the function the
// error came from (the where field) do.

// isGuardViolation: the commit guard refused a transactional claim without its completion.
func isGuardViolation(e *pgconn.PgError) bool {
	if e.ConstraintName != "" {
		return e.ConstraintName == GuardConstraint
	}
	return strings.Contains(e.Message, `"`+GuardConstraint+`"`) || strings.Contains(e.Message, `"`+GuardConstraint+`_`)
}

// isKeyTableViolation: another foreign key of the key table (the application's reference to
// its principals) refused a claim or a final answer.
func isKeyTableViolation(e *pgconn.PgError) bool {
	if e.TableName != "" {
		return e.TableName == KeyTable && e.SchemaName == "idem"
	}
	return strings.Contains(e.Where, "PL/pgSQL function idem.idem_begin(") ||
		strings.Contains(e.Where, "PL/pgSQL function idem.idem_save_final(")
}

// isCitusCommitFailure: Citus could not commit a shard's part of a transaction that ran on
// one worker: the worker's COMMIT failed (its deferred constraints, the commit guard among
// them, are checked there), and nothing was committed. The error carries Citus' own routine
// name; the worker's reason arrives before it as a WARNING.
func isCitusCommitFailure(e *pgconn.PgError) bool {
	return e.Code == "XX000" && e.Routine == "ErrorIfPostCommitFailedShardPlacements"
}

// IsUnavailable tells whether err says the database could not be reached or dropped the
// connection: refused or failed connections, network errors, a connection closed mid-way,
// and the server's own connection errors (class 08), shutdown (57P01, 57P02, 57P03) and "too
// many connections" (53300). A retry may succeed once the database is back: an HTTP server
// answers 503 with Retry-After, not 500. A context that ended (a deadline, a cancellation) is
// not unavailability, though the network errors it causes look alike: false.
func IsUnavailable(err error) bool {
	if err == nil || errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) {
		return false
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		switch pgErr.Code {
		case "57P01", "57P02", "57P03", "53300":
			return true
		}
		return strings.HasPrefix(pgErr.Code, "08")
	}
	var connectErr *pgconn.ConnectError
	var netErr net.Error
	return errors.As(err, &connectErr) || errors.As(err, &netErr) ||
		errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, net.ErrClosed) ||
		errors.Is(err, pgconn.ErrConnClosed)
}

// IsRetryable tells whether err is a serialization failure (40001) or a deadlock (40P01):
// the whole transaction may be run again.
func IsRetryable(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && (pgErr.Code == "40001" || pgErr.Code == "40P01")
}

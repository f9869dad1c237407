// Package dbidem is the thin Go driver of the idem SQL API (schema idem, see
// docs/sql-api.md). It calls the PL/pgSQL functions in the caller's pgx transaction and
// maps what they return to Go values; every decision (expiry, fingerprint comparison,
// state transitions, fencing) is made by the functions.
//
// The usual flow, with [RunTx] owning the transaction:
//
//	err := dbidem.RunTx(ctx, pool, dbidem.TxOptions{}, func(tx *dbidem.Tx) error {
//		d, err := tx.Begin(ctx, claim)
//		if err != nil || d.Outcome != dbidem.Claimed {
//			return err // replay, mismatch: answer from d without doing the work
//		}
//		// ... the work, through tx ...
//		tx.CompleteOnCommit(claim.Principal, claim.Key, d.Attempt, response)
//		return nil
//	})
//
// CompleteOnCommit sends idem_complete in the same round trip as COMMIT, so a keyed
// transaction costs one round trip more than the same transaction without a key (the
// idem_begin call). [Do] wraps the flow for work that is not HTTP.
package dbidem

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Outcome is what idem_begin decided.
type Outcome string

// The outcomes of [Begin].
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

// GuardConstraint is the deferred foreign key that refuses to commit a transactional claim
// without its completion.
const GuardConstraint = "idempotency_keys_claim_completed_in_its_transaction"

// Claim is the request that claims a key.
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
	// (canon.Fingerprint.Fields); nil when unknown. They let a mismatch name what changed.
	Fields map[string]string
	// TTL is how long the key stays valid from its creation. 0: DefaultTTL. Sent with
	// microsecond precision.
	TTL time.Duration
	// Lease makes a lease claim that may be committed on its own, for work outside the
	// database; at most TTL. 0: a transactional claim, completed in the same transaction.
	Lease time.Duration
	// LockTimeout bounds the wait for a concurrent holder of the key. 0: the function's
	// default, 2 seconds. Past it Begin returns ErrInProgress and the transaction is aborted.
	LockTimeout time.Duration
}

// DefaultTTL is the TTL of a Claim that sets none; it is idem_begin's own default.
const DefaultTTL = 24 * time.Hour

func (c Claim) ttl() time.Duration {
	if c.TTL == 0 {
		return DefaultTTL
	}
	return c.TTL
}

// Response is a stored HTTP response (or, for [Do], a stored JSON result).
type Response struct {
	// Status is the HTTP status, 100 to 599.
	Status int
	// Header holds the stored headers (an allowlist chosen by the caller).
	Header http.Header
	// Body is the body byte for byte; nil when withheld.
	Body []byte
	// ResourceID is the id of what the first request created, when known.
	ResourceID string
	// Withheld is "" or why Body is not stored: WithheldOneTimeSecret, WithheldTooLarge.
	Withheld string
}

// Decision is what idem_begin answered.
type Decision struct {
	// Outcome is the decision.
	Outcome Outcome
	// Attempt is the fencing token of the claim: pass it to Complete or Release.
	Attempt int
	// Response is the stored response (Replay only).
	Response Response
	// ChangedFields names the top-level fields whose hashes differ (Mismatch only): sorted;
	// empty (not nil) when the action, method or path changed; nil when unknown.
	ChangedFields []string
	// RetryAfter is how long the current lease still runs (InProgress only).
	RetryAfter time.Duration
}

// Querier is what the functions need: a pgx.Tx, *pgx.Conn or *pgxpool.Pool.
type Querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// Errors. Each wraps the *pgconn.PgError it came from (errors.As finds it).
var (
	// ErrInProgress: a concurrent holder kept the key past the lock timeout (SQLSTATE
	// 55P03). The transaction is aborted; answer 409 and let the client retry.
	ErrInProgress = errors.New("dbidem: request in progress")
	// ErrClaimLost: Complete found no claim in progress with this attempt (55000): the
	// lease was taken over by a later attempt, or the claim was released or completed.
	ErrClaimLost = errors.New("dbidem: claim lost")
	// ErrUnknownPrincipal: the principal violates a foreign key that the application put on
	// idempotency_keys.principal_id (23503): answer 401.
	ErrUnknownPrincipal = errors.New("dbidem: unknown principal")
	// ErrClaimNotCompleted: COMMIT refused a transactional claim without its completion
	// (23503 on GuardConstraint). Everything in the transaction was rolled back.
	ErrClaimNotCompleted = errors.New("dbidem: claim committed without its completion")
	// ErrInvalidArgument: the functions refused an argument (22004, 22023).
	ErrInvalidArgument = errors.New("dbidem: invalid argument")
	// ErrMismatch is returned by Do when the key was used with another input.
	ErrMismatch = errors.New("dbidem: idempotency key reused with another request")
)

// classify wraps a PostgreSQL error in the sentinel that describes it.
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
	case "22004", "22023":
		return fmt.Errorf("%w: %w", ErrInvalidArgument, err)
	case "23503":
		if pgErr.ConstraintName == GuardConstraint {
			return fmt.Errorf("%w: %w", ErrClaimNotCompleted, err)
		}
		return fmt.Errorf("%w: %w", ErrUnknownPrincipal, err)
	}
	return err
}

// IsRetryable tells whether err is a serialization failure (40001) or a deadlock (40P01):
// the whole transaction may be run again.
func IsRetryable(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && (pgErr.Code == "40001" || pgErr.Code == "40P01")
}

func interval(d time.Duration) *string {
	if d == 0 {
		return nil
	}
	s := fmt.Sprintf("%d microseconds", d.Microseconds())
	return &s
}

// JSON goes to jsonb parameters as a string: under QueryExecModeExec pgx does not know the
// parameter's type and would send a []byte as bytea text.
func fieldsJSON(f map[string]string) *string {
	if f == nil {
		return nil
	}
	b, _ := json.Marshal(f)
	s := string(b)
	return &s
}

const beginSQL = `SELECT outcome, attempt, response_status, response_headers, response_body, resource_id,
       withheld, changed_fields, extract(epoch FROM retry_after)::float8
  FROM idem.idem_begin(p_principal => $1::text, p_key => $2::text, p_action => $3::text,
                       p_request_sha256 => $4::bytea,
                       p_ttl => $5::interval, p_lease => $6::interval,
                       p_request_fields => $7::jsonb, p_lock_timeout => $8::interval)`

// Begin claims c.Key for c.Principal in q's transaction, or returns the decision about the
// row that holds it. With a transactional claim (Lease 0) the transaction must complete
// the claim (Complete, or Tx.CompleteOnCommit) before it commits.
func Begin(ctx context.Context, q Querier, c Claim) (Decision, error) {
	var (
		d        Decision
		outcome  string
		status   *int32
		headers  []byte
		body     []byte
		resource *string
		withheld *string
		retry    *float64
	)
	err := q.QueryRow(ctx, beginSQL, c.Principal, c.Key, c.Action, c.Fingerprint[:], interval(c.ttl()),
		interval(c.Lease), fieldsJSON(c.Fields), interval(c.LockTimeout)).
		Scan(&outcome, &d.Attempt, &status, &headers, &body, &resource, &withheld, &d.ChangedFields, &retry)
	if err != nil {
		return Decision{}, classify(err)
	}
	d.Outcome = Outcome(outcome)
	if status != nil {
		d.Response.Status = int(*status)
		d.Response.Body = body
		if d.Response.Header, err = decodeHeader(headers); err != nil {
			return Decision{}, err
		}
		if resource != nil {
			d.Response.ResourceID = *resource
		}
		if withheld != nil {
			d.Response.Withheld = *withheld
		}
	}
	if retry != nil {
		d.RetryAfter = time.Duration(*retry * float64(time.Second))
	}
	return d, nil
}

// encodeHeader stores a header with one value as a string and one with several as an
// array of strings, so the common case reads naturally in psql.
func encodeHeader(h http.Header) string {
	m := make(map[string]any, len(h))
	for k, v := range h {
		if len(v) == 1 {
			m[k] = v[0]
		} else {
			m[k] = v
		}
	}
	b, _ := json.Marshal(m)
	return string(b)
}

func decodeHeader(b []byte) (http.Header, error) {
	var m map[string]json.RawMessage
	if err := json.Unmarshal(b, &m); err != nil {
		return nil, fmt.Errorf("dbidem: stored headers: %w", err)
	}
	h := make(http.Header, len(m))
	for k, raw := range m {
		var one string
		if json.Unmarshal(raw, &one) == nil {
			h[k] = []string{one}
			continue
		}
		var many []string
		if err := json.Unmarshal(raw, &many); err != nil {
			return nil, fmt.Errorf("dbidem: stored header %q: %w", k, err)
		}
		h[k] = many
	}
	return h, nil
}

func nullable(s string) *string {
	if s == "" {
		return nil
	}
	return &s
}

const completeSQL = `SELECT idem.idem_complete(p_principal => $1::text, p_key => $2::text, p_attempt => $3::integer,
       p_status => $4::integer, p_headers => $5::jsonb, p_body => $6::bytea,
       p_resource_id => $7::text, p_withheld => $8::text)`

func completeArgs(principal, key string, attempt int, r Response) []any {
	return []any{principal, key, attempt, r.Status, encodeHeader(r.Header), r.Body, nullable(r.ResourceID), nullable(r.Withheld)}
}

// Complete stores r as the response of the claim with this attempt. It returns
// ErrClaimLost when that claim is no longer in progress (fencing). Inside RunTx prefer
// Tx.CompleteOnCommit, which saves a round trip.
func Complete(ctx context.Context, q Querier, principal, key string, attempt int, r Response) error {
	_, err := q.Exec(ctx, completeSQL, completeArgs(principal, key, attempt, r)...)
	return classify(err)
}

// Release abandons the claim with this attempt without a response, so that a retry may
// claim the key again. It returns false when no such claim is in progress.
func Release(ctx context.Context, q Querier, principal, key string, attempt int) (bool, error) {
	var ok bool
	err := q.QueryRow(ctx, `SELECT idem.idem_release(p_principal => $1::text, p_key => $2::text, p_attempt => $3::integer)`,
		principal, key, attempt).Scan(&ok)
	return ok, classify(err)
}

// SaveFinal stores r as the final response of c after its work was rolled back (a 404 or
// 422, say), so that a retry replays it. Call it with a pool or connection outside any
// transaction: it is one statement, its own transaction. It returns false when a live row
// for the key already exists (nothing is overwritten).
func SaveFinal(ctx context.Context, q Querier, c Claim, r Response) (bool, error) {
	var ok bool
	err := q.QueryRow(ctx, `SELECT idem.idem_save_final(p_principal => $1::text, p_key => $2::text,
		p_action => $3::text, p_request_sha256 => $4::bytea, p_ttl => $5::interval,
		p_status => $6::integer, p_headers => $7::jsonb, p_body => $8::bytea, p_request_fields => $9::jsonb)`,
		c.Principal, c.Key, c.Action, c.Fingerprint[:], interval(c.ttl()), r.Status, encodeHeader(r.Header),
		r.Body, fieldsJSON(c.Fields)).Scan(&ok)
	return ok, classify(err)
}

// Cleanup deletes expired keys in batches of batchSize (idem_cleanup) until a batch comes
// back short, and returns how many it deleted. Pass a pool or a connection outside any
// transaction, so that each batch is its own short transaction. When ctx ends first it
// returns the count so far and ctx.Err(). Safe to run from several processes at once.
func Cleanup(ctx context.Context, q Querier, batchSize int) (int, error) {
	total := 0
	for {
		if err := ctx.Err(); err != nil {
			return total, err
		}
		var n int
		if err := q.QueryRow(ctx, `SELECT idem.idem_cleanup(p_batch_size => $1::integer)`, batchSize).Scan(&n); err != nil {
			if ctx.Err() != nil {
				return total, ctx.Err()
			}
			return total, classify(err)
		}
		total += n
		if n < batchSize {
			return total, nil
		}
	}
}

package idem

import (
	"context"
	"encoding/json"
	"net/http"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/internal/dbidem"
)

// The driver of the SQL API, for work that is not HTTP (a queue consumer, a cron job) and
// for callers that run the key's transaction themselves. Its implementation is in
// internal/dbidem; the types here are this package's own.

// Querier is what the functions that run one statement take: a pgx.Tx, a *pgx.Conn or a
// *pgxpool.Pool.
type Querier interface {
	// QueryRow runs a query that returns at most one row.
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	// Query runs a query.
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	// Exec runs a statement.
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// Pool is what RunTx, Do and DoLease run on: a *pgxpool.Pool.
type Pool interface {
	// Acquire takes a connection from the pool.
	Acquire(ctx context.Context) (*pgxpool.Conn, error)
	Querier
}

// TxOptions configure RunTx. The zero value is READ COMMITTED, 3 attempts, 10ms backoff.
type TxOptions struct {
	// TxOptions are pgx's: isolation level, access mode. Default READ COMMITTED, the level
	// the SQL API is designed for (it never raises 40001 there), whatever the role's or the
	// database's default_transaction_isolation.
	pgx.TxOptions
	// MaxAttempts is how many times the unit of work runs when it keeps failing with a
	// serialization failure (40001), a deadlock (40P01) or a lock timeout of its own
	// statements. Default 0: 3; 1 disables retries.
	MaxAttempts int
	// Backoff is the base wait before a retry; the n-th retry waits a random duration in
	// [0, Backoff·2^n). Default 0: 10ms.
	Backoff time.Duration
}

// Tx is the transaction of a unit of work run by RunTx: a pgx.Tx (write the work through it)
// whose Claim claims a key in the same round trip as BEGIN, and whose CompleteOnCommit and
// FinalOnCommit store the answer in the same round trip as COMMIT. RunTx ends it: Commit and
// Rollback return an error; return from the function instead.
type Tx struct{ t *dbidem.Tx }

var _ pgx.Tx = (*Tx)(nil)

// RunTx runs fn in a transaction and commits it when fn returns nil (with a pending answer,
// in the same round trip as COMMIT), or rolls it back and returns fn's error. A unit of work
// whose statements or commit fail with a serialization failure, a deadlock or a lock timeout
// runs again, up to opts.MaxAttempts times, so fn must not keep state from a failed run.
//
// When ctx ends before the commit, the work rolls back. A COMMIT that may wait for a
// synchronous standby is never canceled: a canceled COMMIT that waits for a synchronous standby
// stays on the primary alone and visible there, and a failover loses what a replay has already
// answered. The claim's round trip tells whether it may (synchronous_standby_names is set,
// whatever synchronous_commit says, or Citus is loaded). When ctx ends while
// such a COMMIT runs, RunTx returns ErrCommitUnknown (and ctx's error) at once; the COMMIT goes
// on holding its connection until PostgreSQL answers it, then the connection returns to db.
// Any other COMMIT runs on ctx, as a statement does: when ctx ends while it runs, pgx cancels
// it (it then either did not commit or committed in full) and RunTx returns ErrCommitUnknown.
// A COMMIT that PostgreSQL answers with ROLLBACK (fn left the transaction failed: an error of
// its statements it did not return) committed nothing: RunTx returns pgx.ErrTxCommitRollback.
func RunTx(ctx context.Context, db Pool, opts TxOptions, fn func(tx *Tx) error) error {
	return dbidem.RunTx(ctx, db, dbidem.TxOptions(opts), func(t *dbidem.Tx) error { return fn(&Tx{t}) })
}

// Claim calls idem_begin for c in this transaction, sending BEGIN (if not sent yet),
// idem_begin and a savepoint in one round trip. One claim per transaction. With a
// transactional claim (Lease 0) that is Claimed, end the work with CompleteOnCommit or
// FinalOnCommit; a claim committed without either makes the COMMIT fail
// (ErrClaimNotCompleted).
func (t *Tx) Claim(ctx context.Context, c Claim) (Decision, error) {
	d, err := t.t.Claim(ctx, dbidem.Claim(c))
	return decisionOf(d), err
}

// CompleteOnCommit stores r as the response of this transaction's claim when it commits, in
// the same round trip as COMMIT. If the claim was lost (ErrClaimLost), RunTx rolls back and
// returns the error. After a Claim whose outcome was not Claimed (a replay, a mismatch, a lease
// in progress) the transaction holds no claim to answer: RunTx rolls back and returns an error
// wrapping ErrClaimLost. Without a Claim before it in the transaction, RunTx rolls back and
// returns an error wrapping ErrInvalidArgument (the answer would be stored nowhere), or, after
// a Claim that failed, that Claim's error.
func (t *Tx) CompleteOnCommit(r Response) { t.t.CompleteOnCommit(dbidem.Response(r)) }

// FinalOnCommit stores r as the final answer to this transaction's claim (a 404, a 422): when
// the function returns, RunTx rolls the work back to the savepoint taken right after the
// claim, stores r and commits, in one round trip. After a Claim whose outcome was not Claimed,
// RunTx rolls back and returns an error wrapping ErrClaimLost, as CompleteOnCommit does, and
// without a Claim before it an error wrapping ErrInvalidArgument (after a Claim that failed,
// that Claim's error).
func (t *Tx) FinalOnCommit(r Response) { t.t.FinalOnCommit(dbidem.Response(r)) }

// Begin starts a nested transaction (a savepoint), as pgx.Tx does.
func (t *Tx) Begin(ctx context.Context) (pgx.Tx, error) { return t.t.Begin(ctx) }

// Commit returns an error: RunTx commits when the function returns nil.
func (t *Tx) Commit(ctx context.Context) error { return t.t.Commit(ctx) }

// Rollback returns an error: RunTx rolls back when the function returns an error.
func (t *Tx) Rollback(ctx context.Context) error { return t.t.Rollback(ctx) }

// CopyFrom copies rows into a table in the transaction.
func (t *Tx) CopyFrom(ctx context.Context, table pgx.Identifier, columns []string, src pgx.CopyFromSource) (int64, error) {
	return t.t.CopyFrom(ctx, table, columns, src)
}

// SendBatch sends a batch in the transaction.
func (t *Tx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	return t.t.SendBatch(ctx, b)
}

// LargeObjects returns the large objects of the transaction.
func (t *Tx) LargeObjects() pgx.LargeObjects { return t.t.LargeObjects() }

// Prepare prepares a statement on the transaction's connection.
func (t *Tx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	return t.t.Prepare(ctx, name, sql)
}

// Exec runs a statement in the transaction.
func (t *Tx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	return t.t.Exec(ctx, sql, args...)
}

// Query runs a query in the transaction.
func (t *Tx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	return t.t.Query(ctx, sql, args...)
}

// QueryRow runs a query that returns at most one row in the transaction.
func (t *Tx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	return t.t.QueryRow(ctx, sql, args...)
}

// Conn returns the transaction's connection.
func (t *Tx) Conn() *pgx.Conn { return t.t.Conn() }

// Claim is the request that claims a key (Begin, Tx.Claim).
type Claim struct {
	// Principal owns the key: 1 to 255 characters.
	Principal string
	// Key is the client's idempotency key: 1 to 255 visible ASCII characters.
	Key string
	// Action names what the request does, for example "POST /v1/transfers": 1 to 1000
	// characters.
	Action string
	// Fingerprint is the SHA-256 of the request (ComputeFingerprint's Sum).
	Fingerprint [32]byte
	// Fields are the hex SHA-256 of each top-level member of a JSON object body
	// (Fingerprint.Fields); nil when unknown. They let a mismatch name what changed.
	Fields map[string]string
	// TTL is how long the key's answer stays replayable after it is stored. Default 0: the
	// SQL API's default (24 hours). At most 10 years; sent in whole microseconds, rounded up
	// (as Lease and LockTimeout are).
	TTL time.Duration
	// Lease makes a lease claim that is committed on its own, for work outside the database.
	// Default 0: a transactional claim, completed in the same transaction. At most 10 years.
	Lease time.Duration
	// LockTimeout bounds the wait for a concurrent holder of the key. Default 0: the SQL
	// API's default (2 seconds). Past it, or past a statement_timeout of the role or the
	// database that ends the wait first, the claim returns ErrInProgress and the transaction
	// is aborted.
	LockTimeout time.Duration
}

// Response is a stored answer: an HTTP response, or for Do a JSON result.
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

// Reasons a stored response has no body (Response.Withheld).
const (
	// WithheldOneTimeSecret: the response carried a secret that must be sent only once.
	WithheldOneTimeSecret = "one_time_secret"
	// WithheldTooLarge: the body was larger than the storage limit.
	WithheldTooLarge = "too_large"
)

// Outcome is what idem_begin decided.
type Outcome string

// The outcomes of a claim.
const (
	// Claimed: this transaction holds the key; do the work, then complete it.
	Claimed Outcome = "claimed"
	// Replay: the key was completed for the same request; answer with Decision.Response.
	Replay Outcome = "replay"
	// Mismatch: the key was used for another request; refuse.
	Mismatch Outcome = "mismatch"
	// InProgress: a lease claim on the key is still running; retry after
	// Decision.RetryAfter.
	InProgress Outcome = "in_progress"
)

// Decision is what a claim was answered.
type Decision struct {
	// Outcome is the decision.
	Outcome Outcome
	// Attempt is the fencing token of the claim (Claimed): pass it to Complete, Release,
	// Yield or Extend. No earlier holder of the key ever had it. For another outcome it is
	// the token of the row's last claim, not this call's: this call holds no claim, and
	// passing the token on acts on whoever holds the key (or fails, on a completed key).
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
	// after this one expired or was released, and for every other principal.
	// A transactional claim commits with the work or not at all: when its transaction rolls
	// back, so does its generation, and the next attempt's claim has a new ProviderKey (work
	// outside the database takes a lease).
	ProviderKey string
	// Sent is this process's clock just before the claim was sent. A lease claimed by it runs
	// at least until Sent plus the lease by this process's clock: pass it as
	// LeaseOptions.Start to KeepAlive.
	Sent time.Time
	// RecoveryPoint is the last step (RecordStep) that the key's current generation recorded,
	// told to a takeover of its lease (Claimed) so that it goes on after it; "" when none (the
	// first claim of a generation always). Begin and a lease claim read it; Tx.Claim of a
	// transactional claim does not (it stays ""): such a claim takes a dead lease over only to
	// do all of the request's work in its own transaction.
	RecoveryPoint string
	// Steps are the steps recorded in the generation, each by name with the JSON value it
	// saved (Claimed by a takeover; nil when none): skip them, they are done. Read as
	// RecoveryPoint is.
	Steps map[string]json.RawMessage
}

func decisionOf(d dbidem.Decision) Decision {
	return Decision{Outcome: Outcome(d.Outcome), Attempt: d.Attempt, Response: Response(d.Response),
		ChangedFields: d.ChangedFields, RetryAfter: d.RetryAfter, ProviderKey: d.ProviderKey, Sent: d.Sent,
		RecoveryPoint: d.RecoveryPoint, Steps: d.Steps}
}

// Begin claims c.Key for c.Principal in q's transaction (idem_begin_steps: idem_begin, and
// for a claim the steps its generation recorded), or returns the decision about the row that
// holds it. With a transactional claim (Lease 0) the transaction must
// complete the claim (Complete, or SaveFinal after rolling the work back) before it commits.
// Inside RunTx prefer Tx.Claim, which saves a round trip.
func Begin(ctx context.Context, q Querier, c Claim) (Decision, error) {
	d, err := dbidem.Begin(ctx, q, dbidem.Claim(c))
	return decisionOf(d), err
}

// Complete stores r as the response of the claim with this attempt (idem_complete). It
// returns ErrClaimLost when that claim is no longer in progress (fencing). On a pool, or on a
// connection outside a transaction, the statement commits on its own and is never canceled by
// ctx (a canceled commit that waits for a synchronous standby would stay on the primary alone):
// when ctx ends first, Complete returns ErrCommitUnknown at once and the statement goes on until
// PostgreSQL answers it. A ctx that ended before the call sends nothing: Complete returns ctx's
// cause (context.Cause), and nothing is stored.
func Complete(ctx context.Context, q Querier, principal, key string, attempt int64, r Response) error {
	return dbidem.Complete(ctx, q, principal, key, attempt, dbidem.Response(r))
}

// Release abandons the lease claim with this attempt without a response (idem_release), so
// that the next request under the key starts a new generation with a new provider key: right
// only when the work certainly did not happen (else Yield). It returns false when no such
// claim is in progress (a transactional claim of another session's open transaction is not
// seen). A transactional claim is not released but rolled back: in its own transaction,
// Release returns ErrClaimLost and the transaction is aborted.
func Release(ctx context.Context, q Querier, principal, key string, attempt int64) (bool, error) {
	return dbidem.Release(ctx, q, principal, key, attempt)
}

// Yield ends the lease of the lease claim with this attempt now, without an answer, and keeps
// the key for its request (idem_yield): the next attempt of the same request takes it over at
// once with the same provider key; another request under the key gets Mismatch until the key
// expires. Use it when work outside the database failed and may or may not have had its
// effect. It returns false when no such lease claim is in progress.
func Yield(ctx context.Context, q Querier, principal, key string, attempt int64) (bool, error) {
	return dbidem.Yield(ctx, q, principal, key, attempt)
}

// SaveFinal stores r as the final answer to c in q's transaction (idem_save_final): in the
// transaction that claimed c (after rolling its work back to a savepoint) it finalizes that
// claim; for a key nobody holds it inserts the answer. It returns false when a live row for
// the key already exists. Inside RunTx prefer Tx.FinalOnCommit. Outside a transaction it is
// never canceled by ctx once sent, as Complete (a ctx that ended before the call sends
// nothing and returns ctx's cause).
func SaveFinal(ctx context.Context, q Querier, c Claim, r Response) (bool, error) {
	return dbidem.SaveFinal(ctx, q, dbidem.Claim(c), dbidem.Response(r))
}

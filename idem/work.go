package idem

import (
	"context"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/internal/canon"
	"github.com/pgidem/pgidem/internal/dbidem"
	idemsql "github.com/pgidem/pgidem/sql"
)

// The driver of the SQL API, for work that is not HTTP (a queue consumer, a cron job) and
// for callers that run the key's transaction themselves. Its home is internal/dbidem.

// Tx is the transaction of a unit of work run by RunTx: a pgx.Tx whose Claim method claims a
// key in the same round trip as BEGIN, and whose CompleteOnCommit and FinalOnCommit store the
// answer in the same round trip as COMMIT.
type Tx = dbidem.Tx

// TxOptions configure RunTx: pgx's transaction options, and the retries of a unit of work that
// fails with a serialization failure, a deadlock or a lock timeout of its own statements.
type TxOptions = dbidem.TxOptions

// Claim is the request that claims a key: principal, key, action, fingerprint, TTL, lease.
type Claim = dbidem.Claim

// Decision is what a claim was answered: claimed, replay (with the stored response),
// mismatch (with the changed fields) or in progress (with how long the lease still runs).
type Decision = dbidem.Decision

// Outcome is the decision of a claim.
type Outcome = dbidem.Outcome

// The outcomes of a claim.
const (
	Claimed    = dbidem.Claimed
	Replay     = dbidem.Replay
	Mismatch   = dbidem.Mismatch
	InProgress = dbidem.InProgress
)

// Response is a stored answer: status, headers, body.
type Response = dbidem.Response

// Job describes work that runs at most once per key, outside HTTP.
type Job = dbidem.Job

// Gate coalesces concurrent work of this process under the same key (Job.Gate): duplicates
// wait in Go for the first, without a connection, and a bounded number wait on a key's row
// lock held by another process. Nil in a Job: one Gate shared by every Do of the process.
type Gate = dbidem.Gate

// GateOptions bound what a Gate lets wait: MaxWaitingClaims (row-lock waits at once) and
// MaxWaitingBytes (what waiting duplicates hold); 0: the defaults.
type GateOptions = dbidem.GateOptions

// NewGate returns a Gate with these options, for a Job.Gate of its own (a separate bound
// for one kind of work).
func NewGate(o GateOptions) *Gate { return dbidem.NewGate(o) }

// LeaseClaim is what the work of DoLease knows of its claim.
type LeaseClaim = dbidem.LeaseClaim

// Pool is what RunTx, Do and DoLease run on: *pgxpool.Pool.
type Pool = dbidem.Pool

// The errors of the driver. Each wraps the error it came from.
var (
	ErrInProgress        = dbidem.ErrInProgress
	ErrClaimLost         = dbidem.ErrClaimLost
	ErrUnknownPrincipal  = dbidem.ErrUnknownPrincipal
	ErrClaimNotCompleted = dbidem.ErrClaimNotCompleted
	ErrInvalidArgument   = dbidem.ErrInvalidArgument
	ErrCommitUnknown     = dbidem.ErrCommitUnknown
	ErrMismatch          = dbidem.ErrMismatch
	ErrNotMigrated       = dbidem.ErrNotMigrated
)

// RunTx runs fn in a transaction and commits it when fn returns nil (with a pending answer,
// in the same round trip as COMMIT), or rolls it back and returns fn's error. A unit of work
// that fails with a serialization failure, a deadlock or a lock timeout runs again, up to
// opts.MaxAttempts times.
func RunTx(ctx context.Context, db Pool, opts TxOptions, fn func(tx *Tx) error) error {
	return dbidem.RunTx(ctx, db, opts, fn)
}

// Do runs fn at most once for job.Key, in the same transaction as the key's claim, and
// stores its result as JSON with it; a repeat returns the stored result with replayed true.
// Another Input under the key is ErrMismatch; a run still in progress past the lock timeout,
// ErrInProgress.
func Do[T any](ctx context.Context, db Pool, job Job, opts TxOptions, fn func(ctx context.Context, tx pgx.Tx) (T, error)) (result T, replayed bool, err error) {
	return dbidem.Do(ctx, db, job, opts, fn)
}

// DoLease runs fn at most once for job.Key for work outside the database: the lease claim
// commits on its own, fn runs outside any transaction while a heartbeat extends the lease,
// and its result is stored afterwards, fenced by the claim's token. fn's context ends with
// cause ErrLeaseLost when the lease is lost; hand an outside provider claim.ProviderKey.
func DoLease[T any](ctx context.Context, db Pool, job Job, fn func(ctx context.Context, claim LeaseClaim) (T, error)) (result T, replayed bool, err error) {
	return dbidem.DoLease(ctx, db, job, fn)
}

// Cleanup deletes expired keys in batches of batchSize (0: the SQL API's default) until a
// batch comes back short, and returns how many it deleted: for a service that runs its own
// cleaner (the SQL API's idem_cleanup_all does the same from pg_cron). Pass a pool, so that
// each batch is a short transaction of its own. On a Citus coordinator every worker cleans
// its own shards, in parallel (idem_cleanup_workers).
func Cleanup(ctx context.Context, db Pool, batchSize int) (int, error) {
	return dbidem.Cleanup(ctx, db, batchSize)
}

// DefaultCleanupDuty is the share of the time a scheduled cleaner's batches take by default
// (the reference server's CLEANUP_DUTY): measured to keep the API's p99 within a fifth of
// its value without cleanup while deleting many times faster than keys expire.
const DefaultCleanupDuty = dbidem.DefaultCleanupDuty

// CleanupPaced is Cleanup with a pause after every batch, so that the batches take at most
// duty of the time (DefaultCleanupDuty for a cleaner that runs beside the API; 1: no pause;
// below 0.01 counts as 0.01; on a Citus coordinator each worker paces its own batches). When
// ctx ends, during a batch or a pause, it returns the count so far and ctx.Err().
func CleanupPaced(ctx context.Context, db Pool, batchSize int, duty float64) (int, error) {
	return dbidem.CleanupPaced(ctx, db, batchSize, duty)
}

// ProviderKey is the key to hand an outside provider for the work of (principal, key): the
// same for every attempt, different for every other principal or key.
func ProviderKey(principal, key string) string { return dbidem.ProviderKey(principal, key) }

// Fingerprint identifies a request: its SHA-256 sum, the hashes of its top-level JSON fields,
// and whether its body was canonicalized as JSON.
type Fingerprint = canon.Fingerprint

// ComputeFingerprint returns the fingerprint of a request as the middleware computes it:
// SHA-256 over the upper-case method, "\n", the escaped path (no query), "\n" and the
// canonical body (RFC 8785 for strictly valid JSON, the raw bytes otherwise). A route whose
// meaning is narrower than its body sets Route.Fingerprint to a function built on it.
func ComputeFingerprint(method, escapedPath string, body []byte) Fingerprint {
	return canon.Compute(method, escapedPath, body)
}

// MigrateOptions configure Migrate: the application role that is granted the SQL API.
type MigrateOptions = idemsql.Options

// Migrate installs or upgrades the SQL API (schema idem) in one transaction: the migrations
// the database lacks, then the functions. Safe to run at every start and from several
// processes at once. conn's role owns what it creates; run it as the schema's owner.
func Migrate(ctx context.Context, conn *pgx.Conn, opts MigrateOptions) error {
	return idemsql.Migrate(ctx, conn, opts)
}

// SchemaVersion is the schema version this package's SQL brings a database to; after
// Migrate, idem.idem_version() reports it for the schema and for the functions.
func SchemaVersion() int { return idemsql.Version() }

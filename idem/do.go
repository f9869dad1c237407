package idem

// Work outside HTTP (Do, DoLease): a job, its claim, the gate that coalesces its duplicates.

import (
	"context"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/pgidem/pgidem/internal/dbidem"
)

// Job describes work that runs at most once per key, outside HTTP (Do, DoLease).
type Job struct {
	// Principal, Key and Action are as in Claim: who, which key, what. Principal is the one
	// that owns the key space of the work; keys of different principals never collide. A
	// consumer of messages from one producer uses the producer's identity, or a fixed name for
	// the queue or the consumer ("orders-consumer"): the same for every delivery of a message
	// and on every replica of the consumer, so that a redelivery finds the key. Key is the
	// message's own id (not a delivery's).
	Principal, Key, Action string
	// Input is what the work is about; it is JSON-encoded and fingerprinted (canonical
	// JSON), so the same key with another input is ErrMismatch. Default nil: no input. A
	// string in it that is not valid UTF-8 is ErrInvalidArgument before anything runs:
	// encoding/json writes such bytes as the escape \ufffd (lowercase; an input whose JSON
	// holds that escape otherwise, from a json.RawMessage, is refused too), so
	// two inputs would fingerprint alike; encode bytes (base64, hex). Only what its JSON
	// holds tells two inputs apart: fields that are not exported (or tagged "-") are not part
	// of it, and an Input of a struct type JSON writes nothing of (no exported field, no
	// MarshalJSON) that is not its zero value is ErrInvalidArgument. An Input that JSON
	// cannot encode (a channel, NaN) is ErrInvalidArgument too.
	Input any
	// TTL and LockTimeout are as in Claim. Default 0: the SQL API's defaults. A negative
	// one is ErrInvalidArgument.
	TTL, LockTimeout time.Duration
	// Gate coalesces concurrent calls of this process with the same key on the same pool.
	// Default nil: one Gate shared by every Do and DoLease of the process. It tells
	// *pgxpool.Pools apart (a key of one never waits for the same key of another); pools of
	// other types (wrappers) it lines up as one pool: give the pool of each database a Gate of
	// its own. Its wait bounds are shared.
	Gate *Gate
	// Lease is the lease of a DoLease job: the claim is held that long past its last
	// extension. Required by DoLease, from a second to 10 years (any other is
	// ErrInvalidArgument, which idemriver cancels the job for); Do ignores it.
	Lease time.Duration
	// Timeout bounds a DoLease job's work (its context ends then). Default 0 (or a negative
	// value): DefaultLeaseTimeout.
	Timeout time.Duration
}

func (j Job) internal() dbidem.Job {
	ij := dbidem.Job{Principal: j.Principal, Key: j.Key, Action: j.Action, Input: j.Input, TTL: j.TTL,
		LockTimeout: j.LockTimeout, Lease: j.Lease, Timeout: j.Timeout}
	if j.Gate != nil {
		ij.Gate = j.Gate.g
	}
	return ij
}

// DefaultLeaseTimeout bounds the work of a lease (DoLease, and a lease route) when its caller
// sets no bound.
const DefaultLeaseTimeout = 5 * time.Minute

// LeaseClaim is what the work of DoLease knows of its claim.
type LeaseClaim struct {
	// Principal and Key are the job's.
	Principal, Key string
	// Attempt is the claim's fencing token: no earlier attempt of the key had it.
	Attempt int64
	// ProviderKey is the key to give an outside provider that deduplicates by its own
	// idempotency key (Decision.ProviderKey).
	ProviderKey string
	// RecoveryPoint is the last step (Step) that an earlier attempt of this job's generation
	// recorded, when this attempt took its lease over; "" when none. Step skips the steps
	// recorded by itself: this is for logs and metrics.
	RecoveryPoint string
}

// Gate coalesces concurrent work of this process under the same key (Job.Gate): duplicates
// of a Do wait in Go for the first, without a connection, and a bounded number wait on a key's
// row lock held by another process (a DoLease's duplicate finds the lease and returns
// ErrInProgress). Safe for concurrent use.
type Gate struct{ g *dbidem.Gate }

// GateOptions bound what a Gate lets wait. The zero value has the defaults.
type GateOptions struct {
	// MaxWaitingClaims bounds the claims that wait on a key's row lock (held by another
	// process) at once; one that finds them all taken gets ErrInProgress at once. Default 0: 4.
	// The bound is this Gate's: behind PgBouncer in transaction mode every process's waiting
	// claims hold server connections of the one PgBouncer pool (docs/operations.md sizes it).
	MaxWaitingClaims int
	// MaxWaitingBytes bounds what the duplicates waiting in Go hold at once (their inputs
	// plus 4 KiB each). Default 0: 64 MiB.
	MaxWaitingBytes int64
}

// NewGate returns a Gate with these options, for a Job.Gate of its own (a separate bound for
// one kind of work).
func NewGate(o GateOptions) *Gate { return &Gate{dbidem.NewGate(dbidem.GateOptions(o))} }

// Stats reads the Gate's figures, now.
func (g *Gate) Stats() GateStats {
	return GateStats{Waiting: g.g.Waiting(), WaitingBytes: g.g.WaitingBytes(), LockWaits: g.g.LockWaits(),
		Coalesced: g.g.Coalesced(), Refused: g.g.Refused()}
}

// checked holds the pools whose schema Do and DoLease found right.
var checked sync.Map

// checkOnce runs CheckSchema on db the first time Do or DoLease meets it (again after a
// failure).
func checkOnce(ctx context.Context, db Pool) error {
	if _, ok := checked.Load(db); ok {
		return nil
	}
	if err := CheckSchema(ctx, db); err != nil {
		return err
	}
	if err := dbidem.CheckCall(ctx, db, dbidem.BeginSignature); err != nil {
		return err
	}
	checked.Store(db, struct{}{})
	return nil
}

// Do runs fn for job.Key in the same transaction as the key's claim, and stores its result as
// JSON with it, so that its effect on the database commits at most once; a repeat returns the
// stored result with replayed true. The first call returns the stored result too, fn's value
// as its JSON decodes into T, so that every caller gets one value; DoLease does the same. What
// JSON does not carry is not in it, for the first caller either: a field tagged "-" or not
// exported is its zero value, an empty slice or map tagged omitempty is nil, a time.Time has
// no monotonic reading and its zone as an offset, a number in an interface is a float64, a
// []string in one a []any, a json.RawMessage is compact. fn runs again when that transaction is: after a
// serialization failure or a deadlock (TxOptions), so what fn does outside the transaction
// may happen more than once.
// Another Input under the key is ErrMismatch, and so is a key whose work DoLease began for the
// same job and recorded steps for before its lease ran out (Do would do their writes again:
// continue it with DoLease); a run still in progress past the lock timeout, ErrInProgress. A
// result holding a string that is not UTF-8 (or the escape \ufffd) is ErrInvalidArgument, and
// the transaction rolls back: a replay would decode another value (encoding/json writes each
// bad byte as \ufffd); return such bytes encoded (base64, hex). So is a result that JSON
// cannot encode, or that would not come back the same from its JSON into T (a type whose
// UnmarshalJSON refuses its own JSON, an error in an interface field, an integer above 2^53 in
// an interface, which decodes as a float64, a struct that exports none of its fields): nothing
// is committed, where such a result would have committed with the work and then failed, or
// changed, every replay. DoLease refuses them alike. A statement that fn sends through tx and
// that ends the transaction (COMMIT or ROLLBACK as SQL) makes every later statement, and Do,
// return ErrTxOwned. The first Do on a pool checks its schema (CheckSchema). When fn fails the
// transaction rolls back, nothing is stored, and a later Do runs fn again. ctx bounds the
// whole unit of work, as Go callers expect: when it ends first, the transaction rolls back
// (unlike the HTTP middleware, whose work outlives a client that goes away; an HTTP client's
// disconnect is not the server's decision, a Go caller's cancellation is). Work that should
// finish whatever happens to its caller passes context.WithoutCancel(ctx) with a deadline of
// its own.
func Do[T any](ctx context.Context, db Pool, job Job, opts TxOptions, fn func(ctx context.Context, tx pgx.Tx) (T, error)) (result T, replayed bool, err error) {
	if err := checkOnce(ctx, db); err != nil {
		return result, false, err
	}
	return dbidem.Do(ctx, db, job.internal(), dbidem.TxOptions(opts), fn)
}

// DoLease runs fn at most once for job.Key for work outside the database: the lease claim
// commits on its own, fn runs outside any transaction while a heartbeat extends the lease,
// and its result is stored afterwards, fenced by the claim's token. fn's context ends with
// cause ErrLeaseLost when the lease is lost; DoLease then returns ErrLeaseLost, unless fn
// still returns a result and no other attempt has taken the key over (the lease ran out
// without an extension landing), when the result is recorded, fenced by the token, and
// returned; when the key has expired meanwhile too (its TTL past the lease's end), or was
// released, and nobody took it, the result is recorded for the key all the same, as a new generation's answer that
// the next DoLease replays, rather than let it run fn again under a new provider key. fn that
// stops because its
// context ended returns an error (context.Cause(ctx)), since a nil error makes its result the
// answer. Keep the TTL longer than a lease, so that a late result finds its key. When fn
// fails, its lease ends at once (Yield) and a later DoLease of the same job runs it again
// with the same claim.ProviderKey: hand an outside provider that key. fn's own writes to the
// database go through Step on fn's context: each step commits its writes with its recovery
// point, fenced by the claim's token, and a takeover (or the retry after a Yield) skips the
// steps done and gets what they saved, so fn, run again from its start, writes each step once.
// The result is recorded through failures that pass (a lock timeout on the key's row, a broken
// connection) until the lease's AnswerDeadline; when it still is not, DoLease returns it with
// an error wrapping context.DeadlineExceeded, and the key stays in progress until its lease
// runs out. When fn panics, the heartbeat stops and the claim is given up before the panic
// goes on to the caller. When the claim's own COMMIT has no answer (its reply lost, ctx ended
// while it ran, or none within 5 seconds: a connection that stopped answering), DoLease
// returns ErrCommitUnknown without running fn, after giving the claim up, fenced by its token,
// in case it landed: the next DoLease of the job runs fn at once. The first DoLease on a pool
// checks its schema (CheckSchema). The statements a DoLease runs outside its claim (the
// extensions, the recording, the yield) are not bounded as a lease route's are
// (Options.MaxWaitingClaims): each waits on a connection of db's own while its key's row, or
// the key table, is locked, so jobs whose rows are locked hold as many connections, and a pool
// that they fill holds up the extensions of every other job. Give db more connections
// than the jobs that run at once, plus the steps each runs at once and what else shares it
// (River's own). A DoLease of the job while another, in this process or another, holds its
// lease returns ErrInProgress at once: a lease claim commits before fn runs, and a duplicate
// is not held back to wait for its answer (unlike a lease route's duplicate, which waits up to
// Options.DuplicateWait); retry it later, as River's snooze does.
func DoLease[T any](ctx context.Context, db Pool, job Job, fn func(ctx context.Context, claim LeaseClaim) (T, error)) (result T, replayed bool, err error) {
	if err := checkOnce(ctx, db); err != nil {
		return result, false, err
	}
	return dbidem.DoLease(ctx, db, job.internal(), func(ctx context.Context, c dbidem.LeaseClaim) (T, error) {
		return fn(ctx, LeaseClaim(c))
	})
}

// The errors of the driver. Each wraps the error it came from (errors.As finds a
// *pgconn.PgError); compare with errors.Is.
var (
	// ErrInProgress: a concurrent holder kept the key past the lock timeout (SQLSTATE
	// 55P03, or 57014 when a statement_timeout of the role or the database ended the wait
	// first), or a request of this process holds it. Answer 409 and let the client retry
	// (from a keyed handler: Refuse(w, r, CodeInProgress, ...), which is not stored).
	ErrInProgress = dbidem.ErrInProgress
	// ErrClaimLost: no claim in progress with this token (55000): taken over by a later
	// attempt, released, completed, or the key expired and was cleaned up; or an answer given
	// in a transaction whose claim's outcome was not Claimed (Tx.CompleteOnCommit).
	ErrClaimLost = dbidem.ErrClaimLost
	// ErrUnknownPrincipal: the principal violates a foreign key that the application put on
	// the key table's principal_id: answer 401.
	ErrUnknownPrincipal = dbidem.ErrUnknownPrincipal
	// ErrClaimNotCompleted: COMMIT refused a transactional claim without its completion.
	ErrClaimNotCompleted = dbidem.ErrClaimNotCompleted
	// ErrInvalidArgument: the functions refused an argument (22004, 22023), or PostgreSQL a
	// text argument it cannot hold (22021: bytes that are not UTF-8, U+0000; 22P05): a caller
	// or configuration error, not a reason to retry.
	ErrInvalidArgument = dbidem.ErrInvalidArgument
	// ErrCommitUnknown: the connection failed after COMMIT was sent, or the context ended
	// while COMMIT ran: the transaction may or may not have committed; a retry with the same
	// key tells which. No cancel request is sent for a COMMIT that may wait for a synchronous
	// standby (RunTx): one that is still running when the context ends goes on, invisible to
	// every other session, on a connection of the pool that comes back when PostgreSQL answers
	// it. Where no commit waits for a standby, a cancel request stops such a COMMIT (a slow
	// deferred trigger, say), which then rolls back or has committed: the outcome is told by a
	// retry all the same.
	ErrCommitUnknown = dbidem.ErrCommitUnknown
	// ErrMismatch is returned by Do and DoLease when the key was used with another input.
	ErrMismatch = dbidem.ErrMismatch
	// ErrStoreBusy: the claim found the key table itself locked (a migration's swap, VACUUM
	// FULL, pg_repack, LOCK TABLE), not a key: nothing was written; try again shortly (the
	// middleware answers 503 with Retry-After). A claim does not wait for such a lock, LOCK
	// TABLE ... IN EXCLUSIVE MODE (which lets reads through) included. The operators' reads
	// (ReadHealth, ReadSummary, ReadKey, ReadStuck) return it too, after waiting 2 s for
	// such a lock.
	ErrStoreBusy = dbidem.ErrStoreBusy
	// ErrTxOwned: the transaction of a unit of work is its runner's (RunTx, Do, the
	// middleware): its Commit and Rollback are refused, and so is every statement after a
	// statement sent through it ended it (COMMIT, ROLLBACK, END or ABORT as SQL), through it
	// or through a savepoint made from it (Begin): they would run outside the claim's
	// transaction, each committed at once. A final answer whose claim's savepoint the work
	// removed (ROLLBACK; BEGIN as SQL) is refused with it too, and so is a claim (Tx.Claim)
	// after such a statement. Return from the function instead. What the database did with
	// the COMMIT sent as SQL stands: a transaction that holds a transactional claim without
	// its answer cannot commit (nothing of the unit of work is committed); one without such a
	// claim (a step's, RunTx before its claim, a lease's unit) committed the statements sent
	// before it, and the unit of work then ran for nothing: a step's writes without its
	// recovery point, which the next attempt writes again.
	ErrTxOwned = dbidem.ErrTxOwned
)

package idem

import (
	"context"
	"encoding/json"

	"github.com/jackc/pgx/v5"
	"github.com/pgidem/pgidem/internal/dbidem"
)

// Work in steps: the work of a lease (a lease route's handler, DoLease's fn) that writes to the
// database does it in named steps (Step). Each step is a transaction of its own that commits
// the step's writes together with its recovery point, fenced by the claim's token; when the
// lease is taken over (the process crashed, its lease ran out) or was given up (the work failed
// and yielded), the next attempt of the same request runs the work again from its start, and
// every step recorded in this generation returns what it saved without running again. The
// docs' "Work in steps" (docs/http.md) has a whole example and what it does not promise.

// Step runs fn once per generation of the lease whose work ctx belongs to (a lease route's
// handler context, DoLease's fn context): in a transaction on the middleware's (DoLease's)
// pool, which commits fn's writes together with the recovery point of step name (idem_step,
// fenced by the claim's token), and returns fn's value as the database saved it. When this
// generation recorded the step already (an earlier attempt did it, then crashed, lost its
// lease or failed after it), Step returns that saved value, without running fn. Every
// attempt gets the same: the value goes through PostgreSQL's jsonb, which keeps the JSON value
// and not its text (an object's members in jsonb's order, a space after each comma and colon,
// numbers as PostgreSQL writes them: 1e+21 comes back as 1000000000000000000000), so a
// json.RawMessage or a json.Number comes back in that form, also to the attempt that ran fn.
//
// fn's value is saved as JSON: an id, an amount, what later steps need (at most 8192 bytes for
// every step of a generation, names included, counted as PostgreSQL writes them as text, which
// puts a space after each comma and colon: a list of 2,800 zeros, 5,601 bytes of JSON, takes
// 8,411; keep the rest in your tables, written by fn). fn writes to the
// database through tx only. An outside call in fn is not rolled back with the step and may run
// again (a crash before the step commits, a serialization failure that runs fn again): make it
// one that deduplicates, a provider called with ClaimInfo.ProviderKey (or LeaseClaim's), and
// save its answer as the step's value, so that no later attempt calls it again once the step
// is recorded. fn's transaction takes a connection of the pool when fn first sends a
// statement through tx (or to record the step when fn sent none), and holds it from then until
// the step ends: an outside call before fn's first statement holds none (a provider that
// shares the pool cannot starve it of connections), one after it holds one. tx.Conn() takes
// it too, on fn's context: it is nil when that context ended first (a lost lease, Shutdown's
// deadline), so fn's statements go through tx itself or check Conn for nil. When fn fails,
// its transaction rolls back and Step returns fn's error as it is (one that wraps ErrClaimLost
// of another claim, from a call of fn's own, included: this lease stands); the step is not
// recorded, and runs again on the next attempt. Serialization failures, deadlocks and lock timeouts run fn again
// in a new transaction, as Do does.
//
// The step's COMMIT waits for its reply at most a lease (at least 5 seconds):
// past that (the connection lost or black-holed while it committed, a synchronous standby
// that stalls) Step returns ErrCommitUnknown, and the step may or may not be recorded. Calling
// Step again with the same name first reads whether it was (the generation's recovery points):
// the saved value if so, without running fn; fn again if not.
//
// When the claim was taken over (another attempt holds the key now) the step's writes roll
// back, the lease counts as lost (its answer is not recorded: a lease route answers 409, DoLease
// returns ErrLeaseLost), and Step returns an error that is ErrLeaseLost and ErrClaimLost, as
// does every Step after it; so does a step whose fn failed because the heartbeat found the
// takeover first and ended fn's context. A lease lost by this process's clock alone (its extensions failed
// until the lease ran out) is ErrLeaseLost without ErrClaimLost: Step runs nothing and asks the
// database nothing, which may be out of reach, so whether another attempt took the key over is
// not known. Step
// outside the work of a lease returns ErrNoSteps; on a lease route, a request without a key
// runs each step in a transaction without a recovery point (the client asked for no retry
// safety). Names identify steps within one request: give each step its own; the same name
// again returns the saved value. A name is 1 to 255 characters of UTF-8 without U+0000: any
// other is ErrInvalidArgument before fn runs. A value whose JSON holds U+0000 in a string
// (which PostgreSQL's jsonb cannot store), or a string that is not UTF-8 (which encoding/json
// writes as the escape \ufffd, so the attempt after a takeover would get another value; the
// escape itself, which encoding/json never writes for valid text, is refused too), is
// ErrInvalidArgument after fn ran, and its transaction rolls back: save such a value encoded
// (base64, hex). So is a value that JSON cannot encode, or that would not come back the same
// from its JSON into T (as for Do's result): recorded, it would stop every later attempt of
// the generation at this step, and so is one whose stored form (above) does not decode into T.
// A request without a key saves nothing (Step returns fn's value through its JSON, the same
// for a second call with the name); the check of the
// value's round trip applies to it too.
func Step[T any](ctx context.Context, name string, fn func(ctx context.Context, tx pgx.Tx) (T, error)) (T, error) {
	return dbidem.Step(ctx, name, fn)
}

// RecordStep records, in q's transaction, that step name of the lease claim with this attempt
// is done, with saved (JSON; nil: null) as what later steps need of it (idem_step): for leases
// run by hand (Begin with a Lease, KeepAlive); the work of a lease route or DoLease uses Step.
// Send it last in the transaction of the step's writes, then commit: they commit together. A
// takeover's Decision.Steps lists the steps recorded. It returns ErrClaimLost when no lease
// claim with this attempt is in progress (the transaction is aborted: roll it back),
// ErrStepRecorded when the generation recorded the step already, and ErrInvalidArgument when
// the generation's saved values would pass 8192 bytes (as Step counts them), or saved is not
// JSON that PostgreSQL's jsonb holds (not JSON, a number past numeric's range, U+0000, nesting
// too deep).
func RecordStep(ctx context.Context, q Querier, principal, key string, attempt int64, name string, saved json.RawMessage) error {
	return dbidem.RecordStep(ctx, q, principal, key, attempt, name, saved)
}

// The errors of work in steps (Step, RecordStep); compare with errors.Is.
var (
	// ErrNoSteps is returned by Step called outside the work of a lease (a lease route's
	// handler, DoLease's fn).
	ErrNoSteps = dbidem.ErrNoSteps
	// ErrStepRecorded: the step was recorded already in the key's generation (SQLSTATE 23505
	// from idem_step): its writes committed once; this transaction, which would repeat them,
	// is aborted and rolls back.
	ErrStepRecorded = dbidem.ErrStepRecorded
)

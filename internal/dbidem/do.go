package dbidem

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/internal/canon"
)

// doGate coalesces the Do calls of this process that carry the same key.
var doGate = NewGate(GateOptions{})

// Job describes work that must run at most once per key, outside HTTP: a queue consumer
// handling a message id, a cron command.
type Job struct {
	// Principal, Key and Action are as in Claim: who, which key, what.
	Principal, Key, Action string
	// Input is what the work is about; it is JSON-encoded and fingerprinted (canonical
	// JSON), so the same key with another input is ErrMismatch. Nil: no input.
	Input any
	// TTL and LockTimeout are as in Claim (0: the SQL API's defaults).
	TTL, LockTimeout time.Duration
	// Gate coalesces concurrent Do calls of this process with the same key. Nil: one Gate
	// shared by every Do of the process.
	Gate *Gate
	// Lease is the lease of a DoLease job (at least a second): the claim is held that long
	// past its last extension. Do ignores it.
	Lease time.Duration
	// Timeout bounds a DoLease job's work (its context ends then). 0: DefaultLeaseTimeout.
	Timeout time.Duration
}

// DefaultLeaseTimeout bounds the work of a lease (DoLease, and a lease route of the
// middleware) when its caller sets no bound.
const DefaultLeaseTimeout = 5 * time.Minute

// LeaseClaim is what work under a lease knows of its claim.
type LeaseClaim struct {
	// Principal and Key are the job's.
	Principal, Key string
	// Attempt is the claim's fencing token: no earlier attempt of the key had it.
	Attempt int64
	// ProviderKey is the key to give an outside provider that deduplicates by its own
	// idempotency key: the same for every attempt of this job's request (retries, takeovers
	// after a crash), different for any other, including a later job under the same Key
	// after this one expired or was released (Decision.ProviderKey).
	ProviderKey string
	// RecoveryPoint is the last step an earlier attempt of this generation recorded (Step),
	// when this attempt took its lease over; "" when none.
	RecoveryPoint string
}

// Do runs fn at most once for job.Key: it claims the key, runs fn in the same transaction,
// stores fn's result as JSON and commits all together. A repeat returns the stored result
// (decoded into T) with replayed true, without running fn. When fn fails the transaction
// rolls back, nothing is stored, and a later Do runs fn again. A different Input under the
// same key returns ErrMismatch; a concurrent run past the lock timeout, ErrInProgress.
// Concurrent calls of this process with the same key wait for each other without holding a
// connection (see Gate).
func Do[T any](ctx context.Context, db Acquirer, job Job, opts TxOptions, fn func(ctx context.Context, tx pgx.Tx) (T, error)) (result T, replayed bool, err error) {
	claim, input, err := job.claim(0)
	if err != nil {
		return result, false, err
	}
	err = job.gate().RunHolding(withReadSteps(ctx), db, opts, claim, int64(len(input)), func(tx *Tx, d Decision) error {
		var zero T
		result, replayed = zero, false
		if done, err := decided(d, &result, &replayed); done || err != nil {
			return err
		}
		if len(d.Steps) > 0 {
			// A takeover of a lease that DoLease claimed for the same job, whose work died
			// after it recorded steps: fn would do their writes again. The claim rolls back
			// with this error; DoLease goes on after the steps (D176).
			return fmt.Errorf("%w: DoLease began this job's work under the key and recorded steps (the last %q): "+
				"continue it with DoLease, which skips them; Do would run them again", ErrMismatch, d.RecoveryPoint)
		}
		var err error
		if result, err = fn(ctx, tx); err != nil {
			return err
		}
		body, stored, err := encodeResult(result)
		if err != nil {
			return err
		}
		result = stored
		tx.CompleteOnCommit(Response{Status: http.StatusOK, Header: http.Header{"Content-Type": {"application/json"}}, Body: body})
		return nil
	})
	return result, replayed, err
}

// claim is the job's claim, with this lease (0: a transactional claim), and its input as JSON.
func (job Job) claim(lease time.Duration) (Claim, []byte, error) {
	var input []byte
	if job.Input != nil {
		var err error
		if input, err = json.Marshal(job.Input); err != nil {
			return Claim{}, nil, fmt.Errorf("%w: idem: encode input: %w", ErrInvalidArgument, err)
		}
		if dropsEverything(job.Input, input) {
			// Every value of its type would be one request: another input would replay this
			// one's result instead of ErrMismatch.
			return Claim{}, nil, fmt.Errorf("%w: the job's Input (%T) encodes as {}: it has no field JSON writes (none is exported), "+
				"so every input of its type would be the same request", ErrInvalidArgument, job.Input)
		}
		// encoding/json writes each byte of a string that is not UTF-8 as the escape \ufffd
		// (and a U+FFFD of valid text as itself): two such inputs would be one request.
		if holdsEscape(input, `\ufffd`) {
			return Claim{}, nil, fmt.Errorf("%w: the job's Input holds a string that is not UTF-8 (or the escape \\ufffd): "+
				"its JSON would be the same for other bytes; encode such bytes (base64, hex)", ErrInvalidArgument)
		}
	}
	fp := canon.Compute("DO", job.Action, input)
	return Claim{Principal: job.Principal, Key: job.Key, Action: job.Action, Fingerprint: fp.Sum,
		Fields: fp.Fields, TTL: job.TTL, Lease: lease, LockTimeout: job.LockTimeout}, input, nil
}

func (job Job) gate() *Gate {
	if job.Gate != nil {
		return job.Gate
	}
	return doGate
}

// decided handles every decision but Claimed: a replay decodes the stored result, a mismatch
// and work in progress are errors. done is false for Claimed.
func decided[T any](d Decision, result *T, replayed *bool) (done bool, err error) {
	switch d.Outcome {
	case Replay:
		*replayed = true
		if err := json.Unmarshal(d.Response.Body, result); err != nil {
			// The stored result is the first call's; T is this call's (changed since?).
			return true, fmt.Errorf("idem: decode the stored result of the first call (a replay) into %T: %w", *result, err)
		}
		return true, nil
	case Mismatch:
		return true, fmt.Errorf("%w (changed fields %v)", ErrMismatch, d.ChangedFields)
	case Claimed:
		return false, nil
	}
	return true, fmt.Errorf("%w: %s", ErrInProgress, d.Outcome)
}

// Pool is what DoLease needs: *pgxpool.Pool.
type Pool interface {
	Acquirer
	Querier
}

// DoLease runs fn at most once for job.Key, as Do does, for work outside the database (a long
// job, a call to a provider that the database cannot roll back): it commits a lease claim of
// job.Lease on its own, runs fn outside any transaction while a heartbeat extends the lease
// (KeepAlive: every third of the lease), and stores fn's result as JSON, fenced by the
// claim's token. A repeat while fn runs gets ErrInProgress; after, the stored result with
// replayed true.
//
// fn's context ends with cause ErrLeaseLost (context.Cause) when the lease is lost: another
// attempt may have taken the key over, so fn should stop. When fn then returns an error,
// DoLease returns ErrLeaseLost and stores nothing. When fn returns a result all the same, it is
// recorded, fenced by the claim's token, if no other attempt has taken the key over (the lease
// ran out without an extension landing: the database could not be reached, or the key's row
// was locked), and DoLease returns it: for the claim while the key has not expired (its TTL
// past the lease's end), and once it has expired (or was released) with nobody holding it, for
// the key as a new generation's answer (idem_save_final), which the next DoLease replays; once another attempt
// holds the key, DoLease returns
// ErrLeaseLost and stores nothing. So fn that stops because its context ended returns an
// error (context.Cause(ctx)): a nil error makes its result the answer, whatever ended the
// context (Timeout, ctx, a lost lease). The result is recorded through failures that pass (Persist) until the
// lease's AnswerDeadline; when it still is not, DoLease returns it with an error wrapping
// context.DeadlineExceeded, and the key stays in progress until its lease runs out, when a
// later run takes it over with the same claim.ProviderKey. When fn panics, the heartbeat
// stops and the claim is given up (Yield) before the panic goes on. It also ends at job.Timeout (DefaultLeaseTimeout) or when ctx ends. When
// fn fails, its error is returned and nothing is stored; the claim's lease ends at once
// (Yield), so a later DoLease of the same job runs fn again straight away with the same
// claim.ProviderKey, while another Input under the key gets ErrMismatch until the key expires.
// Give an outside provider claim.ProviderKey, so that neither a retry nor a takeover repeats
// an effect that reached it. fn's writes to the database go through Step on fn's context: each
// commits with its recovery point, and a takeover skips the steps done.
func DoLease[T any](ctx context.Context, db Pool, job Job, fn func(ctx context.Context, claim LeaseClaim) (T, error)) (result T, replayed bool, err error) {
	if job.Lease < time.Second {
		return result, false, fmt.Errorf("%w: DoLease needs a Lease of at least a second, got %s", ErrInvalidArgument, job.Lease)
	}
	claim, input, err := job.claim(job.Lease)
	if err != nil {
		return result, false, err
	}
	var won Decision
	err = job.gate().RunHolding(ctx, db, TxOptions{}, claim, int64(len(input)), func(tx *Tx, d Decision) error {
		var zero T
		result, replayed, won = zero, false, Decision{}
		if done, err := decided(d, &result, &replayed); done || err != nil {
			return err
		}
		won = d
		return nil // the lease claim commits on its own
	})
	attempt := won.Attempt
	if err != nil && attempt != 0 && errors.Is(err, ErrCommitUnknown) {
		// The claim's COMMIT may have landed (its reply lost, or ctx ended while it ran): the
		// key would then stay in progress under a lease no work holds, and every later run
		// would wait it out. Given up, fenced by the token, as the lease route does (D163,
		// D168); nothing when the COMMIT did not land.
		yctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), min(job.Lease, 5*time.Second))
		_, _ = GiveUpUnknown(yctx, db, claim, attempt)
		cancel()
	}
	if err != nil || attempt == 0 {
		return result, replayed, err
	}
	timeout := job.Timeout
	if timeout <= 0 {
		timeout = DefaultLeaseTimeout
	}
	lease := KeepAlive(ctx, db, job.Principal, job.Key, attempt, LeaseOptions{Lease: job.Lease, Timeout: timeout, Start: won.Sent})
	// The claim is given up (Yield), until AnswerDeadline and through the failures that pass,
	// when fn fails or its result cannot be encoded, or when fn panics: then the heartbeat
	// stops too, and the panic goes on to the caller. Without that, a job runner that recovers
	// the panic left the heartbeat extending the lease until job.Timeout, and every retry was
	// told the work was in progress.
	yield := func() {
		done, cancel := context.WithDeadline(context.WithoutCancel(ctx), lease.AnswerDeadline())
		defer cancel()
		_, _ = PersistYield(done, db, job.Principal, job.Key, attempt)
	}
	// giveUpRanOut gives up a claim whose lease ran out by this process's clock alone (no
	// extension heard of, none that found the key taken over): the claim may still stand in
	// the database, and every later run would wait it out. Fenced by the token, the yield
	// finds nothing when another attempt holds the key (D164).
	giveUpRanOut := func() {
		if !lease.TakenOver() {
			yield()
		}
	}
	if lease.Lost() {
		// The lease ran out while the claim waited, and another attempt may hold the key now:
		// the work does not start.
		lease.Stop()
		giveUpRanOut()
		var zero T
		return zero, false, ErrLeaseLost
	}
	lc := LeaseClaim{Principal: job.Principal, Key: job.Key, Attempt: attempt, ProviderKey: won.ProviderKey,
		RecoveryPoint: won.RecoveryPoint}
	finished := false
	defer func() {
		if !finished {
			if !lease.Stop() {
				yield()
			} else {
				giveUpRanOut()
			}
		}
	}()
	wctx := WithSteps(lease.Context(), NewSteps(db, &lc, won, lease, TxOptions{}))
	result, err = fn(wctx, lc)
	finished = true
	// Before the answer: an extension after it would find the claim completed.
	lost := lease.Stop()
	if err != nil {
		if lost {
			// The work stopped because its lease was lost (or failed on its own meanwhile):
			// the lease has run out, so a retry may take the key over; the claim is given up
			// only when no extension found it taken over.
			giveUpRanOut()
			var zero T
			return zero, false, ErrLeaseLost
		}
		yield()
		return result, false, err
	}
	// A result, even when the lease was lost meanwhile (D149): the lease may have run out
	// without an extension landing (the database unreachable, the key's row locked) while no
	// other attempt took the key over. The recording is fenced by the token: it lands only
	// then, and fails with ErrClaimLost (ErrLeaseLost below) once another attempt holds it.
	giveUp := func() {
		if !lost {
			yield()
		} else {
			giveUpRanOut()
		}
	}
	body, err := func() (body []byte, err error) {
		defer func() {
			if p := recover(); p != nil { // a MarshalJSON that panics: given up as fn's panic is
				giveUp()
				panic(p)
			}
		}()
		body, stored, err := encodeResult(result)
		if err == nil {
			result = stored
		}
		return body, err
	}()
	if err != nil {
		giveUp()
		return result, false, err
	}
	// The answer is recorded until the lease's end by this process's clock and at least one
	// lease from now (AnswerDeadline), through the failures that pass (Persist: a lock timeout
	// on the key's row, a broken connection): past the end another attempt may have taken the
	// key over, and then the recording, fenced by the token, fails with ErrClaimLost.
	done, cancel := context.WithDeadline(context.WithoutCancel(ctx), lease.AnswerDeadline())
	defer cancel()
	answer := Response{Status: http.StatusOK, Header: http.Header{"Content-Type": {"application/json"}}, Body: body}
	err = PersistAnswer(done, db, db, claim, attempt, answer)
	if errors.Is(err, ErrClaimLost) {
		// The claim is gone: another attempt holds the key, or the key expired under this one
		// (its lease and its TTL ran out while fn went on, or while no extension landed) and
		// nobody took it. In the second case the result is stored all the same, for the key
		// nobody holds (a new generation with this result, which the work's provider call
		// had), instead of ErrLeaseLost and a next DoLease that runs fn again under a new
		// provider key (D255, as D249 does for a lease route). SaveFinal overwrites no live
		// row: another attempt's key stays its own.
		if saved, serr := SaveFinal(done, db, claim, answer); serr == nil && saved {
			return result, false, nil
		}
	}
	switch {
	case errors.Is(err, ErrClaimLost):
		var zero T
		return zero, false, ErrLeaseLost
	case err != nil && done.Err() != nil:
		// Not ErrInProgress, which a failure on a lock would wrap: this call did the work.
		return result, false, fmt.Errorf("idem: the result was not recorded by the answer's deadline: %w (the last failure: %v)",
			done.Err(), err)
	}
	return result, false, err
}

// encodeResult is the JSON of a Do or DoLease result, to store. A result that JSON cannot
// hold is ErrInvalidArgument (no retry makes it encode), and so is one that would not come
// back the same on a replay (roundTrips), before anything commits (D195). A string that is not
// UTF-8 would be stored as encoding/json writes it, each bad byte as the escape \ufffd, and
// every replay would get another value than the first call (D178), as for Input and a step's
// value. So is the escape itself, which encoding/json never writes for a U+FFFD of valid text
// (it writes the character), only a json.RawMessage or a MarshalJSON method does. stored is
// the result as every replay decodes it, which the first call returns too: fn's value and its
// JSON's may differ where the JSON is the same (a number in an interface comes back a
// float64, a []string in one a []any, a json.RawMessage compact), and the first caller and
// its repeats get one value (D269).
func encodeResult[T any](result T) (body []byte, stored T, err error) {
	body, err = json.Marshal(result)
	if err != nil {
		return nil, stored, fmt.Errorf("%w: idem: encode result: %w", ErrInvalidArgument, err)
	}
	if holdsEscape(body, `\ufffd`) {
		return nil, stored, fmt.Errorf("%w: the result holds a string that is not UTF-8 (or the escape \\ufffd): "+
			"a replay would decode another value; return such bytes encoded (base64, hex)", ErrInvalidArgument)
	}
	if stored, err = roundTrips(result, body); err != nil {
		return nil, stored, fmt.Errorf("%w: the result %w", ErrInvalidArgument, err)
	}
	return body, stored, nil
}

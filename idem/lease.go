package idem

import (
	"context"
	"time"

	"github.com/pgidem/pgidem/internal/dbidem"
)

// Leases for work outside the database run by hand (a lease route and DoLease do all of this
// themselves): claim with a Lease (Begin, Tx.Claim), commit, start KeepAlive with the claim's
// Decision.Sent, do the work on Lease.Context, Stop, then record the answer with PersistAnswer
// (or, when the work failed, Yield through Persist), with Lease.AnswerDeadline as the deadline.

// Extend moves the lease of the in-progress lease claim with this attempt to lease from now
// (never earlier), and the key's expiry with it, and returns the lease's new end as the
// database's clock has it (idem_extend). It returns ErrClaimLost when no lease claim with
// this attempt is in progress. lease: from a microsecond to 10 years (a part of a microsecond
// is rounded up).
func Extend(ctx context.Context, q Querier, principal, key string, attempt int64, lease time.Duration) (time.Time, error) {
	return dbidem.Extend(ctx, q, principal, key, attempt, lease)
}

// LeaseOptions configure KeepAlive.
type LeaseOptions struct {
	// Lease is what each extension asks for: the lease then runs until this long after it.
	// Required: the claim's Lease as a rule.
	Lease time.Duration
	// Start is when the lease began by this process's clock, at or before the database began
	// counting it: the claim's Decision.Sent, or the moment just before an Extend was sent.
	// The local deadline is Start plus Lease, so it is never later than the database's.
	// Default zero: now, which is late by the claim's round trips and waits (a takeover may
	// then begin before this process sees its lease as lost).
	Start time.Time
	// Interval is the time between extensions. Default 0: a third of Lease, so that one
	// extension may fail and the next still lands before the lease runs out. Two in a row lose
	// it (the third would be due at its end): an outage of the database longer than Interval
	// that covers two beats ends the lease, though the database is back before its end.
	Interval time.Duration
	// Timeout bounds the work: the context ends then (cause context.DeadlineExceeded),
	// whether the lease holds or not. Default 0: no bound.
	Timeout time.Duration
	// OnExtend, if set, is called after each extension that succeeded (for metrics); it must
	// not block. It runs on the heartbeat's goroutine: a panic in it is recovered and dropped,
	// where it would end the process.
	OnExtend func()
}

// Lease is the heartbeat of one lease claim. Its context is the work's: it ends when the lease
// is lost (cause ErrLeaseLost), at LeaseOptions.Timeout, when the parent ends, or at Stop.
type Lease struct{ l *dbidem.Lease }

// KeepAlive starts the heartbeat of the lease claim (principal, key, attempt), which was made
// (or last extended) at opts.Start with opts.Lease, and returns it. Every opts.Interval it
// extends the lease on q (a pool: a connection is held only while the statement runs). An
// extension that fails for another reason than a lost claim (the database cannot be reached)
// is tried again at the next beat; the lease counts as lost when it runs out, by this
// process's clock, without one having succeeded. Run the work on Lease.Context; call Stop
// when it is done, then record its answer (Complete, fenced by the same attempt) by
// Lease.AnswerDeadline.
func KeepAlive(parent context.Context, q Querier, principal, key string, attempt int64, opts LeaseOptions) *Lease {
	return &Lease{dbidem.KeepAlive(parent, q, principal, key, attempt, dbidem.LeaseOptions(opts))}
}

// Context is the work's context: it carries the parent's values and ends with cause
// ErrLeaseLost when the lease is lost.
func (l *Lease) Context() context.Context { return l.l.Context() }

// End is when the lease runs out by this process's clock, as far as it knows: Start plus the
// lease, moved on by each extension that succeeded. The database's end is never earlier (and
// is later after an extension that landed once it was given up: see Stop).
func (l *Lease) End() time.Time { return l.l.End() }

// AnswerDeadline is the deadline, read after Stop, for recording the work's answer
// (Complete) or giving its claim up (Yield): End, or one lease from now if that is later. Until
// End no other attempt can have taken the key over. Past it one may have, and then Complete,
// fenced by the attempt, returns ErrClaimLost; while none has, it still succeeds, so a
// recording delayed past End (a slow database, a lock, a stalled process) is not given up
// while it can still land.
func (l *Lease) AnswerDeadline() time.Time { return l.l.AnswerDeadline() }

// Lost tells whether the lease was lost: another attempt may hold the key. The work's answer
// must not be sent as recorded unless its recording (Complete, fenced by the attempt) still
// succeeds, which it does only while no other attempt has taken the key over and the key has
// not expired (its TTL past the lease's end). The heartbeat ends with the lease's context (the
// parent's end, LeaseOptions.Timeout) and extends the lease no more: past End the lease is lost
// then too, unless Stop was called before it.
func (l *Lease) Lost() bool { return l.l.Lost() }

// Extensions is how many extensions succeeded.
func (l *Lease) Extensions() int64 { return l.l.Extensions() }

// Stop ends the heartbeat and the context, and waits for the heartbeat to finish: an extension
// in flight runs to its end (at most a third of the lease by default), and none starts after
// it. It reports whether the lease was lost before Stop was called, or before the heartbeat saw
// the stop. Safe to call more than once. One limit: an extension still waiting on the key's
// row when the lease ran out is given up and cancelled, and the server hears of the cancel a
// moment later; a row freed in that moment lets it land. The database's lease then runs on
// past End (by about a lease), with nobody working under it: a takeover waits for its end, as
// for any lease, and the key is never held by two attempts at once. Only an extension sent
// less than the functions' lock timeout (2 s) before the end can land so (its wait for the row
// ends by then): with the default Interval, a lease over 6 s starts none then (one that first
// waited for a pool connection may still be sent then).
func (l *Lease) Stop() (lost bool) { return l.l.Stop() }

// Persist runs record (the Complete of a lease's answer, or the Yield that gives its claim up)
// until it succeeds, fails for a reason no retry changes (ErrClaimLost: another attempt holds
// the key, or the claim is no longer in progress; ErrInvalidArgument), or ctx ends, pausing
// 20 ms and then a little longer each time, up to a second. Give ctx the Lease's
// AnswerDeadline. A recording can fail for a while and then land: each function gives up
// waiting for the key's row after its own lock timeout (2 s by default), a connection breaks,
// the database restarts. The recording is fenced by the attempt, so trying again is safe: it
// lands only while the claim is still this attempt's. When ctx ends first, the last failure
// is returned joined with ctx's error. record runs at least once, even when ctx has ended
// already (its own statements then fail at once, or an abandoned recording still lands). For
// an answer, PersistAnswer is Persist that also recognises a recording whose reply was lost and
// that landed.
func Persist(ctx context.Context, record func(ctx context.Context) error) error {
	return dbidem.Persist(ctx, record)
}

// PersistAnswer records r as the answer of the lease claim c with this attempt (Complete)
// through Persist, until ctx ends: give it the Lease's AnswerDeadline. It also tells an answer
// that landed from one that did not when a reply was lost: a Complete whose connection broke
// after it was sent may have committed (one of PersistAnswer's own tries, or an earlier
// Complete of the caller's that returned ErrCommitUnknown), and the next try then finds the
// claim completed and fails with ErrClaimLost although the answer stored is this attempt's.
// Whenever a try fails with ErrClaimLost, PersistAnswer reads the key's row (idem_key, which
// writes nothing) and returns nil when it is completed with this attempt, whether or not its
// answer still replays (its TTL may have passed meanwhile); ErrClaimLost when it is not. When
// one of its own tries lost its reply, the read is tried again until one answers, until ctx
// ends and a moment past it, and when none answered the error says so (the outcome is
// unknown). When every try was answered (the case after an earlier Complete's
// ErrCommitUnknown), the read gets a second of its own, and when it gets no answer
// ErrClaimLost stands: call ReadKey to tell then. The answer stored is the one that landed
// first: a token is completed once. c is the claim as it was made.
func PersistAnswer(ctx context.Context, db Pool, c Claim, attempt int64, r Response) error {
	return dbidem.PersistAnswer(ctx, db, db, dbidem.Claim(c), attempt, dbidem.Response(r))
}

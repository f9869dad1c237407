// Package idemriver joins package idem to River (github.com/riverqueue/river), the job queue
// on PostgreSQL, for work that happens after the answer: the receipt of an order, a webhook,
// the e-mail. It lives apart from package idem so that a service that does not use River links
// none of it.
//
// Two halves:
//
//   - Insert enqueues a River job in the transaction of a keyed request (idem.TxFrom): the job
//     commits together with the request's effect and its key, or not at all, and a replay of
//     the request runs no handler, so it enqueues nothing. One job per key, with no unique
//     job options and no outbox table of your own. (Two inserts outside such a request are
//     two jobs, and two units of work under the default Key, which names the job: for "once
//     per user" or "once per order", make Key a function of the arguments, or use River's
//     unique options.)
//   - Work (or the worker middleware Middleware) runs a job's outside work under
//     idem.DoLease, keyed by the job: River's retries, a worker killed in the middle of the
//     job and River's rescue of it reach the outside world under one provider key
//     (idem.LeaseClaim.ProviderKey), and work whose result was stored is not run again.
//
// A River job is at least once; what makes its outside effect at most once is the provider's
// own deduplication by the provider key, as on a lease route: a provider that does not
// deduplicate may still see two calls when a worker dies after its call and before the result
// is stored. docs/http.md of the repository ("Work after the answer") has the whole example
// (an order, its charge and its receipt), and what each part guarantees and does not.
package idemriver

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/canon"
)

// ErrNoTx is Insert's error outside a transactional route's unit of work: there is no
// transaction that the job could commit with (a lease route, a route that is not declared, or
// a context that is not a request's). A transactional route's request without a key (where
// the route does not require one) has a unit of work too, and Insert enqueues there: once per
// attempt, since nothing tells a retry of it from a new request.
var ErrNoTx = errors.New("idemriver: no transaction in the context (idem.TxFrom is nil): " +
	"enqueue from a transactional route's handler, or with client.InsertTx on a transaction of your own")

// Insert enqueues args with client.InsertTx on the transaction of the request's unit of work
// (idem.TxFrom(ctx)): the job is inserted when the request's effect, its answer and its key
// commit, and never when they roll back. A replay of the request does not run its handler, so
// a retried request enqueues one job (a request without a key: one job per attempt). It
// returns ErrNoTx when the context has no such transaction. Work outside HTTP calls client.InsertTx itself, on the transaction of idem.Do
// or of idem.RunTx.
func Insert(ctx context.Context, client *river.Client[pgx.Tx], args river.JobArgs, opts *river.InsertOpts) (*rivertype.JobInsertResult, error) {
	tx := idem.TxFrom(ctx)
	if tx == nil {
		return nil, ErrNoTx
	}
	return client.InsertTx(ctx, tx, args, opts)
}

// The defaults of Options.
const (
	// DefaultPrincipal is Options.Principal's default: the key space of River jobs.
	DefaultPrincipal = "river"
	// DefaultLease is Options.Lease's default: a worker that dies holds its job's key at most
	// this long (after its last extension) before another run takes it over.
	DefaultLease = 30 * time.Second
	// DefaultTTL is Options.TTL's default, 30 days: longer than River's default retry
	// horizon (25 attempts, attempt⁴ seconds apart with 10 % jitter: at most about 22.4 days
	// from the first attempt to the last), so that no run of a job under River's default
	// policy finds its key expired.
	DefaultTTL = 30 * 24 * time.Hour
)

// ErrKeyExpired is the cause of a job that Work cancels (river.JobCancel) instead of running:
// the job has run before, and it was created at least about Options.TTL ago, so its key may
// have expired and been deleted; a run now would be a new generation of the key with a new
// provider key, which a provider would take for new work. Retrying such a job by hand is a
// decision that idemriver leaves to a person.
var ErrKeyExpired = errors.New("idemriver: the job ran before and is older than its key's TTL: its key may have expired, so it is not run again")

// Options configure Work and Middleware. DB is required; the zero value of every other field
// is its default (and so is a negative Lease, TTL or Snooze). Options no job can run with (a
// Lease above 0 and under a second, a negative LockTimeout, a TTL or Lease over 10 years) make
// Middleware panic when it is built; Work cancels each job it is given with them
// (river.JobCancel of an error wrapping idem.ErrInvalidArgument), as for a key the SQL API
// refuses.
//
// Principal, PrincipalOf and Key name the unit of work that a job's runs share, and with it
// the provider key they hand the outside world: keep them unchanged while jobs are queued or
// running (a rolling deploy that changes one makes a retry of a job that ran before another
// unit of work, under another provider key).
type Options struct {
	// DB is the pool of the database with schema idem installed (usually River's own).
	// Required: Work returns an error without it. Each job running holds up to one of its
	// connections for its lease's statements (idem.DoLease), for as long as another session
	// holds the job's key row: size it above the jobs that run at once (the queues' MaxWorkers)
	// plus what River needs.
	DB idem.Pool
	// Principal owns the key space of the jobs. Default "": DefaultPrincipal, "river".
	// Give each River database's jobs (each sequence of job ids) a principal of its own.
	// Middleware refuses one the SQL API would refuse for every job (when PrincipalOf is nil):
	// over 255 characters, with a NUL, or not UTF-8.
	Principal string
	// PrincipalOf, when set, names each job's principal instead of Principal: the customer
	// the job works for, read from its arguments (a key table whose principal_id has a
	// foreign key to the application's principals needs one of them). Default nil: Principal.
	// A principal whose clients send their own Idempotency-Keys shares the key space with
	// them: a client's "receipt/42" would take the job's key (the job is then cancelled,
	// ErrMismatch) or meet it (422). Give jobs a principal no client authenticates as (a row
	// of the principals table of its own), or a Key the API cannot be sent.
	PrincipalOf func(job *rivertype.JobRow) string
	// Key names a job's key. Default nil: the job's kind and id, "receipt/42": the same for
	// every run and retry of the job and different for every other job. A function of the
	// job's arguments instead (an order id) makes two jobs with the same key one unit of work:
	// the second replays the first's result without running, and one with other arguments is
	// cancelled (idem.ErrMismatch), while the key lives: the TTL after the first's result.
	// A job that shares a key counts its TTL from that result, which may be earlier than the
	// job itself, so keep the TTL longer than the time from the first job under a key to the
	// last run of any job under it (the ErrKeyExpired guard counts from each job's own
	// creation: past the first's result plus the TTL, a later job runs again, under a new
	// provider key).
	Key func(job *rivertype.JobRow) string
	// Lease is the lease of a run: extended every third of it while the work runs, and how
	// long a worker that died keeps its key before a later run takes over. Default 0:
	// DefaultLease. At least a second.
	Lease time.Duration
	// Timeout bounds a run's work, besides River's own job timeout (the context of the work
	// ends at the first of the two). Default 0: idem.DefaultLeaseTimeout.
	Timeout time.Duration
	// TTL is how long the key of a job lives after its last run's lease (and its stored
	// result, after the result). Default 0: DefaultTTL, 30 days. Keep it longer than the
	// time from a job's creation to its last run: its schedule (InsertOpts.ScheduledAt) plus
	// its retry horizon (River's retry policy and MaxAttempts, snoozes, rescues). A run that
	// has run before and comes later is cancelled with ErrKeyExpired instead (see Work).
	TTL time.Duration
	// LockTimeout is as in idem.Job. Default 0: the SQL API's default.
	LockTimeout time.Duration
	// Snooze is how long a run whose key another run holds (a worker still at work, or one
	// that died and whose lease has not run out) waits before it tries again, with
	// river.JobSnooze (which does not count as an attempt). Default 0: Lease.
	Snooze time.Duration
	// Gate is as in idem.Job. Default nil: idem's shared gate.
	Gate *idem.Gate
}

// check returns an error naming the first option that no job can run with: a Lease above 0 and
// under a second, or over idem.MaxDuration; a TTL over idem.MaxDuration; a LockTimeout below 0
// or over idem.MaxLockTimeout (D224); a Principal the SQL API refuses (over 255 characters,
// a NUL, not UTF-8: D243), unless PrincipalOf names every job's instead. A Lease, TTL or Snooze of 0 or below is the default.
func (o Options) check() error {
	switch {
	case o.Lease > 0 && o.Lease < time.Second, o.Lease > idem.MaxDuration:
		return fmt.Errorf("idemriver: Options.Lease must be 0 (%s) or from a second to 10 years, got %s", DefaultLease, o.Lease)
	case o.TTL > idem.MaxDuration:
		return fmt.Errorf("idemriver: Options.TTL must be at most 10 years, got %s", o.TTL)
	case o.LockTimeout < 0 || o.LockTimeout > idem.MaxLockTimeout:
		return fmt.Errorf("idemriver: Options.LockTimeout must be 0 (the SQL API's default) or up to %s, got %s", idem.MaxLockTimeout, o.LockTimeout)
	case o.PrincipalOf == nil && (!utf8.ValidString(o.Principal) || strings.IndexByte(o.Principal, 0) >= 0 ||
		utf8.RuneCountInString(o.Principal) > 255):
		return fmt.Errorf("idemriver: Options.Principal must be \"\" (%q) or 1 to 255 characters of UTF-8 without NUL, got %q", DefaultPrincipal, o.Principal)
	}
	return nil
}

func (o Options) withDefaults() Options {
	if o.Principal == "" {
		o.Principal = DefaultPrincipal
	}
	if o.Lease <= 0 {
		o.Lease = DefaultLease
	}
	if o.TTL <= 0 {
		o.TTL = DefaultTTL
	}
	if o.Snooze <= 0 {
		o.Snooze = o.Lease
	}
	return o
}

// KeyOf is the key Work gives a job by default: its kind and its id, "receipt/42". An idempotency
// key is 1 to 255 visible ASCII characters, and River takes kinds that are not (a middle dot,
// "mail·receipt"): a byte of the kind outside '!' to '~', or a '%', is written %XX
// ("mail%C2%B7receipt/42"), and a kind that would still make the key longer than 255 bytes is
// cut and ends with a hash of the whole ("~" and 16 hex digits). A kind of visible ASCII that
// fits keeps its key as it was.
func KeyOf(job *rivertype.JobRow) string {
	id := strconv.FormatInt(job.ID, 10)
	kind := job.Kind
	if strings.IndexFunc(kind, func(r rune) bool { return r < '!' || r > '~' || r == '%' }) >= 0 {
		var b strings.Builder
		for i := 0; i < len(kind); i++ {
			if c := kind[i]; c < '!' || c > '~' || c == '%' {
				fmt.Fprintf(&b, "%%%02X", c)
			} else {
				b.WriteByte(c)
			}
		}
		kind = b.String()
	}
	if len(kind)+1+len(id) > 255 {
		sum := sha256.Sum256([]byte(job.Kind))
		kind = kind[:255-1-len(id)-17] + "~" + hex.EncodeToString(sum[:8])
	}
	return kind + "/" + id
}

// ranBefore tells whether the job has been fetched before this run (an attempt that failed,
// was rescued, or snoozed): only then may its key exist already.
func ranBefore(job *rivertype.JobRow) bool {
	return job.Attempt > 1 || len(job.Errors) > 0 || len(job.AttemptedBy) > 1
}

// Work runs fn, the outside work of a River job, at most once in effect: under idem.DoLease,
// with the key of the job (Options.Key; by default its kind and id), its kind as the action
// and its arguments as the input. Call it from a worker's Work method:
//
//	func (w *ReceiptWorker) Work(ctx context.Context, job *river.Job[ReceiptArgs]) error {
//		return idemriver.Work(ctx, job.JobRow, w.opts, func(ctx context.Context, claim idem.LeaseClaim) error {
//			return w.mailer.Send(ctx, claim.ProviderKey, job.Args) // the provider deduplicates by the key
//		})
//	}
//
// What it returns to River:
//
//   - nil when fn succeeded (its success is stored with the key, fenced by the claim's token),
//     and also, without running fn, when an earlier run of the job succeeded and was stored
//     but River did not learn of it (the worker died after the work): the job completes;
//   - fn's error when fn failed: the lease is given up at once and River retries the job by
//     its retry policy; the retry runs fn again under the same claim.ProviderKey;
//   - river.JobSnooze(Options.Snooze) when another run holds the key (a worker that is still
//     at work or hung, or one that died and whose lease has not run out yet): the job waits,
//     without spending an attempt, and then finds the result, or takes the key over once the
//     lease has run out (with the same provider key); and a snooze of at most 5 seconds when
//     the key table was locked for maintenance (idem.ErrStoreBusy: nothing was written);
//   - an error when this run's lease was lost (idem.ErrLeaseLost: a worker that hung past its
//     lease, whose key another run may have taken over; fn returned an error, or another run
//     holds the key: nothing of this run is stored, and River's retry finds the other run's
//     result, or the key; fn's own error is wrapped in it, so errors.Is finds both, River
//     records fn's reason, and a river.JobCancel or river.JobSnooze that fn returned still
//     cancels or snoozes the job, as it would have with the lease held; when fn returned nil
//     and no other run had taken the key over, the result is stored all the same (for the
//     key as a new generation's, when it had expired meanwhile) and the job completes), or
//     when its result could not be stored by the lease's
//     AnswerDeadline (an error wrapping context.DeadlineExceeded: the
//     database was unreachable that long; the key stays in progress until its lease runs
//     out, and River's retry then takes it over with the same provider key);
//   - river.JobCancel of an error wrapping idem.ErrMismatch when the key was used with other
//     arguments (a Key function that gives two different jobs one key), of
//     idem.ErrInvalidArgument when the SQL API refuses the key, the principal or the action
//     (a Key or PrincipalOf function that gives "" or a key that is not visible ASCII), of
//     idem.ErrUnknownPrincipal when a foreign key of the application's on the key table does
//     not know the job's principal (deleted since the job was enqueued), and of ErrKeyExpired
//     when the job ran before and is older than the key's TTL: it is not run again.
//
// fn's own error goes to River as it is, whatever it wraps: an idem.ErrInProgress or
// idem.ErrMismatch of an idem.Do inside fn is fn's failure, retried by River's policy, not a
// snooze or a cancel of this job.
//
// Inside a run of Middleware (or of an outer Work) for the same job that holds the same
// principal and key, Work runs fn at once under that run's claim: the job is claimed once,
// however many layers call Work (a Middleware in river.Config.Middleware and a worker that
// calls Work itself). Inside a run for another job under the same principal and key (a Key
// function that gives both one key), Work answers as a claim of its own would, without running
// fn, with an error for the outer fn, not a wish of River's (returned on, a cancel or a snooze
// would be the outer job's): one wrapping idem.ErrMismatch when the kinds or the arguments
// differ, idem.ErrInProgress when they are the same (the outer run is doing that work).
//
// fn's context ends at River's job timeout, at Options.Timeout, or when the lease is lost
// (cause idem.ErrLeaseLost); fn should stop then. Under Middleware, River's job timeout ends
// the worker's context but not the lease's (River applies it below the middleware): a worker
// that hangs past it keeps its key, extended, until Options.Timeout; set Options.Timeout to
// the job timeout where that matters. A takeover runs fn again, so fn's own
// writes to the database are either made in steps (idem.Step on fn's context, as under
// DoLease: a step recorded by an earlier attempt is not run again) or go in a transaction of
// their own, idempotent themselves (keyed by claim.ProviderKey).
func Work(ctx context.Context, job *rivertype.JobRow, o Options, fn func(ctx context.Context, claim idem.LeaseClaim) error) error {
	if o.DB == nil {
		return errors.New("idemriver: Options.DB is nil")
	}
	if err := o.check(); err != nil {
		// Refused on every retry, as a key the SQL API refuses is (D170): cancelled before any
		// claim. Middleware refuses such options when it is built.
		return river.JobCancel(fmt.Errorf("%w: %w", idem.ErrInvalidArgument, err))
	}
	o = o.withDefaults()
	principal, key := o.Principal, KeyOf(job)
	if o.PrincipalOf != nil {
		principal = o.PrincipalOf(job)
	}
	if o.Key != nil {
		key = o.Key(job)
	}
	if h, ok := ctx.Value(heldKey{}).(held); ok && h.claim.Principal == principal && h.claim.Key == key {
		switch {
		case h.job == job.ID:
			// An outer layer (Middleware) holds this job's key: claiming it again would find
			// the outer claim in progress and snooze the job, every time.
			return fn(ctx, h.claim)
		case jobSum(h.kind, h.args) != jobSum(job.Kind, job.EncodedArgs):
			// Another job (a Key function that gives two jobs one key) with another kind or
			// other arguments: what a claim of its own would be told (D251). A plain error,
			// not River's cancel: it goes to the outer job's fn, and a JobCancel returned on
			// from there would cancel the outer job (D258).
			return fmt.Errorf("idemriver: job %d under key_hash %s, held by job %d around this call: %w", job.ID, idem.KeyHash(principal, key), h.job, idem.ErrMismatch)
		default:
			// Another job with the same kind and arguments: the outer run is doing its work,
			// and holds the key, as a claim of its own would be told. Not a JobSnooze, which
			// returned on from the outer fn would snooze the outer job, for ever.
			return fmt.Errorf("idemriver: job %d under key_hash %s, held by job %d around this call: %w", job.ID, idem.KeyHash(principal, key), h.job, idem.ErrInProgress)
		}
	}
	// The first run of the job claimed its key no earlier than the job was created, and every
	// later run's claim kept it at least the TTL past that claim: while the job is younger
	// than the TTL (less a margin for the clocks), its key is there if it was ever claimed.
	if ranBefore(job) && time.Since(job.CreatedAt) >= o.TTL-min(o.TTL/10, time.Hour) {
		return river.JobCancel(fmt.Errorf("%w (job %d, created %s, key TTL %s)", ErrKeyExpired, job.ID,
			job.CreatedAt.UTC().Format(time.RFC3339), o.TTL))
	}
	var input any
	if len(job.EncodedArgs) > 0 {
		input = json.RawMessage(job.EncodedArgs)
	}
	// fnFailed: fn returned an error, which goes to River's retry policy as it is, whatever it
	// wraps (an inner idem.Do's ErrInProgress or ErrMismatch is fn's failure, not this job's
	// key's). DoLease returns once fn has returned.
	var fnFailed bool
	var fnErr error
	_, _, err := idem.DoLease(ctx, o.DB, idem.Job{Principal: principal, Key: key, Action: job.Kind, Input: input,
		TTL: o.TTL, LockTimeout: o.LockTimeout, Gate: o.Gate, Lease: o.Lease, Timeout: o.Timeout},
		func(ctx context.Context, claim idem.LeaseClaim) (struct{}, error) {
			err := fn(context.WithValue(ctx, heldKey{}, held{claim: claim, job: job.ID, kind: job.Kind, args: job.EncodedArgs}), claim)
			fnFailed, fnErr = err != nil, err
			return struct{}{}, err
		})
	switch {
	case err == nil:
		return nil
	case fnFailed && err == fnErr:
		// fn's own error, as it is, whatever it wraps (an inner DoLease's ErrLeaseLost is not
		// this job's lease): DoLease returns ErrLeaseLost itself when this job's lease was lost.
		return err
	case errors.Is(err, idem.ErrLeaseLost) && fnFailed:
		// fn's reason and its wish (River finds a JobCancel or JobSnooze with errors.As):
		// a snooze turned into an error would spend an attempt, and the last one discards
		// the job (D243).
		return fmt.Errorf("idemriver: job %d under key_hash %s: %w; fn returned: %w", job.ID, idem.KeyHash(principal, key), err, fnErr)
	case errors.Is(err, idem.ErrLeaseLost):
		return fmt.Errorf("idemriver: job %d under key_hash %s: %w", job.ID, idem.KeyHash(principal, key), err)
	case fnFailed:
		return err
	case errors.Is(err, idem.ErrInProgress):
		return river.JobSnooze(o.Snooze)
	case errors.Is(err, idem.ErrStoreBusy):
		// The key table is locked for maintenance (a migration's swap, VACUUM FULL,
		// pg_repack): nothing was written, and the lock is expected to go; no attempt spent.
		return river.JobSnooze(min(o.Snooze, storeBusySnooze))
	case errors.Is(err, idem.ErrMismatch), errors.Is(err, idem.ErrInvalidArgument), errors.Is(err, idem.ErrUnknownPrincipal):
		// Another job's arguments under this key, a key, principal or action the SQL API
		// refuses (Options.Key, PrincipalOf), or a principal the application's foreign key on
		// the key table does not know (deleted since the job was enqueued): no retry would
		// run it.
		return river.JobCancel(fmt.Errorf("idemriver: job %d under key_hash %s: %w", job.ID, idem.KeyHash(principal, key), err))
	}
	return err
}

// storeBusySnooze is the longest a job waits when the key table was locked for maintenance.
const storeBusySnooze = 5 * time.Second

// heldKey is the context key of the claim Work holds while fn runs (ClaimOf), with the job it
// holds it for, which a nested Work compares its own with.
type heldKey struct{}

// held is a claim Work holds while fn runs, with the job it holds it for.
type held struct {
	claim idem.LeaseClaim
	job   int64
	kind  string
	args  []byte
}

// jobSum is a job's request as Work claims it: its kind and its arguments as canonical JSON
// (key order and spacing do not count), as DoLease fingerprints them.
func jobSum(kind string, args []byte) [32]byte {
	return canon.Compute("DO", kind, args).Sum
}

// ClaimOf returns the claim of the job that the worker middleware (Middleware) or Work runs,
// or false outside them. Hand an outside provider its ProviderKey.
func ClaimOf(ctx context.Context) (idem.LeaseClaim, bool) {
	h, ok := ctx.Value(heldKey{}).(held)
	return h.claim, ok
}

// Middleware returns a River worker middleware that runs every job it wraps with Work: the
// worker's Work method runs under the job's lease, and finds its claim with ClaimOf. Install
// it for some kinds of job with their worker's Middleware method (embed
// river.WorkerDefaults and return it), or for every job in river.Config.Middleware. It panics
// on options no job can run with (Options, a nil DB included), as idem's Route does on a
// declaration that cannot work.
func Middleware(o Options) rivertype.WorkerMiddleware {
	if o.DB == nil {
		panic("idemriver: Options.DB is nil") // every job would fail until River discards it
	}
	if err := o.check(); err != nil {
		panic(err.Error()) // as idem's Route does on a declaration that cannot work
	}
	return river.WorkerMiddlewareFunc(func(ctx context.Context, job *rivertype.JobRow, doInner func(ctx context.Context) error) error {
		return Work(ctx, job, o, func(ctx context.Context, _ idem.LeaseClaim) error {
			return doInner(ctx) // ctx carries the claim (ClaimOf)
		})
	})
}

package idem

// What a handler behind the middleware uses: its claim, its transaction, its body, its own
// problems.

import (
	"context"
	"net/http"

	"github.com/jackc/pgx/v5"

	idemhttp "github.com/pgidem/pgidem/internal/http"
)

// ClaimInfo is what a handler knows about the key its request works under (ClaimOf).
type ClaimInfo struct {
	// Principal owns the key.
	Principal string
	// Key is the client's idempotency key as the middleware read it from the header: a
	// quoted sf-string ("k1") is unquoted, so it is the key the database stores.
	Key string
	// Attempt is the fencing token of this claim: no earlier claim of the key had it.
	Attempt int64
	// ProviderKey is the key to give an outside provider that deduplicates by its own
	// idempotency key (a payment provider's Idempotency-Key): the same for every attempt of
	// this request (retries, a takeover of its lease after a crash), different for every
	// other request, a later one under the same key after this one expired or was released
	// included, and for every other principal. It comes from the database with the claim and
	// is 64 hex digits. On a lease route a request without a key gets one of its own
	// (ClaimOf's ok is false then).
	// On a transactional route the claim commits with the answer or not at all: when the
	// work rolls back (an answer that is not stored, such as a 5xx; a panic; a serialization
	// failure that runs the handler again), its claim and generation roll back with it, and
	// the next run or retry has a new ProviderKey.
	// Work outside the database, which a rollback cannot undo, belongs on a lease route.
	ProviderKey string
	// RecoveryPoint is the last step (Step) that an earlier attempt of this request recorded
	// on a lease route, when this attempt took the key's lease over (after a crash, a lease
	// that ran out, or a retry after the work failed); "" when none. Step skips the steps
	// recorded by itself: this is for logs and metrics.
	RecoveryPoint string
}

// ErrLeaseLost is the cause (context.Cause) of a lease route's handler context, and the error
// of DoLease, when the lease was lost: another attempt may hold the key, so the work should
// stop. A 2xx the handler still writes, or a result DoLease's fn still returns with a nil
// error, is recorded, fenced by the claim's token, only while no other attempt has taken the
// key over (the lease ran out without an extension landing); when the key has expired
// meanwhile too (its TTL past the lease's end), or was released, and nobody took it, it is
// recorded for the key as a new generation's answer. Once another attempt holds the key it is neither recorded nor
// sent. A handler that returns without writing, or an error, records
// nothing.
var ErrLeaseLost = idemhttp.ErrLeaseLost

// ErrShutdown is the cause (context.Cause) of a keyed request's work context (and of a lease
// route's request without a key) when the middleware's Shutdown gave up waiting for it: the
// handler should stop. On a transactional
// route the unit of work rolls back, nothing is stored, and the client gets 503 shutting_down
// with Retry-After when the handler wrote nothing or a 2xx (a handler that answers its own
// error sends that); on a lease route, unless the handler
// answers with a 2xx or a final error, its lease ends at once without an answer, and the
// client's retry runs the work again under the same ClaimInfo.ProviderKey. A lease route's
// handler that returns without writing anything is answered 503 shutting_down (it is not sent
// as an empty 200, nor stored).
var ErrShutdown = idemhttp.ErrShutdown

// The defaults and bounds of Options.WorkTimeout and Options.DuplicateWait.
const (
	// DefaultWorkTimeout is Options.WorkTimeout's default: 30 seconds.
	DefaultWorkTimeout = idemhttp.DefaultWorkTimeout
	// DefaultDuplicateWait is Options.DuplicateWait's default: 10 seconds.
	DefaultDuplicateWait = idemhttp.DefaultDuplicateWait
	// MaxDuplicateWait is Options.DuplicateWait's bound: 10 minutes.
	MaxDuplicateWait = idemhttp.MaxDuplicateWait
	// DefaultAnswerPoll is how often a duplicate on a lease route whose holder runs in another
	// process looks at the key: one statement per round for every key the process waits on,
	// however many duplicates wait, the rounds paced to a tenth of the time at most: 100
	// milliseconds.
	DefaultAnswerPoll = idemhttp.DefaultAnswerPoll
)

// TxFrom returns the transaction of the request's unit of work: the handler's writes through
// it commit together with the key, or not at all. Nil outside a declared transactional route,
// and nil on a lease route: there is no transaction there, the claim committed on its own
// before the handler ran. A lease handler writes in steps (Step): each step's transaction
// commits its writes with its recovery point, fenced by the claim's token, and a takeover,
// which runs the handler again, skips the steps done. Do not call Commit or Rollback on the
// transaction TxFrom returns: answer, and the middleware ends it.
func TxFrom(ctx context.Context) pgx.Tx { return idemhttp.Tx(ctx) }

// ClaimOf returns the claim of the request's unit of work, or false for a request that runs
// without a key. On a lease route, a request without a key still gets a ProviderKey of its
// own (a random one, used by no other request), so a handler can hand its provider
// ClaimInfo.ProviderKey whether the client sent a key or not.
func ClaimOf(ctx context.Context) (ClaimInfo, bool) {
	c, ok := idemhttp.ClaimOf(ctx)
	return ClaimInfo(c), ok
}

// DecodeJSON reads the request's JSON body into v strictly (exact-case member names; unknown
// and duplicate members, names that differ only in case, invalid UTF-8, trailing data, nesting
// deeper than 128 levels and exponents of more than 16 digits refused, with a key or without),
// decoding the canonical text that was fingerprinted, so that two requests with one
// fingerprint mean the same thing. Numbers keep every digit; the canonical text writes an
// integer from 10^21 on and a fraction below 10^-6 with an exponent (1e+21). Besides the types
// of the encoding/json v2 semantics (github.com/go-json-experiment/json) it reads
// encoding/json's Number (the canonical text, or a string that is a number), time.Duration (an integer of nanoseconds, as
// encoding/json does) and *big.Int (in either layout, up to 10,000 digits); a type of its own
// that cannot read the exponent layout refuses such numbers (take them as strings). On failure
// it writes 400 malformed_body or 415 unsupported_media_type (final answers, stored for a keyed
// request) and returns false.
func DecodeJSON(w http.ResponseWriter, r *http.Request, v any) bool {
	return idemhttp.DecodeJSON(w, r, v)
}

// MarkOneTimeSecret marks the response as a one-time secret (a token shown once): it is sent,
// stored without its body, and a repeat gets 409 one_time_secret.
func MarkOneTimeSecret(ctx context.Context) { idemhttp.MarkOneTimeSecret(ctx) }

// SetResourceID names what the request created; a repeat of a response whose body is not
// stored names it. Default: the body's top-level "id", else the Location header. Stored as
// text: U+0000 and bytes that are not UTF-8 become U+FFFD.
func SetResourceID(ctx context.Context, id string) { idemhttp.SetResourceID(ctx, id) }

// WriteProblem writes an application's own RFC 9457 problem in the middleware's shape:
// application/problem+json, nosniff, the status, and a type that is base followed by code.
// Pass the middleware's base (Middleware.Options().ProblemBase) so that the type is a URI; ""
// gives the bare code. correlationID is the request's correlation id
// (r.Header.Get(Middleware.Options().CorrelationHeader)); "" leaves the member out.
func WriteProblem(w http.ResponseWriter, status int, base, code, title, detail, correlationID string) {
	idemhttp.WriteProblem(w, status, base, code, title, detail, correlationID)
}

// Refuse writes one of the middleware's problems (a Code constant) from a handler, with the
// options of the request's route: for a body that DecodeJSON accepted but the handler cannot
// take (a required member missing: CodeMalformedBody). Any other code is answered 500
// internal_error and logged; an application's own problems go through WriteProblem.
// CodeInProgress, for a job the handler runs with Do that returned ErrInProgress, is 409 with
// Retry-After: 1 (unless the handler set one) and is not the request's final answer: the work
// is rolled back and nothing is stored, so the client's retry runs the handler again.
func Refuse(w http.ResponseWriter, r *http.Request, code, detail string) {
	idemhttp.Refuse(w, r, code, detail)
}

// DefaultFinalStatus is the default of Options.FinalStatus: the error statuses that a retry
// of the same request would get again, stored and replayed (400, 403, 404, 409, 410, 412, 413,
// 415, 422).
func DefaultFinalStatus(status int) bool { return idemhttp.DefaultFinalStatus(status) }

// DefaultRouteTemplate is the route template the middleware uses when Options.RouteTemplate
// gives none: the path of net/http's ServeMux pattern (without its method and host), else the
// URL path.
func DefaultRouteTemplate(r *http.Request) string { return idemhttp.DefaultRouteTemplate(r) }

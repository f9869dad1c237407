// Package idemhttp is the gorilla/mux (and plain net/http) middleware of idem: wrap a
// route, and retries of its requests become safe without idempotency code in the handler.
//
// For a declared route, a request that carries an Idempotency-Key and has a principal:
//
//   - the first request runs the handler inside a database transaction that also claims the
//     key; a 2xx response is stored with the effect in the same commit;
//   - a repeat gets the stored response byte for byte, plus Idempotent-Replayed: true;
//   - a different request under the same key gets 422 idempotency_key_reuse;
//   - a repeat while the first still runs waits for its answer (without a connection, up to
//     Options.DuplicateWait), then answers as the first did, or 409 request_in_progress with
//     Retry-After;
//   - the work of a keyed request outlives a client that goes away, up to
//     Options.WorkTimeout, and commits with its answer for the client's retry;
//   - a final error (400, 403, 404, 409, 410, 412, 413, 415, 422) is rolled back to a
//     savepoint taken right after the claim and stored in the same transaction; other errors
//     (401, 408, 428, 429, 3xx, 5xx, a panic) are rolled back and not stored.
//
// Handlers write through the transaction in the request's context ([Tx]) and read a JSON
// body with [DecodeJSON], which decodes exactly the bytes that were fingerprinted.
// docs/http.md has the whole behaviour table, the problem types and how to wire it.
package idemhttp

import (
	"cmp"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"net/http"
	"slices"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/trace"

	"github.com/pgidem/pgidem/internal/canon"
	"github.com/pgidem/pgidem/internal/dbidem"
	"github.com/pgidem/pgidem/internal/httpsyntax"
	"github.com/pgidem/pgidem/internal/safelog"
)

// Options configure a Middleware. Only DB and Principal are required.
type Options struct {
	// DB is the pool the units of work run on. Required.
	DB *pgxpool.Pool
	// Principal returns who sent the request, or false for an anonymous request (whose
	// Idempotency-Key is then ignored). Required. An application that references its own
	// principals table from idem.idempotency_keys gets 401 for a principal that is not there.
	Principal func(*http.Request) (string, bool)
	// RouteTemplate returns the route template of a request ("/v1/accounts/{id}/deposits"),
	// for a router other than net/http's ServeMux, whose pattern the middleware reads itself
	// (DefaultRouteTemplate); "" falls back to that. The template names a route in its default
	// Action and finds routes declared with Declare.
	RouteTemplate func(r *http.Request) string
	// KeyHeader is the request header that carries the key. Default "Idempotency-Key".
	KeyHeader string
	// ReplayHeader is set to "true" on a replayed response. Default "Idempotent-Replayed".
	ReplayHeader string
	// CorrelationHeader names the request's correlation id; a replay carries the current
	// request's value, not the stored one. Default "X-Request-Id".
	CorrelationHeader string
	// TTL is how long a key's answer stays replayable after it was given. 0: the SQL API's
	// default (24 hours).
	TTL time.Duration
	// LockTimeout bounds each wait of the store's statements on the database for a
	// concurrent holder of the same key's row lock (idem_begin's p_lock_timeout): a duplicate
	// of a request running in another process waits on the key's row lock this long at a time
	// and claims again, until DuplicateWait is over (a duplicate of a request in this process
	// waits in Go, bounded by DuplicateWait alone); 409 request_in_progress comes when
	// DuplicateWait is over. Default 0: the SQL API's default, 2 seconds. From a millisecond
	// to MaxLockTimeout (PostgreSQL's largest lock_timeout, about 24 days).
	LockTimeout time.Duration
	// WorkTimeout bounds the unit of work of a keyed request on a transactional route, from
	// its claim to its commit. The work does not end when the client goes away (a disconnect,
	// the client's own attempt timeout): it runs to its end and commits with its answer, which
	// the client's retry gets; it ends at this server-side deadline, and at Shutdown's. 0:
	// DefaultWorkTimeout (30 seconds). Route.WorkTimeout overrides it for one route.
	WorkTimeout time.Duration
	// DuplicateWait bounds how long a duplicate of a request that is still running waits for
	// its answer, without a connection, before it gets 409 request_in_progress: on a
	// transactional route it waits on the key (in Go, or on the row lock with a wait slot), on
	// a lease route for the holder's answer (woken at once when the holder is in this
	// process, else by a look at the key every DefaultAnswerPoll). Whatever the route, the
	// answer reaches the duplicate soon after it is stored, even past its wait once it saw the
	// key answered (the replays of this process go one at a time; D211, D215). 0:
	// DefaultDuplicateWait (10 seconds). At most 10 minutes.
	DuplicateWait time.Duration
	// MaxWaitingClaims bounds how many requests may wait on a key's row lock (held by another
	// process) at once; a request that finds them all waiting gets 409 at once, so requests for
	// other keys always find a connection. It also bounds the statements lease work runs
	// outside its claim (extensions, the recording of answers, yields, the duplicates' looks):
	// as many run at once, or half of DB's connections when that is more, so that a locked key
	// table cannot make them hold the pool, and a statement that waits on one key's row does
	// not hold up every other lease's extensions. 0: a quarter of DB's maximum connections, at
	// least 1.
	MaxWaitingClaims int
	// MaxWaitingBytes bounds what the duplicates waiting in this process for a request with
	// the same key hold at once: each counts its body plus 4 KiB. A duplicate that would pass
	// it gets 409 request_in_progress with Retry-After at once, so a storm of large
	// duplicates cannot grow the process's memory. 0: 16 times MaxBodyBytes, at least 16 MiB.
	MaxWaitingBytes int64
	// MaxBodyBytes is the largest request body read; a larger one gets 413 before any
	// fingerprint or database work. Default 1 MiB.
	MaxBodyBytes int64
	// MaxStoredBodyBytes is the largest response body stored for replay; a larger response
	// is sent once and stored without its body (a repeat gets 409 response_not_replayable).
	// Default 256 KiB.
	MaxStoredBodyBytes int
	// StoredHeaders is the allowlist of response headers stored and replayed. Default
	// Content-Type, Location, ETag, Content-Location, Last-Modified.
	StoredHeaders []string
	// FinalStatus tells which error statuses are final: rolled back, then stored and
	// replayed. Default: 400, 403, 404, 409, 410, 412, 413, 415, 422.
	FinalStatus func(status int) bool
	// ProblemBase is the prefix of the problem type URIs; a problem's type is ProblemBase
	// followed by its code, which is also an anchor of docs/http.md. Default
	// "https://github.com/pgidem/pgidem/blob/main/docs/http.md#".
	ProblemBase string
	// MaxAttempts bounds the runs of a unit of work that fails with 40001 or 40P01.
	// 0: 3.
	MaxAttempts int
	// Logger receives one line per keyed request that was not acquired or replayed, and
	// every failure to record or release a key (never a raw key or body: keys are logged as
	// a short hash). Default slog.Default(). A record whose handler panics is dropped: the
	// middleware logs from inside its recoveries, where nothing may stop an answer or the
	// release of a key.
	Logger *slog.Logger
	// Metrics observes every keyed request that reaches its claim (one refused before it, for
	// its key, its body or its size, or after Shutdown's deadline, is counted in no state).
	// Default: none.
	Metrics Observer
	// TracerProvider, when set, traces every keyed request with OpenTelemetry: the spans
	// idem.claim, idem.handler and idem.complete under the request's span, with the action,
	// the key's hash and the outcome (docs/http.md, "Metrics, traces and logs"). Pass
	// otel.GetTracerProvider() for the global one. Default: none, and no tracing work at all. A
	// panic of the tracer or of a span is recovered (the first logged at error): it loses that
	// span or that call, never an answer.
	TracerProvider trace.TracerProvider
}

// Route declares how one route takes part. The zero value is an optional-key,
// transactional route whose action is the request's method and route path template.
type Route struct {
	// Action names what the route does, for example "POST /v1/transfers". A different
	// action under the same key is a mismatch. Default: the method and the route template
	// (gorilla/mux's, ServeMux's pattern, or Options.RouteTemplate's; else the URL path), a
	// method outside RFC 9110's nine named OTHER, bytes that are not UTF-8 and U+0000
	// replaced by U+FFFD, cut to MaxActionLength characters. A declared Action must be valid
	// UTF-8 without U+0000 (PostgreSQL's text holds neither). The action is a metric label: with the URL path as the
	// template, every path is one, so give a router's template (Options.RouteTemplate).
	Action string
	// Required makes a request without the key a 400 idempotency_key_missing, when
	// Options.Principal names a principal for it: a request without one (anonymous, or
	// authenticated by a middleware that runs after this one) runs every time, key or not.
	// Put the authentication in front of the middleware.
	Required bool
	// Lease makes the route a lease claim for work outside the database (at least a
	// second): the claim is committed on its own before the handler runs, the handler gets no
	// transaction, and the response is stored afterwards, fenced by the claim's attempt. While
	// the handler runs, the lease is extended every third of it; the handler's context does
	// not end when the client disconnects, and ends with cause ErrLeaseLost when the lease is
	// lost. 0: a transactional claim, the handler's writes commit with the key.
	Lease time.Duration
	// LeaseTimeout bounds a lease route's handler: its context ends then, and a handler that
	// gives up answers 5xx, which releases the key. 0: five minutes.
	LeaseTimeout time.Duration
	// WorkTimeout bounds the unit of work of a keyed request on this transactional route
	// (Options.WorkTimeout). 0: Options.WorkTimeout.
	WorkTimeout time.Duration
	// Fingerprint replaces the default fingerprint (method, path and canonical body) for a
	// route whose meaning is narrower than its body. The body is still judged on its own
	// (strictly valid JSON, not ambiguous), as with the default fingerprint.
	Fingerprint func(r *http.Request, body []byte) canon.Fingerprint
}

func (o *Options) defaults() {
	if o.KeyHeader == "" {
		o.KeyHeader = "Idempotency-Key"
	}
	if o.ReplayHeader == "" {
		o.ReplayHeader = "Idempotent-Replayed"
	}
	if o.CorrelationHeader == "" {
		o.CorrelationHeader = "X-Request-Id"
	}
	if o.MaxBodyBytes == 0 {
		o.MaxBodyBytes = 1 << 20
	}
	if o.MaxWaitingBytes == 0 {
		// Saturated: 16 times a MaxBodyBytes near math.MaxInt64 would wrap to a negative bound.
		o.MaxWaitingBytes = 16 << 20
		if o.MaxBodyBytes > o.MaxWaitingBytes/16 {
			o.MaxWaitingBytes = math.MaxInt64
			if o.MaxBodyBytes <= math.MaxInt64/16 {
				o.MaxWaitingBytes = 16 * o.MaxBodyBytes
			}
		}
	}
	if o.MaxStoredBodyBytes == 0 {
		o.MaxStoredBodyBytes = 256 << 10
	}
	if o.StoredHeaders == nil {
		o.StoredHeaders = []string{"Content-Type", "Location", "ETag", "Content-Location", "Last-Modified"}
	}
	if o.FinalStatus == nil {
		o.FinalStatus = DefaultFinalStatus
	}
	if o.ProblemBase == "" {
		o.ProblemBase = "https://github.com/pgidem/pgidem/blob/main/docs/http.md#"
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	o.Logger = safelog.Wrap(o.Logger)
	if o.WorkTimeout == 0 {
		o.WorkTimeout = DefaultWorkTimeout
	}
	if o.DuplicateWait == 0 {
		o.DuplicateWait = DefaultDuplicateWait
	}
	if o.Metrics == nil {
		o.Metrics = nopObserver{}
	}
}

// DefaultFinalStatus is the default Options.FinalStatus: the error statuses that a retry of
// the same request would get again (docs/http.md).
func DefaultFinalStatus(status int) bool {
	switch status {
	case 400, 403, 404, 409, 410, 412, 413, 415, 422:
		return true
	}
	return false
}

// check returns an error naming the first option that cannot work: a missing DB or
// Principal, a negative size, a duration outside the SQL API's bounds (a TTL up to 10 years, a
// lock timeout up to PostgreSQL's largest), a header name that is not a token, more waiting
// claims than the pool has connections.
func (o Options) check() error {
	switch {
	case o.DB == nil:
		return errors.New("idem: Options.DB is required")
	case o.Principal == nil:
		return errors.New("idem: Options.Principal is required")
	case o.TTL < 0 || o.TTL > dbidem.MaxInterval || (o.TTL > 0 && o.TTL < time.Microsecond):
		return fmt.Errorf("idem: Options.TTL must be 0 (the SQL API's default, 24h) or from 1µs to 10 years (the SQL API's bound), got %s", o.TTL)
	case o.LockTimeout < 0 || o.LockTimeout > dbidem.MaxLockTimeout || (o.LockTimeout > 0 && o.LockTimeout < time.Millisecond):
		return fmt.Errorf("idem: Options.LockTimeout must be 0 (the SQL API's default, 2s) or from 1ms to %s (PostgreSQL's largest lock_timeout), got %s",
			dbidem.MaxLockTimeout, o.LockTimeout)
	case o.WorkTimeout < 0 || o.DuplicateWait < 0 || o.DuplicateWait > MaxDuplicateWait:
		return fmt.Errorf("idem: Options.WorkTimeout must not be negative, and Options.DuplicateWait must be 0 (the default, %s) or up to %s, got %s, %s",
			DefaultDuplicateWait, MaxDuplicateWait, o.WorkTimeout, o.DuplicateWait)
	case o.MaxBodyBytes < 0 || o.MaxStoredBodyBytes < 0 || o.MaxWaitingBytes < 0 || o.MaxWaitingClaims < 0 || o.MaxAttempts < 0:
		return errors.New("idem: Options.MaxBodyBytes, MaxStoredBodyBytes, MaxWaitingBytes, MaxWaitingClaims and MaxAttempts must not be negative")
	case o.MaxWaitingClaims > 0 && o.MaxWaitingClaims >= int(o.DB.Config().MaxConns):
		return fmt.Errorf("idem: Options.MaxWaitingClaims (%d) must be smaller than the pool's MaxConns (%d), so that requests for other keys find a connection",
			o.MaxWaitingClaims, o.DB.Config().MaxConns)
	}
	for name, h := range map[string]string{"KeyHeader": o.KeyHeader, "ReplayHeader": o.ReplayHeader, "CorrelationHeader": o.CorrelationHeader} {
		if h != "" && !httpsyntax.IsToken(h) {
			return fmt.Errorf("idem: Options.%s %q is not a header name", name, h)
		}
	}
	key, correlation := cmp.Or(o.KeyHeader, "Idempotency-Key"), cmp.Or(o.CorrelationHeader, "X-Request-Id")
	if strings.EqualFold(key, correlation) {
		// The correlation id is logged and sent in every problem as it is: the keys would be
		// too, where only their hash may be.
		return fmt.Errorf("idem: Options.KeyHeader and Options.CorrelationHeader are both %q: the correlation id is logged "+
			"and sent in problems as it is, and a key never is; set CorrelationHeader to another header", key)
	}
	if replay := cmp.Or(o.ReplayHeader, "Idempotent-Replayed"); strings.EqualFold(replay, key) || strings.EqualFold(replay, correlation) {
		// A replay sets it to "true": over the key (which a client would then read back as
		// its key) or over the current request's correlation id, which a replay carries.
		return fmt.Errorf("idem: Options.ReplayHeader %q is also Options.KeyHeader or Options.CorrelationHeader (%q, %q): "+
			"a replay sets it to \"true\" over that header; choose another", replay, key, correlation)
	}
	for _, h := range o.StoredHeaders {
		if !httpsyntax.IsToken(h) {
			return fmt.Errorf("idem: Options.StoredHeaders: %q is not a header name", h)
		}
		if slices.ContainsFunc(connectionHeaders, func(c string) bool { return strings.EqualFold(c, h) }) {
			return fmt.Errorf("idem: Options.StoredHeaders: %s belongs to one connection, or to the framing or the "+
				"moment of one response (RFC 9110 7.6.1, 6.6.1, 8.6): it cannot be replayed on another; net/http sets "+
				"what each response needs", h)
		}
	}
	return nil
}

// connectionHeaders are the header fields of one connection (hop-by-hop), or of the framing
// or the moment of one response (its length, its Date), which a stored answer cannot carry to
// another: StoredHeaders refuses them.
var connectionHeaders = []string{"Connection", "Keep-Alive", "Proxy-Connection", "Transfer-Encoding", "TE", "Trailer",
	"Upgrade", "Proxy-Authenticate", "Proxy-Authorization", "Content-Length", "Date"}

// The defaults and bounds of the waits and deadlines of keyed requests.
const (
	// DefaultWorkTimeout is Options.WorkTimeout's default.
	DefaultWorkTimeout = 30 * time.Second
	// DefaultDuplicateWait is Options.DuplicateWait's default.
	DefaultDuplicateWait = 10 * time.Second
	// MaxDuplicateWait is Options.DuplicateWait's bound.
	MaxDuplicateWait = 10 * time.Minute
	// DefaultAnswerPoll is how often a duplicate on a lease route whose holder runs in
	// another process looks at the key (one statement per round for every key this process
	// waits on, the rounds paced to a tenth of the time at most).
	DefaultAnswerPoll = 100 * time.Millisecond
)

// MaxActionLength is the longest Route.Action the SQL API takes (characters).
const MaxActionLength = 1000

// check panics on a declaration that cannot work, as http.Handle does on a bad pattern: it is
// a programming error, found when the routes are declared.
// checkDeclared panics on a Declare that no request can match: a method that is not an HTTP
// token (empty, or a "METHOD /path" pattern), a template that does not start with "/".
func checkDeclared(method, template string) {
	if !httpsyntax.IsToken(method) || !strings.HasPrefix(template, "/") {
		panic(fmt.Sprintf("idem: Declare(%q, %q): want a method (such as POST) and a path template that starts with / "+
			"(such as /v1/orders/{id}): no request can match this declaration", method, template))
	}
}

func (rt Route) check() {
	if rt.Lease < 0 || (rt.Lease > 0 && rt.Lease < time.Second) || rt.Lease > dbidem.MaxInterval || rt.LeaseTimeout < 0 || rt.WorkTimeout < 0 {
		panic(fmt.Sprintf("idem: Route.Lease must be 0 (a transactional route) or from a second to 10 years, and LeaseTimeout and WorkTimeout not negative: got %s, %s, %s",
			rt.Lease, rt.LeaseTimeout, rt.WorkTimeout))
	}
	if rt.Lease > 0 && rt.WorkTimeout != 0 || rt.Lease == 0 && rt.LeaseTimeout != 0 {
		// Each bound is one kind of route's: set on the other it was ignored (D270).
		panic(fmt.Sprintf("idem: Route.WorkTimeout bounds a transactional route's unit of work and LeaseTimeout a lease route's handler: "+
			"got Lease %s with WorkTimeout %s and LeaseTimeout %s; set the one of the route's kind", rt.Lease, rt.WorkTimeout, rt.LeaseTimeout))
	}
	if utf8.RuneCountInString(rt.Action) > MaxActionLength {
		panic(fmt.Sprintf("idem: Route.Action must be at most %d characters, got %d", MaxActionLength, utf8.RuneCountInString(rt.Action)))
	}
	if !utf8.ValidString(rt.Action) || strings.IndexByte(rt.Action, 0) >= 0 {
		// PostgreSQL's text holds neither: every claim would be refused (22021).
		panic(fmt.Sprintf("idem: Route.Action must be valid UTF-8 without U+0000, got %q", rt.Action))
	}
}

package idem

import (
	"context"
	"log/slog"
	"net/http"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/trace"

	"github.com/pgidem/pgidem/internal/canon"
	idemhttp "github.com/pgidem/pgidem/internal/http"
)

// The HTTP middleware. Its implementation is in internal/http; the types here are this
// package's own, converted at the boundary.

// Options configure a Middleware. Only DB and Principal are required; every other field
// says its default and its bounds, which New checks.
type Options struct {
	// DB is the pool the units of work run on. Required. Its role must be a member of the
	// application role that Migrate granted the SQL API to (idem_app by default); it needs
	// no other privilege on schema idem, and should not own it (docs/http.md, "Two roles").
	DB *pgxpool.Pool
	// Principal returns who sent the request, or false for an anonymous request (whose
	// Idempotency-Key is then ignored): your authentication, which must run before the
	// middleware. Required. Keys belong to a principal: 1 to 255 characters (longer is a
	// 500 idempotency_misconfigured). An application that references its own principals
	// table from idem.idempotency_keys gets 401 for a principal that is not there.
	Principal func(*http.Request) (string, bool)
	// RouteTemplate returns the route template of a request ("/v1/accounts/{id}/deposits"),
	// which names the route in its default Route.Action and finds the routes declared with
	// Declare. Default: net/http's ServeMux pattern (Request.Pattern without its method and
	// host), else the URL path (DefaultRouteTemplate). With gorilla/mux pass
	// idemmux.RouteTemplate (package github.com/pgidem/pgidem/idem/idemmux); with another
	// router, a function that returns its template. "" falls back to the default.
	RouteTemplate func(r *http.Request) string
	// KeyHeader is the request header that carries the key. Default "Idempotency-Key"; a
	// header name (an RFC 9110 token).
	KeyHeader string
	// ReplayHeader is set to "true" on a replayed response. Default "Idempotent-Replayed"; a
	// header name.
	ReplayHeader string
	// CorrelationHeader names the request's correlation id, which problems carry and a replay
	// keeps from the current request. Default "X-Request-Id"; a header name.
	CorrelationHeader string
	// TTL is how long a key's answer stays replayable after it was given. Default 0: the SQL
	// API's default, 24 hours (read from the database, idem_defaults()). From a microsecond
	// to 10 years (MaxDuration, the SQL API's bound); sent with microsecond precision.
	TTL time.Duration
	// LockTimeout bounds the wait for a concurrent request with the same key, in this
	// process (in Go, without a connection) and on the database; past it the answer is 409
	// request_in_progress. Default 0: the SQL API's default, 2 seconds. From a millisecond to
	// MaxLockTimeout (PostgreSQL's largest lock_timeout, about 24 days).
	LockTimeout time.Duration
	// WorkTimeout bounds the unit of work of a keyed request on a transactional route, from
	// its claim to its commit. The work does not end when the client goes away (a disconnect,
	// the client's own attempt timeout, a proxy's): it runs to its end and commits with its
	// answer, which the client's retry gets (it waits for the work while it runs, and replays
	// it after); it ends at this server-side deadline, and when Shutdown gives up waiting for
	// it, and then rolls back. Default 0: DefaultWorkTimeout (30 seconds); Route.WorkTimeout
	// overrides it for one route. Not negative.
	WorkTimeout time.Duration
	// DuplicateWait bounds how long a duplicate of a request that is still running waits for
	// that request's answer before it gets 409 request_in_progress, on every route: on a
	// transactional route it waits on the key (in Go for a request of this process, or on the
	// key's row lock with a wait slot), on a lease route for the holder's answer, without a
	// connection (woken at once by a holder in this process, else by one look at the key every
	// DefaultAnswerPoll per key and process). The duplicate then answers as the first did, soon
	// after the answer is stored. Past the wait, its 409's Retry-After estimates the rest of
	// the work. Default 0: DefaultDuplicateWait (10 seconds). At most MaxDuplicateWait (10
	// minutes).
	DuplicateWait time.Duration
	// MaxWaitingClaims bounds how many requests may wait on a key's row lock (held by
	// another process) at once; a request that finds them all waiting gets 409 at once, so
	// requests for other keys always find a connection. It also bounds the statements lease
	// work runs outside its claim (extensions, the recording of answers, yields) at once, so
	// that a locked key table cannot make them hold the pool. Default 0: a quarter of DB's
	// MaxConns, at least 1. When set, at least 1 and smaller than DB's MaxConns.
	MaxWaitingClaims int
	// MaxWaitingBytes bounds what the duplicates waiting in this process for a request with
	// the same key hold at once: each counts its body plus 4 KiB. A duplicate that would pass
	// it gets 409 request_in_progress with Retry-After at once, so a storm of large
	// duplicates cannot grow the process's memory. Default 0: 16 times MaxBodyBytes, at least
	// 16 MiB. Not negative.
	MaxWaitingBytes int64
	// MaxBodyBytes is the largest request body read; a larger one gets 413 before any
	// fingerprint or database work. Default 0: 1 MiB. Not negative.
	MaxBodyBytes int64
	// MaxStoredBodyBytes is the largest response body stored for replay; a larger response
	// is sent once and stored without its body (a repeat gets 409 response_not_replayable).
	// Default 0: 256 KiB. Not negative.
	MaxStoredBodyBytes int
	// StoredHeaders is the allowlist of response headers stored and replayed (each a header
	// name). Default nil: Content-Type, Location, ETag, Content-Location, Last-Modified.
	StoredHeaders []string
	// FinalStatus tells which error statuses are final: rolled back, then stored and
	// replayed. Default nil: DefaultFinalStatus (400, 403, 404, 409, 410, 412, 413, 415,
	// 422).
	FinalStatus func(status int) bool
	// ProblemBase is the prefix of the problem type URIs; a problem's type is ProblemBase
	// followed by its code, which is also an anchor of docs/http.md. Default
	// "https://github.com/pgidem/pgidem/blob/main/docs/http.md#".
	ProblemBase string
	// MaxAttempts bounds the runs of a unit of work that fails with a serialization failure
	// (40001), a deadlock (40P01) or a lock timeout of its own statements. Default 0: 3. Not
	// negative.
	MaxAttempts int
	// Logger receives one line per keyed request that was not acquired or replayed, and
	// every failure to record or release a key (never a raw key or body: keys are logged as
	// a short hash). Default nil: slog.Default().
	Logger *slog.Logger
	// Metrics observes every keyed request. Default nil: none. The Prometheus adapter is
	// package github.com/pgidem/pgidem/idem/idemprom.
	Metrics Observer
	// TracerProvider, when set, traces every keyed request with OpenTelemetry: the spans
	// idem.claim, idem.handler and idem.complete under the request's span, with the action,
	// the key's hash and the outcome (docs/http.md, "Metrics, traces and logs"). Pass
	// otel.GetTracerProvider() for the global one. Default nil: no tracing work at all.
	TracerProvider trace.TracerProvider
}

// Route declares how one route takes part. The zero value is an optional-key, transactional
// route whose action is the request's method and route template.
type Route struct {
	// Action names what the route does, for example "POST /v1/transfers": a different
	// action under the same key is a mismatch (422). Default "": the method and the route
	// template (Options.RouteTemplate). At most 1000 characters.
	Action string
	// Required makes a request without the key a 400 idempotency_key_missing, when
	// Options.Principal names a principal for it: a request without one (anonymous, or
	// authenticated by a middleware that runs after this one) runs every time, key or not.
	// Default false: a request without a key runs every time (in a transaction).
	Required bool
	// Lease makes the route a lease claim for work outside the database (a payment
	// provider): the claim is committed on its own before the handler runs, the handler gets
	// no transaction, and the response is stored afterwards, fenced by the claim's token.
	// While the handler runs, the lease is extended every third of it; the handler's context
	// does not end when the client disconnects, and ends with cause ErrLeaseLost when the
	// lease is lost. Hand the provider ClaimOf(ctx).ProviderKey. TxFrom is nil in the
	// handler: write through your own pool, idempotently (TxFrom says how). Default 0: a
	// transactional claim, whose handler's writes commit with the key. From a second to 10
	// years. The example ExampleRoute_lease in idem/example_test.go (pkg.go.dev shows it
	// under Route) runs a lease route against a provider that counts its calls.
	Lease time.Duration
	// LeaseTimeout bounds a lease route's handler: its context ends then, and a handler that
	// gives up answers 5xx, which gives the lease up. Default 0: five minutes
	// (DefaultLeaseTimeout). Not negative.
	LeaseTimeout time.Duration
	// WorkTimeout bounds the unit of work of a keyed request on this transactional route
	// (Options.WorkTimeout, which it overrides). Default 0: Options.WorkTimeout. Not negative.
	WorkTimeout time.Duration
	// Fingerprint replaces the default fingerprint (method, path and canonical body,
	// ComputeFingerprint) for a route whose meaning is narrower than its body. Default nil.
	Fingerprint func(r *http.Request, body []byte) Fingerprint
}

// Middleware makes declared routes idempotent: build one with New, wrap each route with its
// Route method (any router), or declare routes with Declare and install Handler on a router
// that matches before it runs its middlewares (gorilla/mux's Use). Safe for concurrent use
// once built.
type Middleware struct {
	m        *idemhttp.Middleware
	o        Options
	declared map[string]Route
}

// New checks the options against their bounds, checks once that the database's schema idem
// is the version this package needs (CheckSchema: a database that is not migrated, or a role
// that may not call the SQL API, is an error that says how to fix it, not a 503 on every
// request), fills in the defaults and returns the middleware. ctx bounds the check.
func New(ctx context.Context, o Options) (*Middleware, error) {
	im, err := idemhttp.New(o.internal())
	if err != nil {
		return nil, err
	}
	if err := CheckSchema(ctx, o.DB); err != nil {
		return nil, err
	}
	io := im.Options()
	o.KeyHeader, o.ReplayHeader, o.CorrelationHeader = io.KeyHeader, io.ReplayHeader, io.CorrelationHeader
	o.MaxWaitingBytes, o.MaxBodyBytes, o.MaxStoredBodyBytes = io.MaxWaitingBytes, io.MaxBodyBytes, io.MaxStoredBodyBytes
	o.StoredHeaders, o.FinalStatus, o.ProblemBase, o.Logger = io.StoredHeaders, io.FinalStatus, io.ProblemBase, io.Logger
	o.WorkTimeout, o.DuplicateWait = io.WorkTimeout, io.DuplicateWait
	return &Middleware{m: im, o: o, declared: map[string]Route{}}, nil
}

func (o Options) internal() idemhttp.Options {
	io := idemhttp.Options{DB: o.DB, Principal: o.Principal, RouteTemplate: o.RouteTemplate, KeyHeader: o.KeyHeader,
		ReplayHeader: o.ReplayHeader, CorrelationHeader: o.CorrelationHeader, TTL: o.TTL, LockTimeout: o.LockTimeout,
		MaxWaitingClaims: o.MaxWaitingClaims, MaxWaitingBytes: o.MaxWaitingBytes, MaxBodyBytes: o.MaxBodyBytes,
		MaxStoredBodyBytes: o.MaxStoredBodyBytes, StoredHeaders: o.StoredHeaders, FinalStatus: o.FinalStatus,
		ProblemBase: o.ProblemBase, MaxAttempts: o.MaxAttempts, Logger: o.Logger, TracerProvider: o.TracerProvider,
		WorkTimeout: o.WorkTimeout, DuplicateWait: o.DuplicateWait}
	if o.Metrics != nil {
		io.Metrics = observer{o.Metrics}
	}
	return io
}

func (rt Route) internal() idemhttp.Route {
	ir := idemhttp.Route{Action: rt.Action, Required: rt.Required, Lease: rt.Lease, LeaseTimeout: rt.LeaseTimeout,
		WorkTimeout: rt.WorkTimeout}
	if f := rt.Fingerprint; f != nil {
		ir.Fingerprint = func(r *http.Request, body []byte) canon.Fingerprint { return canon.Fingerprint(f(r, body)) }
	}
	return ir
}

// Options returns the options in effect, defaults filled in (a zero TTL or LockTimeout stays
// zero: the SQL API's default applies; a zero MaxWaitingClaims stays zero: a quarter of the
// pool).
func (m *Middleware) Options() Options { return m.o }

// Route returns a middleware for one route with this declaration, for net/http's ServeMux,
// gorilla/mux or any router:
//
//	mux.Handle("POST /v1/transfers", m.Route(idem.Route{Required: true})(transfers))
//	r.Handle("/v1/transfers", m.Route(idem.Route{Required: true})(transfers)).Methods("POST")
//
// It panics on a declaration that cannot work (a lease under a second or over 10 years, an
// action over 1000 characters), as http.Handle does on a bad pattern.
func (m *Middleware) Route(rt Route) func(http.Handler) http.Handler {
	return m.m.Route(rt.internal())
}

// Declare declares the route with this method and path template for Handler. Not safe to
// call once requests are being served. It panics on a declaration that cannot work.
func (m *Middleware) Declare(method, pathTemplate string, rt Route) {
	m.m.Declare(method, pathTemplate, rt.internal())
	m.declared[strings.ToUpper(method)+" "+pathTemplate] = rt
}

// Declared returns the routes declared with Declare, by "METHOD template".
func (m *Middleware) Declared() map[string]Route {
	out := make(map[string]Route, len(m.declared))
	for k, v := range m.declared {
		out[k] = v
	}
	return out
}

// Handler is a router-wide middleware (gorilla/mux's r.Use(m.Handler)): requests to routes
// declared with Declare take part; all others pass through untouched, header or not. It
// needs a router that matches the route before it runs its middlewares, as gorilla/mux does
// (with Options.RouteTemplate set to idemmux.RouteTemplate); with net/http's ServeMux, which
// matches as it dispatches, wrap each route with Route.
func (m *Middleware) Handler(next http.Handler) http.Handler { return m.m.Handler(next) }

// Shutdown waits for the keyed requests still in flight, whose work runs on a context that
// outlives the client (so an HTTP server's own Shutdown, which does not wait for a handler whose
// client went away, does not end it): from those still claiming their key to those committing
// or recording their answers. Duplicates waiting for another request's answer stop waiting at
// once (409 request_in_progress; the client retries, against another process). When ctx ends
// first, it ends the work's contexts with cause ErrShutdown (a transactional unit of work rolls
// back and stores nothing; lease work gives its lease up, and the client's retry runs it again
// under the same provider key), waits up to five seconds more for them, and returns ctx's
// error. From the moment ctx ends, keyed work that starts is ended at once, also when Shutdown
// had returned early (nothing was in flight). Call it beside the HTTP server's Shutdown, with
// the same deadline, and wait for both before the process exits:
//
//	work := make(chan error, 1)
//	go func() { work <- m.Shutdown(ctx) }()
//	err := srv.Shutdown(ctx)
//	<-work
func (m *Middleware) Shutdown(ctx context.Context) error { return m.m.Shutdown(ctx) }

// GateStats are the figures of the duplicates a Middleware (or a Gate) holds back, for gauges
// and counters (package idemprom exports them).
type GateStats struct {
	// Waiting is how many requests wait, without a connection, for a request of this process
	// with the same key; WaitingBytes what they hold (their bodies plus 4 KiB each, bounded by
	// Options.MaxWaitingBytes).
	Waiting, WaitingBytes int64
	// LockWaits is how many claims wait on a key's row lock held by another process (bounded
	// by Options.MaxWaitingClaims).
	LockWaits int
	// Coalesced counts the requests that found their key in flight in this process and
	// waited; Refused those answered 409 without waiting on the database (their wait ran out,
	// the waiting duplicates held too much, or every wait slot was taken).
	Coalesced, Refused uint64
}

// GateStats reads the figures of the middleware's duplicates, now.
func (m *Middleware) GateStats() GateStats { return GateStats(m.m.GateStats()) }

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
	ProviderKey string
}

// ErrLeaseLost is the cause (context.Cause) of a lease route's handler context, and the error
// of DoLease, when the lease was lost: another attempt may hold the key, so the work should
// stop; its answer is not recorded.
var ErrLeaseLost = idemhttp.ErrLeaseLost

// ErrShutdown is the cause (context.Cause) of a keyed request's work context when the
// middleware's Shutdown gave up waiting for it: the handler should stop. On a transactional
// route the unit of work rolls back and nothing is stored; on a lease route, unless the handler
// answers with a 2xx or a final error, its lease ends at once without an answer, and the
// client's retry runs the work again under the same ClaimInfo.ProviderKey.
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
	// process looks at the key: once per key and process, however many duplicates wait on it.
	DefaultAnswerPoll = idemhttp.DefaultAnswerPoll
)

// TxFrom returns the transaction of the request's unit of work: the handler's writes through
// it commit together with the key, or not at all. Nil outside a declared transactional route,
// and nil on a lease route: there is no transaction there, the claim committed on its own
// before the handler ran. A lease handler writes through its own pool in a transaction of its
// own, and makes those writes idempotent themselves, because a takeover runs the handler
// again: key them by ClaimOf(ctx).ProviderKey with a unique constraint and insert with
// ON CONFLICT DO NOTHING. Do not call Commit or Rollback on the transaction TxFrom returns:
// answer, and the middleware ends it.
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
// and duplicate members, invalid UTF-8 and trailing data refused), decoding the canonical text
// that was fingerprinted, so that two requests with one fingerprint mean the same thing. On
// failure it writes 400 malformed_body or 415 unsupported_media_type (final answers, stored
// for a keyed request) and returns false.
func DecodeJSON(w http.ResponseWriter, r *http.Request, v any) bool {
	return idemhttp.DecodeJSON(w, r, v)
}

// MarkOneTimeSecret marks the response as a one-time secret (a token shown once): it is sent,
// stored without its body, and a repeat gets 409 one_time_secret.
func MarkOneTimeSecret(ctx context.Context) { idemhttp.MarkOneTimeSecret(ctx) }

// SetResourceID names what the request created; a repeat of a response whose body is not
// stored names it. Default: the body's top-level "id", else the Location header.
func SetResourceID(ctx context.Context, id string) { idemhttp.SetResourceID(ctx, id) }

// WriteProblem writes an application's own RFC 9457 problem in the middleware's shape:
// application/problem+json, nosniff, the status, and a type that is base followed by code.
func WriteProblem(w http.ResponseWriter, status int, base, code, title, detail, correlationID string) {
	idemhttp.WriteProblem(w, status, base, code, title, detail, correlationID)
}

// Refuse writes one of the middleware's problems (a Code constant) from a handler, with the
// options of the request's route: for a body that DecodeJSON accepted but the handler cannot
// take (a required member missing: CodeMalformedBody). Any other code is answered 500
// internal_error and logged; an application's own problems go through WriteProblem.
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

// Problem is an RFC 9457 problem details object, as the middleware writes them: decode an
// answer's body into it to read the code.
type Problem struct {
	// Type is a URI that identifies the problem and documents it (Options.ProblemBase + Code).
	Type string `json:"type"`
	// Title is a short, stable summary of the problem type.
	Title string `json:"title"`
	// Status is the HTTP status.
	Status int `json:"status"`
	// Detail explains this occurrence.
	Detail string `json:"detail,omitempty"`
	// Code is the stable machine-readable code (a Code constant; the anchor of Type).
	Code string `json:"code"`
	// CorrelationID is the request's correlation id, when it has one.
	CorrelationID string `json:"correlation_id,omitempty"`
	// ChangedFields names the top-level request fields that differ (idempotency_key_reuse):
	// empty when only the method, path or action changed; absent when unknown.
	ChangedFields *[]string `json:"changed_fields,omitempty"`
	// ResourceID is the id of what the first request created (response_not_replayable,
	// one_time_secret), when it is known.
	ResourceID string `json:"resource_id,omitempty"`
	// Header names the request header the problem is about (idempotency_key_missing,
	// idempotency_key_invalid).
	Header string `json:"header,omitempty"`
}

// Problem codes: the code member of the problems the middleware writes, and the anchors of
// their documentation in docs/http.md.
const (
	// CodeKeyMissing: 400, the route requires a key and the request has none.
	CodeKeyMissing = "idempotency_key_missing"
	// CodeKeyInvalid: 400, the key is not 1 to 255 visible ASCII characters, or sent twice.
	CodeKeyInvalid = "idempotency_key_invalid"
	// CodeKeyReuse: 422, the key was used for another request.
	CodeKeyReuse = "idempotency_key_reuse"
	// CodeInProgress: 409 with Retry-After, a request with the key is still running.
	CodeInProgress = "request_in_progress"
	// CodeOneTimeSecret: 409, the first answer was a one-time secret, sent once.
	CodeOneTimeSecret = "one_time_secret"
	// CodeNotReplayable: 409, the first answer was too large to store.
	CodeNotReplayable = "response_not_replayable"
	// CodeRequestTooLarge: 413, the body is over Options.MaxBodyBytes.
	CodeRequestTooLarge = "request_too_large"
	// CodeBodyUnreadable: 400, the body could not be read.
	CodeBodyUnreadable = "request_body_unreadable"
	// CodeMalformedBody: 400, the body is ambiguous, not strictly valid JSON, or not what the
	// route takes.
	CodeMalformedBody = "malformed_body"
	// CodeUnsupportedMedia: 415, the body's Content-Type is not JSON.
	CodeUnsupportedMedia = "unsupported_media_type"
	// CodePrincipalUnknown: 401, the application's principals table does not know the
	// principal.
	CodePrincipalUnknown = "principal_unknown"
	// CodeInternalError: 500, the handler failed (a panic); nothing was kept.
	CodeInternalError = "internal_error"
	// CodeMisconfigured: 500, the store refused the server's configuration (an action or a
	// principal too long, a role that may not call the API): final, retrying does not help.
	CodeMisconfigured = "idempotency_misconfigured"
	// CodeStoreUnavailable: 503 with Retry-After, the database failed; nothing was changed.
	CodeStoreUnavailable = "store_unavailable"
	// CodeOutcomeUnknown: 503 with Retry-After, the connection was lost while committing.
	CodeOutcomeUnknown = "outcome_unknown"
)

// Observer receives the events of keyed requests, for metrics (package idemprom adapts it to
// Prometheus). Implementations must be safe for concurrent use and must not block: the
// middleware calls them on the request's path, though never while it holds a transaction,
// a row lock or a connection.
type Observer interface {
	// Count counts one state of a keyed request of this action (a request may count
	// StateAcquired and then StateOversize).
	Count(action string, state State)
	// Done times a keyed request from the key check to its answer, by its main state.
	Done(state State, elapsed time.Duration)
	// LeaseExtended counts one extension of a lease route's lease (the heartbeat).
	LeaseExtended(action string)
	// LeaseEnded is called once the work of a lease route has ended and its answer is
	// recorded (or not): lost tells whether the lease was lost, worked is how long the
	// handler and the recording took. A failure to record or release the answer is logged at
	// error level, not counted as a state.
	LeaseEnded(action string, lost bool, worked time.Duration)
}

// observer adapts an Observer to the implementation's.
type observer struct{ o Observer }

func (a observer) Count(action string, s idemhttp.State)  { a.o.Count(action, State(s)) }
func (a observer) Done(s idemhttp.State, d time.Duration) { a.o.Done(State(s), d) }
func (a observer) LeaseExtended(action string)            { a.o.LeaseExtended(action) }
func (a observer) LeaseEnded(action string, lost bool, worked time.Duration) {
	a.o.LeaseEnded(action, lost, worked)
}

// State is what happened to a keyed request, as Observer counts it. The set of values is
// frozen: dashboards and alerts depend on it.
type State string

// The states of idempotency_requests_total.
const (
	// StateAcquired: the request claimed the key (counted once per fresh claim): the
	// denominator of the other rates.
	StateAcquired State = "acquired"
	// StateReplayed: a stored response was sent again (or 409 for a stored response whose
	// body is withheld).
	StateReplayed State = "replayed"
	// StateBusy: another request held the key: 409 request_in_progress.
	StateBusy State = "busy"
	// StateKeyReused: the key belongs to another request: 422 idempotency_key_reuse.
	StateKeyReused State = "key_reused"
	// StateStoreError: the database failed; the client got a 5xx.
	StateStoreError State = "store_error"
	// StateOversize: counted on top of StateAcquired for a response too large to store for
	// replay, so oversize ÷ acquired is the uncacheable rate.
	StateOversize State = "oversize"
)

// States lists every State, in a fixed order.
func States() []State {
	return []State{StateAcquired, StateReplayed, StateBusy, StateKeyReused, StateStoreError, StateOversize}
}

package idem

import (
	"context"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/trace"

	"github.com/pgidem/pgidem/internal/canon"
	"github.com/pgidem/pgidem/internal/dbidem"
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
	// Give it a connect timeout (connect_timeout in its connection string): a database that
	// stops answering while the pool opens a connection otherwise holds the request that asked
	// for it until the operating system gives up on the connect, minutes later.
	DB *pgxpool.Pool
	// Principal returns who sent the request, or false for an anonymous request (whose
	// Idempotency-Key is then ignored): your authentication, which must run before the
	// middleware. Required. Keys belong to a principal: 1 to 255 characters (longer is a
	// 500 idempotency_misconfigured). An application that references its own principals
	// table from idem.idempotency_keys gets 401 for a principal that is not there. It may
	// read the body (a form's access_token through r.FormValue), put it back (to check a
	// webhook's signature) or wrap it (http.MaxBytesReader): the body fingerprinted and given
	// to the handler is what the client sent, every byte read from the connection, whatever
	// reader it leaves in r.Body (a body past the limit of a MaxBytesReader it wrapped, or
	// one it closed, is then answered 400 request_body_unreadable: the body could not be read
	// whole; bound the size with Options.MaxBodyBytes instead, answered 413). A form that a
	// handler before the middleware parsed took the body with it, and a keyed request then
	// gets 500 idempotency_misconfigured.
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
	// header name, neither KeyHeader's nor CorrelationHeader's (a replay would overwrite the
	// header a client reads its key or its correlation id from).
	ReplayHeader string
	// CorrelationHeader names the request's correlation id, which problems carry and a replay
	// keeps from the current request. Default "X-Request-Id"; a header name, not KeyHeader's
	// (the correlation id is logged and sent as it is, which a key never is). The middleware
	// reads it and makes none: put a request-id middleware in front of it (the reference
	// server's gives every request one). Without the header, problems leave correlation_id
	// out and log lines carry request_id "".
	CorrelationHeader string
	// TTL is how long a key's answer stays replayable after it was given. Default 0: the SQL
	// API's default, 24 hours (read from the database, idem_defaults()). From a microsecond
	// to 10 years (MaxDuration, the SQL API's bound); sent with microsecond precision.
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
	// its claim (the waits before it do not count) to its commit; a unit run again after a
	// deadlock counts from its new claim. The work does not end when
	// the client goes away (a disconnect, the client's own attempt timeout, a proxy's): it runs
	// to its end and commits with its answer, which the client's retry gets (it waits for the
	// work while it runs, and replays it after); it ends at this server-side deadline, and
	// when Shutdown gives up waiting for it, and then rolls back (its context's cause is
	// context.DeadlineExceeded, or ErrShutdown; its Err is context.Canceled), and its client
	// gets 500 internal_error, or 503 shutting_down. The deadline ends the work's context:
	// a handler that ignores it (an outside call made without r.Context()) keeps its
	// transaction, its connection and the key's row lock until it returns, and its
	// duplicates wait for that. Default 0: DefaultWorkTimeout (30 seconds);
	// Route.WorkTimeout overrides it for one route. Not negative. A lease route is bounded by
	// Route.LeaseTimeout instead.
	WorkTimeout time.Duration
	// DuplicateWait bounds how long a duplicate of a request that is still running waits for
	// that request's answer before it gets 409 request_in_progress, on every route: on a
	// transactional route it waits on the key (in Go for a request of this process, or on the
	// key's row lock with a wait slot), on a lease route for the holder's answer, without a
	// connection (woken at once by a holder in this process, else by a look at the key every
	// DefaultAnswerPoll, one statement per round for all keys waited on). Its waits end when
	// its client goes away and when Shutdown starts. The duplicate then answers as the first
	// did, soon after the answer is stored. Duplicates of this process replay one after
	// another: one that saw the answer stored reads it even past its wait, unless a request
	// ahead of it claims the key afresh or finds it held by another process. Past the wait, its 409's Retry-After estimates the
	// rest of the work. Default 0: DefaultDuplicateWait (10 seconds). At most MaxDuplicateWait
	// (10 minutes).
	DuplicateWait time.Duration
	// MaxWaitingClaims bounds how many requests may wait on a key's row lock (held by another
	// process) at once; a request that finds them all waiting gets 409 at once, so requests for
	// other keys always find a connection. It also bounds the statements lease work runs
	// outside its claim (extensions, the recording of answers, yields, the duplicates' looks):
	// as many run at once, or half of DB's connections when that is more, so that a locked key
	// table cannot make them hold the pool, and a statement that waits on one key's row does
	// not hold up every other lease's extensions. Default 0: a quarter of DB's MaxConns, at
	// least 1. When set, at least 1 and smaller than DB's MaxConns. A pool of one connection
	// keeps none for other keys: while a claim waits on a key's row lock, every other request
	// waits for the connection, up to the lock timeout. The bound is this process's: behind
	// PgBouncer in transaction mode every process's waiting claims hold server connections of
	// the one PgBouncer pool (docs/operations.md sizes it for them).
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
	// name). Default nil: Content-Type, Location, ETag, Content-Location, Last-Modified. A
	// stored body's Content-Encoding (a handler behind a compressing middleware) is stored
	// with it whatever the list says: it is part of the body; so is a 206's or 416's
	// Content-Range. The fields of one connection, or of one response's framing or moment
	// (Connection, Keep-Alive, Proxy-Connection, Transfer-Encoding, TE, Trailer, Upgrade,
	// Proxy-Authenticate, Proxy-Authorization, Content-Length, Date), are refused: New
	// returns an error.
	StoredHeaders []string
	// FinalStatus tells which error statuses are final: rolled back, then stored and
	// replayed. Default nil: DefaultFinalStatus (400, 403, 404, 409, 410, 412, 413, 415,
	// 422). It is asked only of statuses up to 599 (the key table stores 100 to 599): a
	// status above is never final.
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
	// a short hash). Default nil: slog.Default(). A record whose handler panics is dropped: the
	// middleware logs from inside its recoveries, where nothing may stop an answer or the
	// release of a key.
	Logger *slog.Logger
	// Metrics observes every keyed request that reaches its claim (one refused before it, for
	// its key, its body or its size, or after Shutdown's deadline, is counted in no state).
	// Default nil: none. The Prometheus adapter is
	// package github.com/pgidem/pgidem/idem/idemprom. A panic of the Observer is recovered
	// (Observer).
	Metrics Observer
	// TracerProvider, when set, traces every keyed request with OpenTelemetry: the spans
	// idem.claim, idem.handler and idem.complete under the request's span, with the action,
	// the key's hash and the outcome (docs/http.md, "Metrics, traces and logs"). Pass
	// otel.GetTracerProvider() for the global one. Default nil: no tracing work at all. A
	// panic of the tracer or of a span is recovered (the first logged at error): it loses that
	// span or that call, never an answer.
	TracerProvider trace.TracerProvider
}

// Route declares how one route takes part. The zero value is an optional-key, transactional
// route whose action is the request's method and route template.
type Route struct {
	// Action names what the route does, for example "POST /v1/transfers": a different
	// action under the same key is a mismatch (422). Default "": the method and the route
	// template (Options.RouteTemplate), a method outside RFC 9110's nine (GET, HEAD, POST,
	// PUT, PATCH, DELETE, CONNECT, OPTIONS, TRACE) named OTHER, bytes that are not UTF-8
	// replaced by U+FFFD, cut to 1000 characters. At most 1000 characters. The action is a
	// metric label (idemprom): with the URL path as the template, every path is one.
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
	// does not end when the client of a keyed request disconnects, and ends with cause
	// ErrLeaseLost when the lease is lost. Hand the provider ClaimOf(ctx).ProviderKey. TxFrom is nil in the
	// handler: write in steps (Step), each committing its writes with its recovery point
	// (TxFrom says why). Default 0: a
	// transactional claim, whose handler's writes commit with the key. From a second to 10
	// years. The example ExampleRoute_lease in idem/example_test.go (pkg.go.dev shows it
	// under Route) runs a lease route against a provider that counts its calls.
	Lease time.Duration
	// LeaseTimeout bounds a lease route's handler: its context ends then, and a handler that
	// gives up answers 5xx, which gives the lease up; one that returns without writing once
	// its context ended gives it up too, and its client gets 500 internal_error (never an
	// empty 200). Before that, a handler that returns without writing answers what net/http
	// sends for it, an empty 200, which is stored and replayed like any answer (the middleware
	// cannot tell it from one), on every route. A request
	// without a key on the route is bounded the same way. Default 0: five minutes
	// (DefaultLeaseTimeout). Not negative. Route panics when it is set without Lease: a
	// transactional route is bounded by WorkTimeout.
	LeaseTimeout time.Duration
	// WorkTimeout bounds the unit of work of a keyed request on this transactional route
	// (Options.WorkTimeout, which it overrides). Default 0: Options.WorkTimeout. Not negative.
	// Route panics when it is set with Lease: a lease route is bounded by LeaseTimeout.
	WorkTimeout time.Duration
	// Fingerprint replaces the default fingerprint (method, path and canonical body,
	// RequestFingerprint) for a route whose meaning is narrower than its body: build it on
	// RequestFingerprint, or on ComputeFingerprint for a JSON body it rewrites (keeping every
	// number's digits). Default nil.
	// The body is still judged on its own, whatever the function hashed: one sent as JSON
	// that is not strictly valid JSON, or ambiguous (Fingerprint.Ambiguous), is refused with
	// 400 malformed_body before any claim, as with the default fingerprint; an Ambiguous set
	// by the function is refused too.
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
	if err := dbidem.CheckCall(ctx, o.DB, dbidem.BeginSignature); err != nil {
		return nil, err
	}
	io := im.Options()
	o.KeyHeader, o.ReplayHeader, o.CorrelationHeader = io.KeyHeader, io.ReplayHeader, io.CorrelationHeader
	o.MaxWaitingBytes, o.MaxBodyBytes, o.MaxStoredBodyBytes = io.MaxWaitingBytes, io.MaxBodyBytes, io.MaxStoredBodyBytes
	o.StoredHeaders, o.FinalStatus, o.ProblemBase, o.Logger = io.StoredHeaders, io.FinalStatus, io.ProblemBase, io.Logger
	o.WorkTimeout, o.DuplicateWait = io.WorkTimeout, io.DuplicateWait
	if o.MaxAttempts == 0 {
		o.MaxAttempts = dbidem.DefaultMaxAttempts
	}
	if o.RouteTemplate == nil {
		o.RouteTemplate = DefaultRouteTemplate
	}
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
		log := o.Logger
		if log == nil {
			log = slog.Default()
		}
		io.Metrics = observer{o: o.Metrics, firstPanic: firstPanic{what: "Observer", log: log, once: new(sync.Once)}}
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
// pool; a nil Metrics or TracerProvider stays nil: none).
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
// call once requests are being served. It panics on a declaration that cannot work: one that
// Route would refuse, a method that is not an HTTP token ("" or "POST /v1/orders"), a
// template that does not start with "/".
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
// matches as it dispatches, wrap each route with Route. Without a template from
// Options.RouteTemplate (unset, or returning "") or a ServeMux pattern, the template is the URL
// path, which a declared template with a {variable} never matches: such routes pass through
// unprotected, and Handler logs a warning once, at the first request whose path a declared
// template would match.
func (m *Middleware) Handler(next http.Handler) http.Handler { return m.m.Handler(next) }

// Shutdown waits for the keyed requests still in flight, whose work runs on a context that
// outlives the client (so an HTTP server's own Shutdown, which does not wait for a handler whose
// client went away, does not end it): from their arrival (a request carrying a key counts while
// Options.Principal runs, and while its body arrives once the principal authenticated it; every
// request to a lease route counts, with a key or without) to those committing or recording
// their answers. Duplicates waiting for another
// request's answer stop waiting at once (409 request_in_progress; the client retries, against
// another process), but for those behind a request that found the key answered, which read
// the answer (D270); requests with fresh keys are still served until ctx ends. When ctx ends
// first, it ends the work's contexts with cause ErrShutdown (a transactional unit of work rolls
// back and stores nothing; lease work that stops without an answer gives its lease up, and the
// client's retry runs it again under the same provider key; until it stops its lease is
// extended, so that no other process runs it meanwhile, D270), waits up to five seconds more
// for the work that began (a
// request still arriving then is refused as it would begin: it needs no grace), and returns
// ctx's error. From the moment ctx ends, a keyed request that comes is answered 503 shutting_down
// (CodeShuttingDown, with Retry-After) before any claim, also when Shutdown had returned early
// (nothing was in flight); one whose claim was under way (waiting for a connection, or for
// another holder of its key) is ended and answered so too: nothing was claimed. So is a request
// without a key to a lease route, before its handler runs, and a lease claim that committed
// just before the deadline: its work does not start, and its claim is given up. Call it beside
// the HTTP server's Shutdown, with the same deadline, and wait for both before the process
// exits:
//
//	work := make(chan error, 1)
//	go func() { work <- m.Shutdown(ctx) }()
//	err := srv.Shutdown(ctx)
//	<-work
func (m *Middleware) Shutdown(ctx context.Context) error { return m.m.Shutdown(ctx) }

// GateStats are the figures of the duplicates a Middleware (or a Gate) holds back, for gauges
// and counters (package idemprom exports them).
type GateStats struct {
	// Waiting is how many requests wait, without a connection, for a request with the same
	// key: of this process (in Go), or holding a lease (for its answer); WaitingBytes what they
	// hold (their bodies plus 4 KiB each, bounded by Options.MaxWaitingBytes, or a Gate's
	// GateOptions.MaxWaitingBytes).
	Waiting, WaitingBytes int64
	// LockWaits is how many claims wait on a key's row lock held by another process (bounded
	// by Options.MaxWaitingClaims, or a Gate's GateOptions.MaxWaitingClaims).
	LockWaits int
	// Coalesced counts the requests that found their key in flight in this process and
	// waited in line for it (not a lease route's duplicates, which wait on the lease's answer
	// and count in Waiting meanwhile); Refused those answered 409 without waiting on the
	// database (their wait ran out, the waiting duplicates held too much, or every wait slot was
	// taken; not the 409s of waits that Shutdown ended, nor a locked key table's 503s, which
	// a Gate's caller gets as ErrStoreBusy).
	Coalesced, Refused uint64
}

// GateStats reads the figures of the middleware's duplicates, now.
func (m *Middleware) GateStats() GateStats { return GateStats(m.m.GateStats()) }

// KeyHash is what the middleware's logs and traces (key_hash, idem.key_hash) and idemriver's
// errors show of a key: 12 hex digits of a SHA-256 of the principal and the key, never the
// key itself, which a client may have built from personal data. Compute it for a key a client
// names to find its lines: the key as the middleware takes it (a quoted header value without
// its quotes, as ClaimOf's Key says it).
func KeyHash(principal, key string) string { return idemhttp.KeyHash(principal, key) }

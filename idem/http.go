package idem

import (
	"context"
	"net/http"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"

	idemhttp "github.com/pgidem/pgidem/internal/http"
)

// The HTTP middleware. Its home is internal/http; these names are the same types and
// functions.

// Middleware makes declared routes idempotent: build one with New, wrap each route with its
// Route method (any router), or declare routes with Declare and install Handler on a router
// that matches before it runs its middlewares (gorilla/mux's Use).
type Middleware = idemhttp.Middleware

// Options configure a Middleware. Only DB and Principal are required; every other field
// documents its default.
type Options = idemhttp.Options

// Route declares how one route takes part: its action, whether the key is required, a lease
// for work outside the database, a fingerprint of its own. The zero value is an optional-key,
// transactional route.
type Route = idemhttp.Route

// ClaimInfo is what a handler knows about the key its request works under: the principal,
// the key, the fencing token and the key to give an outside provider.
type ClaimInfo = idemhttp.ClaimInfo

// Problem is an RFC 9457 problem details object, as the middleware writes them.
type Problem = idemhttp.Problem

// Observer receives the events of keyed requests, for metrics.
type Observer = idemhttp.Observer

// PrometheusObserver is the Observer that exports Prometheus metrics.
type PrometheusObserver = idemhttp.PrometheusObserver

// State is what happened to a keyed request, as the metrics count it.
type State = idemhttp.State

// The states of idempotency_requests_total, a frozen set.
const (
	StateAcquired   = idemhttp.StateAcquired
	StateReplayed   = idemhttp.StateReplayed
	StateBusy       = idemhttp.StateBusy
	StateKeyReused  = idemhttp.StateKeyReused
	StateStoreError = idemhttp.StateStoreError
	StateOversize   = idemhttp.StateOversize
)

// Problem codes: the code member of the problems the middleware writes, and the anchors of
// their documentation.
const (
	CodeKeyMissing       = idemhttp.CodeKeyMissing
	CodeKeyInvalid       = idemhttp.CodeKeyInvalid
	CodeKeyReuse         = idemhttp.CodeKeyReuse
	CodeInProgress       = idemhttp.CodeInProgress
	CodeOneTimeSecret    = idemhttp.CodeOneTimeSecret
	CodeNotReplayable    = idemhttp.CodeNotReplayable
	CodeRequestTooLarge  = idemhttp.CodeRequestTooLarge
	CodeBodyUnreadable   = idemhttp.CodeBodyUnreadable
	CodeMalformedBody    = idemhttp.CodeMalformedBody
	CodeUnsupportedMedia = idemhttp.CodeUnsupportedMedia
	CodePrincipalUnknown = idemhttp.CodePrincipalUnknown
	CodeInternalError    = idemhttp.CodeInternalError
	CodeMisconfigured    = idemhttp.CodeMisconfigured
	CodeStoreUnavailable = idemhttp.CodeStoreUnavailable
	CodeOutcomeUnknown   = idemhttp.CodeOutcomeUnknown
)

// ErrLeaseLost is the cause (context.Cause) of a lease route's handler context, and the error
// of DoLease, when the lease was lost: another attempt may hold the key, so the work should
// stop; its answer is not recorded.
var ErrLeaseLost = idemhttp.ErrLeaseLost

// New checks the options, fills in their defaults and returns the middleware.
func New(o Options) (*Middleware, error) { return idemhttp.New(o) }

// TxFrom returns the transaction of the request's unit of work: the handler's writes through
// it commit together with the key, or not at all. Nil outside a declared transactional route
// (a lease route has none).
func TxFrom(ctx context.Context) pgx.Tx { return idemhttp.Tx(ctx) }

// ClaimOf returns the claim the request works under, or false for a request without a key.
func ClaimOf(ctx context.Context) (ClaimInfo, bool) { return idemhttp.ClaimOf(ctx) }

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
// application/problem+json, the status, and a type that is base followed by code.
func WriteProblem(w http.ResponseWriter, status int, base, code, title, detail, correlationID string) {
	idemhttp.WriteProblem(w, status, base, code, title, detail, correlationID)
}

// Refuse writes one of the middleware's problems (a Code constant) from a handler, with the
// options of the request's route: for a body that DecodeJSON accepted but the handler cannot
// take (a required member missing: CodeMalformedBody).
func Refuse(w http.ResponseWriter, r *http.Request, code, detail string) {
	idemhttp.Refuse(w, r, code, detail)
}

// NewPrometheusObserver registers the middleware's metrics with reg
// (idempotency_requests_total, idempotency_request_duration_seconds and the lease metrics)
// and returns the observer to put in Options.Metrics.
func NewPrometheusObserver(reg prometheus.Registerer) *PrometheusObserver {
	return idemhttp.NewPrometheusObserver(reg)
}

// DefaultFinalStatus is the default of Options.FinalStatus: the error statuses that a retry
// of the same request would get again, stored and replayed (400, 403, 404, 409, 410, 412, 413,
// 415, 422).
func DefaultFinalStatus(status int) bool { return idemhttp.DefaultFinalStatus(status) }

// DefaultRouteTemplate is the route template the middleware uses when Options.RouteTemplate
// gives none: gorilla/mux's current route, net/http's ServeMux pattern (without its method),
// else the URL path.
func DefaultRouteTemplate(r *http.Request) string { return idemhttp.DefaultRouteTemplate(r) }

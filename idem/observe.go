package idem

// Problems, and what an Observer sees of keyed requests.

import (
	"fmt"
	"log/slog"
	"runtime/debug"
	"sync"
	"time"

	idemhttp "github.com/pgidem/pgidem/internal/http"
)

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
	// CodeBodyUnreadable: 400, the body could not be read: what arrived is not a body
	// (malformed chunked encoding).
	CodeBodyUnreadable = "request_body_unreadable"
	// CodeBodyIncomplete: 408, the body did not arrive whole (the connection ended before its
	// end, or the server's read timeout passed): nothing was done; a retry mends it.
	CodeBodyIncomplete = "request_body_incomplete"
	// CodeMalformedBody: 400, the body is ambiguous, not strictly valid JSON, or not what the
	// route takes.
	CodeMalformedBody = "malformed_body"
	// CodeUnsupportedMedia: 415, the body's Content-Type is not JSON.
	CodeUnsupportedMedia = "unsupported_media_type"
	// CodePrincipalUnknown: 401, the application's principals table does not know the
	// principal.
	CodePrincipalUnknown = "principal_unknown"
	// CodeInternalError: 500, the handler failed (a panic, an impossible status), its work
	// passed WorkTimeout or LeaseTimeout, or PostgreSQL refused its work; a transactional
	// route kept nothing. Counted acquired, not store_error.
	CodeInternalError = "internal_error"
	// CodeMisconfigured: 500, the store refused the server's configuration (an action or a
	// principal too long, a role that may not call the API): final, retrying does not help.
	CodeMisconfigured = "idempotency_misconfigured"
	// CodeStoreUnavailable: 503 with Retry-After, the database failed; nothing was changed.
	CodeStoreUnavailable = "store_unavailable"
	// CodeOutcomeUnknown: 503 with Retry-After, the connection was lost while committing.
	CodeOutcomeUnknown = "outcome_unknown"
	// CodeShuttingDown: 503 with Retry-After, a keyed request that came after Shutdown's
	// deadline (nothing was claimed or changed), or work in flight that the deadline ended
	// (rolled back, or its lease given up); the client's retry goes to another process.
	CodeShuttingDown = "shutting_down"
)

// Observer receives the events of keyed requests, for metrics (package idemprom adapts it to
// Prometheus); one that also implements LeaseObserver is told of each lease claim too.
// Implementations must be safe for concurrent use and must not block: the middleware calls them on the request's path, though never while it holds a transaction,
// a row lock or a connection. A panic of theirs is recovered (the first logged at error
// level), and the event is lost.
type Observer interface {
	// Count counts one state of a keyed request of this action (a request may count
	// StateAcquired and then StateOversize).
	Count(action string, state State)
	// Done times a keyed request from its body read (the client's upload not included) to its
	// answer, by its main state.
	Done(state State, elapsed time.Duration)
	// LeaseExtended counts one extension of a lease route's lease (the heartbeat).
	LeaseExtended(action string)
	// LeaseEnded is called once the work of a lease route has ended and its answer is
	// recorded (or not), or when the lease ran out before the work could start (lost, and the
	// request counted busy too, as it is for a lease lost while its work ran and told 409);
	// not for a claim given up at a shutdown before its work
	// started. lost tells whether the lease was lost, worked is how long the
	// handler and the recording took. An answer that could not be recorded (503
	// outcome_unknown) is counted store_error, on top of acquired; a lease that could not be
	// given up after a failed handler is logged at error level only (the client got the
	// handler's answer).
	LeaseEnded(action string, lost bool, worked time.Duration)
}

// LeaseObserver is an Observer that is also told of each lease claim of a lease route (a
// fresh claim or a takeover): it can then export its lease figures from a route's first lease
// on, so that the route's first lease lost is an increase from 0, not a series born at 1 that
// increase() reads as none (package idemprom's Observer is one). Optional: an Observer without
// it hears of leases at their extensions and their end.
type LeaseObserver interface {
	Observer
	// LeaseClaimed is called once per committed lease claim of a lease route, before its work
	// would start, also for a claim whose work never starts. Each is followed by one
	// LeaseEnded, except for a claim given up at a shutdown before its work started (no
	// LeaseEnded, as Observer says); a claim whose COMMIT's outcome is unknown is counted
	// acquired and given up without a LeaseClaimed.
	LeaseClaimed(action string)
}

var _ idemhttp.LeaseClaimObserver = observer{}

// observer adapts an Observer to the implementation's. A panic of the Observer is recovered
// (the first one logged at error level, with its stack): an Observer is called from the
// request's path and from a lease's heartbeat, where a panic would cut a client's answer or
// end the process.
type observer struct {
	o Observer
	firstPanic
}

func (a observer) Count(action string, s idemhttp.State) {
	defer a.recovered("Count")
	a.o.Count(action, State(s))
}

func (a observer) Done(s idemhttp.State, d time.Duration) {
	defer a.recovered("Done")
	a.o.Done(State(s), d)
}

func (a observer) LeaseExtended(action string) {
	defer a.recovered("LeaseExtended")
	a.o.LeaseExtended(action)
}

// LeaseClaimed tells a LeaseObserver of a lease claim; other Observers hear nothing.
func (a observer) LeaseClaimed(action string) {
	lo, ok := a.o.(LeaseObserver)
	if !ok {
		return
	}
	defer a.recovered("LeaseClaimed")
	lo.LeaseClaimed(action)
}

func (a observer) LeaseEnded(action string, lost bool, worked time.Duration) {
	defer a.recovered("LeaseEnded")
	a.o.LeaseEnded(action, lost, worked)
}

// firstPanic recovers a panic of an observer of the application's, and logs the first one at
// error level with its stack. Deferred directly: defer a.recovered("Count").
type firstPanic struct {
	what string // "Observer", "CleanupObserver"
	log  *slog.Logger
	once *sync.Once
}

func (f firstPanic) recovered(method string) {
	if v := recover(); v != nil {
		f.once.Do(func() {
			f.log.Error("idem: the "+f.what+" panicked; its panics are recovered, and only this first one is logged",
				"method", method, "panic", fmt.Sprint(v), "stack", string(debug.Stack()))
		})
	}
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
	// StateBusy: the request was told 409 request_in_progress: another request held the key
	// (or it would have been told so: a duplicate whose client left while it waited), or (on
	// top of acquired) its own lease ran out before its work started or was lost while it ran.
	StateBusy State = "busy"
	// StateKeyReused: the key belongs to another request: 422 idempotency_key_reuse.
	StateKeyReused State = "key_reused"
	// StateStoreError: the database failed; the client got a 5xx (the middleware's own
	// statements, or a transactional handler's 5xx after the database dropped its
	// transaction's connection).
	StateStoreError State = "store_error"
	// StateOversize: counted on top of StateAcquired for a response too large to store for
	// replay, so oversize ÷ acquired is the uncacheable rate.
	StateOversize State = "oversize"
)

// States lists every State, in a fixed order.
func States() []State {
	return []State{StateAcquired, StateReplayed, StateBusy, StateKeyReused, StateStoreError, StateOversize}
}

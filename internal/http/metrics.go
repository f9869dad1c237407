package idemhttp

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Outcome is what happened to one keyed request, as the Observer sees it.
type Outcome string

// The outcomes an Observer sees.
const (
	// OutcomeAcquired: the request claimed the key and its response was stored (a 2xx, or a
	// final error through idem_save_final).
	OutcomeAcquired Outcome = "acquired"
	// OutcomeReplayed: a stored response was sent again (or 409 for a withheld body).
	OutcomeReplayed Outcome = "replayed"
	// OutcomeInProgress: the key was held by a running request: 409 request_in_progress.
	OutcomeInProgress Outcome = "in_progress"
	// OutcomeMismatch: the key belongs to another request: 422 idempotency_key_reuse.
	OutcomeMismatch Outcome = "mismatch"
	// OutcomeNotStored: the handler's response was not final (401, 429, 5xx, a panic...):
	// rolled back, nothing stored.
	OutcomeNotStored Outcome = "not_stored"
	// OutcomeOversize: the response was larger than MaxStoredBodyBytes: sent, stored
	// without its body.
	OutcomeOversize Outcome = "oversize"
	// OutcomeStoreError: the database failed; the client got a 5xx and nothing was stored.
	OutcomeStoreError Outcome = "store_error"
)

// Observer receives every keyed request's outcome. Implementations must be safe for
// concurrent use.
type Observer interface {
	Observe(action string, outcome Outcome, elapsed time.Duration)
}

type nopObserver struct{}

func (nopObserver) Observe(string, Outcome, time.Duration) {}

// PrometheusObserver counts outcomes per action (idem_http_requests_total) and times them
// (idem_http_request_duration_seconds).
type PrometheusObserver struct {
	requests *prometheus.CounterVec
	duration *prometheus.HistogramVec
}

// NewPrometheusObserver registers the two metrics with reg and returns the observer.
func NewPrometheusObserver(reg prometheus.Registerer) *PrometheusObserver {
	o := &PrometheusObserver{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idem_http_requests_total",
			Help: "Requests with an idempotency key, by action and outcome.",
		}, []string{"action", "outcome"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "idem_http_request_duration_seconds",
			Help:    "Time from the key check to the response, by outcome.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 14),
		}, []string{"outcome"}),
	}
	reg.MustRegister(o.requests, o.duration)
	return o
}

// Observe implements Observer.
func (o *PrometheusObserver) Observe(action string, outcome Outcome, elapsed time.Duration) {
	o.requests.WithLabelValues(action, string(outcome)).Inc()
	o.duration.WithLabelValues(string(outcome)).Observe(elapsed.Seconds())
}

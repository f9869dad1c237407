package idemhttp

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/pgidem/pgidem/internal/dbidem"
)

// State is what happened to a keyed request, as metrics count it. The set of values is
// frozen (TestStatesAreFrozen): dashboards and alerts depend on it.
type State string

// The states of idempotency_requests_total.
const (
	// StateAcquired: the request claimed the key (counted once per fresh claim, when it is
	// made): the denominator of the other rates.
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
var States = []State{StateAcquired, StateReplayed, StateBusy, StateKeyReused, StateStoreError, StateOversize}

// stateOf is the one translation of the driver's outcomes into metric states.
func stateOfOutcome(o dbidem.Outcome) State {
	switch o {
	case dbidem.Claimed:
		return StateAcquired
	case dbidem.Replay:
		return StateReplayed
	case dbidem.Mismatch:
		return StateKeyReused
	}
	return StateBusy // dbidem.InProgress
}

// Observer receives the events of keyed requests. Implementations must be safe for
// concurrent use.
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
	// handler and the recording took.
	LeaseEnded(action string, lost bool, worked time.Duration)
}

type nopObserver struct{}

func (nopObserver) Count(string, State)                    {}
func (nopObserver) Done(State, time.Duration)              {}
func (nopObserver) LeaseExtended(string)                   {}
func (nopObserver) LeaseEnded(string, bool, time.Duration) {}

// PrometheusObserver counts states per action (idempotency_requests_total{action,state}),
// times requests (idempotency_request_duration_seconds{state}), and follows lease routes:
// idempotency_lease_extensions_total{action}, idempotency_leases_lost_total{action} and
// idempotency_lease_work_seconds{action}.
type PrometheusObserver struct {
	requests   *prometheus.CounterVec
	duration   *prometheus.HistogramVec
	extensions *prometheus.CounterVec
	lost       *prometheus.CounterVec
	work       *prometheus.HistogramVec
}

// NewPrometheusObserver registers the metrics with reg and returns the observer.
func NewPrometheusObserver(reg prometheus.Registerer) *PrometheusObserver {
	o := &PrometheusObserver{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idempotency_requests_total",
			Help: "Keyed requests by action and state (acquired, replayed, busy, key_reused, store_error; oversize on top of acquired).",
		}, []string{"action", "state"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "idempotency_request_duration_seconds",
			Help:    "Time from the key check to the answer of keyed requests, by state.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 14),
		}, []string{"state"}),
		extensions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idempotency_lease_extensions_total",
			Help: "Extensions of the leases of lease routes (a heartbeat every third of the lease while the work runs).",
		}, []string{"action"}),
		lost: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idempotency_leases_lost_total",
			Help: "Lease routes' work whose lease was lost (taken over, or not extended in time): its answer was not recorded.",
		}, []string{"action"}),
		work: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "idempotency_lease_work_seconds",
			Help:    "How long the work of lease routes ran, its answer recorded.",
			Buckets: prometheus.ExponentialBuckets(0.01, 2, 16),
		}, []string{"action"}),
	}
	reg.MustRegister(o.requests, o.duration, o.extensions, o.lost, o.work)
	return o
}

// LeaseExtended implements Observer.
func (o *PrometheusObserver) LeaseExtended(action string) { o.extensions.WithLabelValues(action).Inc() }

// LeaseEnded implements Observer.
func (o *PrometheusObserver) LeaseEnded(action string, lost bool, worked time.Duration) {
	c := o.lost.WithLabelValues(action) // exported from the first lease on, at 0 until one is lost
	if lost {
		c.Inc()
	}
	o.work.WithLabelValues(action).Observe(worked.Seconds())
}

// Count implements Observer.
func (o *PrometheusObserver) Count(action string, state State) {
	o.requests.WithLabelValues(action, string(state)).Inc()
}

// Done implements Observer.
func (o *PrometheusObserver) Done(state State, elapsed time.Duration) {
	o.duration.WithLabelValues(string(state)).Observe(elapsed.Seconds())
}

// RegisterGateMetrics registers the metrics of the middleware's Gate with reg:
// idempotency_waiting_duplicates and idempotency_waiting_duplicate_bytes (gauges),
// idempotency_coalesced_total and idempotency_refused_total (counters).
func (m *Middleware) RegisterGateMetrics(reg prometheus.Registerer) {
	g := m.gate
	reg.MustRegister(
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "idempotency_waiting_duplicates",
			Help: "Requests waiting, without a database connection, for a request of this process with the same key."},
			func() float64 { return float64(g.Waiting()) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "idempotency_waiting_duplicate_bytes",
			Help: "What the waiting duplicates hold (their bodies plus 4 KiB each), bounded by MaxWaitingBytes."},
			func() float64 { return float64(g.WaitingBytes()) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "idempotency_coalesced_total",
			Help: "Requests that found their key in flight in this process and waited for it."},
			func() float64 { return float64(g.Coalesced()) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "idempotency_refused_total",
			Help: "Requests answered 409 without waiting on the database: their wait ran out, the waiting duplicates held too much, or every wait slot was taken."},
			func() float64 { return float64(g.Refused()) }),
	)
}

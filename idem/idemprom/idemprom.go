// Package idemprom exports the metrics of package idem to Prometheus, so that package idem
// itself does not import the Prometheus client:
//
//	reg := prometheus.NewRegistry()
//	m, err := idem.New(ctx, idem.Options{DB: pool, Principal: userOf, Metrics: idemprom.NewObserver(reg)})
//	...
//	idemprom.RegisterGate(reg, m)
//	cleaner, err := idem.StartCleaner(ctx, pool, idem.CleanerOptions{Metrics: idemprom.NewCleanupObserver(reg)})
//	reg.MustRegister(idemprom.NewHealthCollector(pool, 15*time.Second, nil))
//
// The names, labels and help texts are those docs/operations.md ("Metrics") lists and its
// alerts and dashboard use.
package idemprom

import (
	"context"
	"log/slog"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/pgidem/pgidem/idem"
)

// Observer is the idem.Observer that counts keyed requests per action and state
// (idempotency_requests_total{action,state}), times them (idempotency_request_duration_seconds
// {state}), and follows lease routes: idempotency_lease_extensions_total{action},
// idempotency_leases_lost_total{action} and idempotency_lease_work_seconds{action}. It never
// blocks.
//
// The action label takes at most MaxActions values besides "other": the routes' actions are a
// bounded set, but a route whose action comes from the URL path (a router whose template the
// middleware is not given) makes one per path; past MaxActions distinct actions, the others
// are counted under action "other". An action that is not valid UTF-8 is counted with its bytes replaced.
//
// An action's idempotency_requests_total series start together, every state at 0, when its
// first request is counted, and idempotency_request_duration_seconds has every state from
// NewObserver on: the first store_error of an action is an increase that rate() sees, not a
// new series it cannot. So do a lease route's idempotency_lease_extensions_total and
// idempotency_leases_lost_total, at 0 from its first lease claim (LeaseClaimed).
type Observer struct {
	requests   *prometheus.CounterVec
	duration   *prometheus.HistogramVec
	extensions *prometheus.CounterVec
	lost       *prometheus.CounterVec
	work       *prometheus.HistogramVec

	mu      sync.RWMutex
	actions map[string]string // the label of each action seen, at most MaxActions
	started map[string]bool   // the labels whose every requests series exists
}

// MaxActions is the most distinct actions an Observer exports as values of the action label;
// past it, new actions are counted under "other", one more value.
const MaxActions = 500

// label is the action label of action.
func (o *Observer) label(action string) string {
	o.mu.RLock()
	l, ok := o.actions[action]
	o.mu.RUnlock()
	if ok {
		return l
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	if l, ok := o.actions[action]; ok {
		return l
	}
	if len(o.actions) >= MaxActions {
		l = "other"
	} else {
		l = strings.ToValidUTF8(action, "\uFFFD")
		o.actions[action] = l
	}
	if !o.started[l] {
		o.started[l] = true
		for _, s := range idem.States() {
			o.requests.WithLabelValues(l, string(s)) // every state's series at 0
		}
	}
	return l
}

var _ idem.LeaseObserver = (*Observer)(nil)

// NewObserver registers the middleware's metrics with reg and returns the observer to put in
// idem.Options.Metrics. It panics when reg already has them (prometheus.MustRegister).
func NewObserver(reg prometheus.Registerer) *Observer {
	o := &Observer{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idempotency_requests_total",
			Help: "Keyed requests by action and state (acquired, replayed, busy, key_reused, store_error; oversize on top of acquired; busy on top of acquired for a lease claim told 409).",
		}, []string{"action", "state"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "idempotency_request_duration_seconds",
			Help:    "Time from a keyed request's body read to its answer, by state (the upload not included).",
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
			Help:    "How long the work of lease routes ran to its answer, recorded or given up (a lost lease's work is not timed).",
			Buckets: prometheus.ExponentialBuckets(0.01, 2, 16),
		}, []string{"action"}),
		actions: map[string]string{},
		started: map[string]bool{},
	}
	for _, s := range idem.States() {
		o.duration.WithLabelValues(string(s)) // every state's series from the start
	}
	reg.MustRegister(o.requests, o.duration, o.extensions, o.lost, o.work)
	return o
}

// Count implements idem.Observer.
func (o *Observer) Count(action string, state idem.State) {
	o.requests.WithLabelValues(o.label(action), string(state)).Inc()
}

// Done implements idem.Observer.
func (o *Observer) Done(state idem.State, elapsed time.Duration) {
	o.duration.WithLabelValues(string(state)).Observe(elapsed.Seconds())
}

// LeaseExtended implements idem.Observer.
func (o *Observer) LeaseExtended(action string) {
	o.extensions.WithLabelValues(o.label(action)).Inc()
}

// LeaseClaimed implements idem.LeaseObserver: a lease route's lease counters are exported at
// 0 from its first lease claim on, so that its first lost lease is an increase that increase()
// and rate() see, not a series born at 1.
func (o *Observer) LeaseClaimed(action string) {
	l := o.label(action)
	o.extensions.WithLabelValues(l)
	o.lost.WithLabelValues(l)
}

// LeaseEnded implements idem.Observer.
func (o *Observer) LeaseEnded(action string, lost bool, worked time.Duration) {
	action = o.label(action)
	c := o.lost.WithLabelValues(action) // exported at 0 from the route's first lease claim on
	if lost {
		c.Inc()
		return // counted lost, not timed
	}
	o.work.WithLabelValues(action).Observe(worked.Seconds())
}

// RegisterGate registers the figures of m's duplicates with reg, read at scrape time:
// idempotency_waiting_duplicates and idempotency_waiting_duplicate_bytes (gauges),
// idempotency_coalesced_total and idempotency_refused_total (counters). The names carry no
// label that tells two middlewares apart, so it panics when reg has them already (a second
// middleware, on another database): register each with its own constant label,
// RegisterGate(prometheus.WrapRegistererWith(prometheus.Labels{"db": "orders"}, reg), m),
// every one of them (Prometheus refuses one name with and without a label).
func RegisterGate(reg prometheus.Registerer, m *idem.Middleware) {
	reg.MustRegister(
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "idempotency_waiting_duplicates",
			Help: "Requests waiting, without a database connection, for a request of this process with the same key."},
			func() float64 { return float64(m.GateStats().Waiting) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "idempotency_waiting_duplicate_bytes",
			Help: "What the waiting duplicates hold (their bodies plus 4 KiB each), bounded by MaxWaitingBytes."},
			func() float64 { return float64(m.GateStats().WaitingBytes) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "idempotency_coalesced_total",
			Help: "Requests that found their key in flight in this process and waited in line for it (not a lease route's duplicates, which wait on the lease's answer)."},
			func() float64 { return float64(m.GateStats().Coalesced) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "idempotency_refused_total",
			Help: "Requests answered 409 without waiting on the database: their wait ran out, the waiting duplicates held too much, or every wait slot was taken."},
			func() float64 { return float64(m.GateStats().Refused) }),
	)
}

// CleanupObserver is the idem.CleanupObserver of a Cleaner: idem_cleanup_deleted_total,
// idem_cleanup_passes_total{result} (every result exported from the start, at 0),
// idem_cleanup_pass_duration_seconds (passes that ran) and idem_cleanup_vacuums_total.
type CleanupObserver struct {
	deleted  prometheus.Counter
	passes   *prometheus.CounterVec
	duration prometheus.Histogram
	vacuums  prometheus.Counter
}

var _ idem.CleanupObserver = (*CleanupObserver)(nil)

// NewCleanupObserver registers the cleaner's metrics with reg and returns the observer to put
// in idem.CleanerOptions.Metrics. It panics when reg already has them: share one observer
// between cleaners, or give each cleaner (one per database) reg wrapped with a constant label
// of its own (prometheus.WrapRegistererWith), all of them, since Prometheus refuses one name
// with and without a label.
func NewCleanupObserver(reg prometheus.Registerer) *CleanupObserver {
	c := &CleanupObserver{
		deleted: prometheus.NewCounter(prometheus.CounterOpts{Name: "idem_cleanup_deleted_total",
			Help: "Expired idempotency keys deleted by this process."}),
		passes: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "idem_cleanup_passes_total",
			Help: "Cleanup passes by result: done, skipped (another process held the lock or another pass the lease), failed, stopped (by shutdown)."}, []string{"result"}),
		duration: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "idem_cleanup_pass_duration_seconds",
			Help: "Duration of the cleanup passes this process ran, the pauses between batches included.", Buckets: prometheus.ExponentialBuckets(0.001, 4, 10)}),
		vacuums: prometheus.NewCounter(prometheus.CounterOpts{Name: "idem_cleanup_vacuums_total",
			Help: "VACUUMs of the key table this process ran after a cleanup pass."}),
	}
	// Every result is exported from the start, at 0: a series that first appears at 1 (the
	// first failed pass) would never show an increase(), and its alert would not fire.
	for _, result := range idem.PassResults() {
		c.passes.WithLabelValues(string(result))
	}
	reg.MustRegister(c.deleted, c.passes, c.duration, c.vacuums)
	return c
}

// PassEnded implements idem.CleanupObserver.
func (c *CleanupObserver) PassEnded(result idem.PassResult, deleted int, took time.Duration) {
	c.deleted.Add(float64(deleted))
	c.passes.WithLabelValues(string(result)).Inc()
	if result != idem.PassSkipped {
		c.duration.Observe(took.Seconds())
	}
}

// Vacuumed implements idem.CleanupObserver.
func (c *CleanupObserver) Vacuumed() { c.vacuums.Inc() }

// HealthCollector exports idem.ReadHealth as gauges, read at scrape time at most every
// interval (a scrape in between gets the figures of the last read), so an alert can fire when
// cleanup falls behind or a claim is stuck: idempotency_keys_in_progress,
// idempotency_leases_run_out, idempotency_oldest_in_progress_seconds,
// idempotency_cleanup_backlog, idempotency_key_table_bytes, idempotency_keys_estimated. A
// failed read exports nothing (the gauges go absent) and is logged, once until a read
// succeeds again (which is logged too).
type HealthCollector struct {
	db       idem.Querier
	interval time.Duration
	log      *slog.Logger

	mu     sync.Mutex
	read   time.Time
	health idem.Health
	ok     bool
	failed bool // a read failed and was logged; the next success is logged

	inProgress, runOut, oldest, backlog, bytes, estimated *prometheus.Desc
}

var _ prometheus.Collector = (*HealthCollector)(nil)

// NewHealthCollector returns the collector of db's key figures (register it with
// reg.MustRegister), read at most every interval (0: 15 seconds); log receives the first failed
// read of each outage and the read that ends it (nil: slog.Default()).
func NewHealthCollector(db idem.Querier, interval time.Duration, log *slog.Logger) *HealthCollector {
	if interval <= 0 {
		interval = 15 * time.Second
	}
	if log == nil {
		log = slog.Default()
	}
	d := func(name, help string) *prometheus.Desc { return prometheus.NewDesc(name, help, nil, nil) }
	return &HealthCollector{db: db, interval: interval, log: log,
		inProgress: d("idempotency_keys_in_progress", "Lease claims in progress (idem_health)."),
		runOut:     d("idempotency_leases_run_out", "Claims in progress whose lease ran out: their work is dead, or a retry will take them over."),
		oldest:     d("idempotency_oldest_in_progress_seconds", "Age of the oldest claim in progress (0 when none)."),
		backlog:    d("idempotency_cleanup_backlog", "Expired keys that cleanup has not deleted yet (counted up to a million)."),
		bytes:      d("idempotency_key_table_bytes", "Size of the key table, indexes and TOAST included."),
		estimated:  d("idempotency_keys_estimated", "Keys in the table, as the planner estimates them."),
	}
}

// healthReadTimeout bounds a read of the key gauges: idem_health's lock timeout (2 s) and a
// second for the round trip.
const healthReadTimeout = 3 * time.Second

// Describe implements prometheus.Collector.
func (g *HealthCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{g.inProgress, g.runOut, g.oldest, g.backlog, g.bytes, g.estimated} {
		ch <- d
	}
}

// Collect implements prometheus.Collector: the last figures, read again when they are older
// than the interval.
func (g *HealthCollector) Collect(ch chan<- prometheus.Metric) {
	g.mu.Lock()
	if time.Since(g.read) >= g.interval {
		// longer than idem_health's own lock timeout (2 s), so that a locked key table is
		// told as such (ErrStoreBusy), not as this context's end
		ctx, cancel := context.WithTimeout(context.Background(), healthReadTimeout)
		h, err := idem.ReadHealth(ctx, g.db)
		cancel()
		g.read, g.ok = time.Now(), err == nil
		switch {
		case err == nil:
			g.health = h
			if g.failed {
				g.failed = false
				g.log.Info("the key gauges read idem.idem_health() again")
			}
		case !g.failed:
			g.failed = true
			g.log.Warn("the key gauges could not read idem.idem_health()", "error", err)
		}
	}
	h, ok := g.health, g.ok
	g.mu.Unlock()
	if !ok {
		return
	}
	for _, m := range []struct {
		d *prometheus.Desc
		v float64
	}{{g.inProgress, float64(h.InProgress)}, {g.runOut, float64(h.LeasesRunOut)}, {g.oldest, h.OldestAge.Seconds()},
		{g.backlog, float64(h.CleanupBacklog)}, {g.bytes, float64(h.TableBytes)}, {g.estimated, float64(h.EstimatedKeys)}} {
		ch <- prometheus.MustNewConstMetric(m.d, prometheus.GaugeValue, m.v)
	}
}

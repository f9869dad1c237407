package main

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/go-co-op/gocron/v2"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/pgidem/pgidem/internal/dbidem"
)

// cleanupLockID is the advisory lock that makes one cleanup pass run at a time across all
// server processes on a database ("idem" in ASCII, then "clean").
const cleanupLockID int64 = 0x6964656d636c6e

// cleaner deletes expired idempotency keys in batches.
type cleaner struct {
	pool      *pgxpool.Pool
	batchSize int
	log       *slog.Logger
	deleted   prometheus.Counter
	passes    *prometheus.CounterVec
	duration  prometheus.Histogram
}

func newCleaner(pool *pgxpool.Pool, batchSize int, reg prometheus.Registerer, log *slog.Logger) *cleaner {
	c := &cleaner{pool: pool, batchSize: batchSize, log: log,
		deleted: prometheus.NewCounter(prometheus.CounterOpts{Name: "idem_cleanup_deleted_total",
			Help: "Expired idempotency keys deleted by this process."}),
		passes: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "idem_cleanup_passes_total",
			Help: "Cleanup passes by result: done, skipped (another process held the lock), failed."}, []string{"result"}),
		duration: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "idem_cleanup_pass_duration_seconds",
			Help: "Duration of the cleanup passes this process ran.", Buckets: prometheus.ExponentialBuckets(0.001, 4, 10)}),
	}
	if reg != nil {
		reg.MustRegister(c.deleted, c.passes, c.duration)
	}
	return c
}

// pass runs one full cleanup pass unless another process is running one: it holds a
// transaction-scoped advisory lock (so it also works behind PgBouncer in transaction mode)
// on one connection while the batches run, each in its own transaction, on others. It
// returns how many keys it deleted and whether it ran.
func (c *cleaner) pass(ctx context.Context) (int, bool, error) {
	start := time.Now()
	lock, err := c.pool.Begin(ctx)
	if err != nil {
		c.passes.WithLabelValues("failed").Inc()
		return 0, false, err
	}
	defer lock.Rollback(context.WithoutCancel(ctx))
	var mine bool
	if err := lock.QueryRow(ctx, `SELECT pg_try_advisory_xact_lock($1)`, cleanupLockID).Scan(&mine); err != nil {
		c.passes.WithLabelValues("failed").Inc()
		return 0, false, err
	}
	if !mine {
		c.passes.WithLabelValues("skipped").Inc()
		return 0, false, nil
	}
	n, err := dbidem.Cleanup(ctx, c.pool, c.batchSize)
	c.deleted.Add(float64(n))
	c.duration.Observe(time.Since(start).Seconds())
	if err != nil {
		c.passes.WithLabelValues("failed").Inc()
		return n, true, err
	}
	c.passes.WithLabelValues("done").Inc()
	return n, true, nil
}

// schedule runs a pass every interval (never two at once in this process) until the
// returned stop is called or ctx ends; stop cancels a running pass and waits for it.
func (c *cleaner) schedule(ctx context.Context, interval time.Duration) (stop func(), err error) {
	s, err := gocron.NewScheduler()
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(ctx)
	_, err = s.NewJob(gocron.DurationJob(interval),
		gocron.NewTask(func(ctx context.Context) {
			n, ran, err := c.pass(ctx)
			switch {
			case err != nil && ctx.Err() == nil:
				c.log.Error("cleanup pass failed", "error", err, "deleted", n)
			case ran && n > 0:
				c.log.Info("cleanup pass", "deleted", n)
			case ran:
				c.log.Debug("cleanup pass", "deleted", n)
			}
		}),
		gocron.WithSingletonMode(gocron.LimitModeReschedule),
		gocron.WithContext(ctx))
	if err != nil {
		cancel()
		return nil, err
	}
	s.Start()
	var once sync.Once
	return func() {
		once.Do(func() {
			cancel()
			_ = s.Shutdown()
		})
	}, nil
}

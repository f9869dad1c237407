package main

import (
	"context"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-co-op/gocron/v2"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/pgidem/pgidem/internal/dbidem"
)

// cleanupLockID is the advisory lock that makes one cleanup batch run at a time across all
// server processes on a database ("idem" in ASCII, then "clean").
const cleanupLockID int64 = 0x6964656d636c6e

// cleaner deletes expired idempotency keys in batches, and vacuums the key table once its
// passes have deleted more rows than autovacuum's threshold for the table (when its role
// may: on PostgreSQL 15 only the table's owner can).
type cleaner struct {
	pool      *pgxpool.Pool
	batchSize int
	duty      float64 // the share of the time its batches may take (1: no pause between them)
	vacuum    bool
	log       *slog.Logger
	deleted   prometheus.Counter
	passes    *prometheus.CounterVec
	duration  prometheus.Histogram
	vacuums   prometheus.Counter

	unvacuumed    atomic.Int64 // rows this process deleted since its last vacuum
	vacuumRefused sync.Once
}

func newCleaner(pool *pgxpool.Pool, batchSize int, vacuum bool, reg prometheus.Registerer, log *slog.Logger) *cleaner {
	c := &cleaner{pool: pool, batchSize: batchSize, duty: 1, vacuum: vacuum, log: log,
		deleted: prometheus.NewCounter(prometheus.CounterOpts{Name: "idem_cleanup_deleted_total",
			Help: "Expired idempotency keys deleted by this process."}),
		passes: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "idem_cleanup_passes_total",
			Help: "Cleanup passes by result: done, skipped (another process held the lock), failed, stopped (by shutdown)."}, []string{"result"}),
		duration: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "idem_cleanup_pass_duration_seconds",
			Help: "Duration of the cleanup passes this process ran, the pauses between batches included.", Buckets: prometheus.ExponentialBuckets(0.001, 4, 10)}),
		vacuums: prometheus.NewCounter(prometheus.CounterOpts{Name: "idem_cleanup_vacuums_total",
			Help: "VACUUMs of the key table this process ran after a cleanup pass."}),
	}
	// Every result is exported from the start, at 0: a series that first appears at 1 (the
	// first failed pass) would never show an increase(), and its alert would not fire.
	for _, result := range []string{"done", "skipped", "failed", "stopped"} {
		c.passes.WithLabelValues(result)
	}
	if reg != nil {
		reg.MustRegister(c.deleted, c.passes, c.duration, c.vacuums)
	}
	return c
}

// batchSQL is one cleanup batch as one statement, in a transaction of its own: under the
// cleanup lock (transaction-scoped, so it also works behind PgBouncer in transaction mode),
// idem_cleanup deletes up to $2 expired keys and returns how many; NULL when a batch of
// another process holds the lock.
const batchSQL = `SELECT CASE WHEN pg_try_advisory_xact_lock($1) THEN idem.idem_cleanup($2) END`

// workersSQL is, under the cleanup lock, one pass of idem_cleanup_workers: locked tells
// whether this transaction took the lock (the pass runs only then), and the array is
// {deleted, done (0 or 1)}, or NULL where the database has no workers to ask (plain
// PostgreSQL, a Citus worker) or the lock was not taken.
const workersSQL = `SELECT l.locked, CASE WHEN l.locked THEN (SELECT ARRAY[w.deleted, w.done::integer]
	  FROM idem.idem_cleanup_workers(p_batch_size => $1::integer, p_duty => $2::float8, p_max_time => $3::interval) AS w) END
	  FROM (SELECT pg_try_advisory_xact_lock($4) AS locked OFFSET 0) AS l`

// pass deletes expired keys, batch by batch, until a batch comes back short, and returns how
// many it deleted and whether it ran. Each batch takes the cleanup lock for its own
// transaction: a pass whose first batch finds another process's batch running is skipped,
// and a pass that finds one later stops there (the other process goes on), so one process
// cleans at a time. The pass holds at most one connection, and only while a statement runs:
// with a pool of two the API always has one, and behind PgBouncer a pool of one suffices.
//
// On a Citus coordinator the pass is passes of idem_cleanup_workers instead, each under the
// lock: every worker cleans its own shards, paced to the cleaner's duty there, for up to
// dbidem.CleanupWorkersTime, in parallel, until every node is drained. The coordinator then
// pays one round of new connections to the workers per CleanupWorkersTime, not per batch.
func (c *cleaner) pass(ctx context.Context) (int, bool, error) {
	start := time.Now()
	batch := c.batchSize
	if batch <= 0 {
		d, err := dbidem.ReadDefaults(ctx, c.pool)
		if err != nil {
			c.passes.WithLabelValues(failure(ctx)).Inc()
			return 0, false, err
		}
		batch = d.BatchSize
	}
	total, ran, workers, err := c.workersPass(ctx, batch)
	if err != nil {
		c.deleted.Add(float64(total))
		c.passes.WithLabelValues(failure(ctx)).Inc()
		return total, true, err
	}
	if !ran {
		c.passes.WithLabelValues("skipped").Inc()
		return 0, false, nil
	}
	if workers {
		return c.finish(ctx, start, total, true)
	}
	for {
		var n *int
		began := time.Now()
		if err := c.pool.QueryRow(ctx, batchSQL, cleanupLockID, batch).Scan(&n); err != nil {
			c.deleted.Add(float64(total))
			c.passes.WithLabelValues(failure(ctx)).Inc()
			return total, true, err
		}
		if n == nil {
			if total == 0 {
				c.passes.WithLabelValues("skipped").Inc()
				return 0, false, nil
			}
			break // another process's batch took over
		}
		total += *n
		if *n < batch {
			break
		}
		if err := dbidem.Pace(ctx, c.duty, time.Since(began)); err != nil {
			c.deleted.Add(float64(total))
			c.passes.WithLabelValues(failure(ctx)).Inc()
			return total, true, err
		}
	}
	return c.finish(ctx, start, total, false)
}

// workersPass runs passes of idem_cleanup_workers under the cleanup lock until every node is
// drained. It returns how many keys they deleted, whether the pass ran (false: another
// process held the lock at the first), and whether the database has workers at all (false:
// clean batch by batch here). A pass that finds the lock taken later stops there.
func (c *cleaner) workersPass(ctx context.Context, batch int) (total int, ran, workers bool, err error) {
	for {
		var locked bool
		var r []int64
		if err := c.pool.QueryRow(ctx, workersSQL, batch, dbidem.WorkerDuty(c.duty), dbidem.CleanupWorkersTime,
			cleanupLockID).Scan(&locked, &r); err != nil {
			return total, true, workers, err
		}
		switch {
		case !locked:
			return total, total > 0 || workers, workers, nil
		case r == nil:
			return total, true, false, nil
		}
		workers = true
		total += int(r[0])
		if r[1] == 1 {
			return total, true, true, nil
		}
	}
}

// finish ends a pass that deleted total keys (from a Citus cluster's workers: workers): it
// counts them, vacuums when due, and counts the pass.
func (c *cleaner) finish(ctx context.Context, start time.Time, total int, workers bool) (int, bool, error) {
	c.deleted.Add(float64(total))
	var err error
	if total > 0 && c.vacuum {
		err = c.vacuumKeys(ctx, c.unvacuumed.Add(int64(total)), workers)
	}
	c.duration.Observe(time.Since(start).Seconds())
	if err != nil {
		c.passes.WithLabelValues(failure(ctx)).Inc()
		return total, true, err
	}
	c.passes.WithLabelValues("done").Inc()
	return total, true, nil
}

// failure is the result a pass that ended in an error counts as: stopped when its context
// ended (the server is shutting down, a pause or a batch was cut short), failed otherwise.
func failure(ctx context.Context) string {
	if ctx.Err() != nil {
		return "stopped"
	}
	return "failed"
}

// vacuumKeys vacuums the key table when deleted, the rows deleted since the last vacuum,
// passes autovacuum's own threshold for the table (autovacuum_vacuum_threshold plus
// autovacuum_vacuum_scale_factor times its rows, the table's settings first). Autovacuum
// applies the same rule, but only when it next looks at the database (autovacuum_naptime, a
// minute by default); vacuuming at the moment the rows are deleted lets the next claims
// reuse their space instead of growing the table, and on a large table with a long TTL it
// rarely happens, since each vacuum reads the whole of both indexes. VACUUM cannot run in a
// transaction or a function, and on PostgreSQL 15 only the table's owner (or a member of its
// role) may run it: a server that connects as another role logs that once and leaves the
// table to autovacuum. On a Citus coordinator (workers) the table's rows are the estimate of
// every shard's (idem_health), not the coordinator's own table's (empty), and VACUUM there
// vacuums every shard on its worker.
func (c *cleaner) vacuumKeys(ctx context.Context, deleted int64, workers bool) error {
	var owner bool
	var threshold float64
	if err := c.pool.QueryRow(ctx, `
		SELECT pg_has_role(c.relowner, 'USAGE'),
		       coalesce((SELECT option_value FROM pg_options_to_table(c.reloptions)
		                  WHERE option_name = 'autovacuum_vacuum_threshold'),
		                current_setting('autovacuum_vacuum_threshold'))::float8
		     + coalesce((SELECT option_value FROM pg_options_to_table(c.reloptions)
		                  WHERE option_name = 'autovacuum_vacuum_scale_factor'),
		                current_setting('autovacuum_vacuum_scale_factor'))::float8
		       * CASE WHEN $1 THEN (SELECT h.estimated_keys FROM idem.idem_health() AS h)::float8
		              ELSE greatest(c.reltuples, 0) END
		  FROM pg_class AS c WHERE c.oid = 'idem.idempotency_keys'::regclass`, workers).Scan(&owner, &threshold); err != nil {
		return err
	}
	if !owner {
		c.unvacuumed.Store(0)
		c.vacuumRefused.Do(func() {
			c.log.Info("cleanup does not vacuum the key table: the server's role does not own it (autovacuum does; see docs/operations.md)")
		})
		return nil
	}
	if float64(deleted) <= threshold {
		return nil
	}
	if _, err := c.pool.Exec(ctx, `VACUUM (SKIP_LOCKED) idem.idempotency_keys`); err != nil {
		return err
	}
	c.unvacuumed.Store(0)
	c.vacuums.Inc()
	return nil
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

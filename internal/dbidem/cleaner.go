package dbidem

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-co-op/gocron/v2"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgidem/pgidem/internal/safelog"
)

// The scheduled cleaner: what the reference server ran in-process (its cmd/server/cleanup.go
// until 0.2.0), moved here so that any service starts it in one call. One pass deletes
// expired keys batch by batch, paced by a duty share, each batch under an advisory lock that
// makes one batch run at a time across processes and renewing a lease (a row of
// idem.cleanup_lease) that makes one pass run at a time, and vacuums the key table when its
// role owns it.

// CleanupLock is the advisory lock that makes one cleanup batch run at a time across every
// process on a database ("idem" in ASCII, then "clean"). Each batch takes it for its own
// transaction (pg_try_advisory_xact_lock); holding it (pg_advisory_xact_lock in a transaction
// of your own) pauses every cleaner. One pass at a time is the cleanup lease's work
// (idem_cleanup_leased), which each batch takes under this lock.
const CleanupLock int64 = 0x6964656d636c6e

// The results of a cleanup pass, as CleanerObserver.PassEnded reports them.
const (
	// PassDone: the pass ran until a batch came back short (or another process's pass took
	// the lease over), and its vacuum, if any, succeeded.
	PassDone = "done"
	// PassSkipped: the pass's first batch found another process's batch holding the lock, or
	// another pass holding the cleanup lease.
	PassSkipped = "skipped"
	// PassFailed: a batch, the defaults' read or the vacuum failed.
	PassFailed = "failed"
	// PassStopped: the pass's context ended (the service is shutting down).
	PassStopped = "stopped"
)

// PassResults lists every result of a pass, in a fixed order.
var PassResults = []string{PassDone, PassSkipped, PassFailed, PassStopped}

// CleanerObserver receives the cleaner's events, for metrics. Implementations must be safe for
// concurrent use and must not block: they are called from the pass.
type CleanerObserver interface {
	// PassEnded is called once per pass: its result (PassDone, PassSkipped, PassFailed,
	// PassStopped), how many keys it deleted (also when it failed part way), and how long it
	// took, the pauses between batches and the vacuum included (0 for a skipped pass).
	PassEnded(result string, deleted int, took time.Duration)
	// Vacuumed is called after each VACUUM of the key table the cleaner ran.
	Vacuumed()
}

type nopCleanerObserver struct{}

func (nopCleanerObserver) PassEnded(string, int, time.Duration) {}
func (nopCleanerObserver) Vacuumed()                            {}

// CleanerOptions configure a Cleaner. The zero value has the defaults.
type CleanerOptions struct {
	// Interval is the time between passes of Start. 0: DefaultCleanupInterval.
	Interval time.Duration
	// BatchSize is the rows per batch. 0: the SQL API's default (idem.idem_defaults()).
	BatchSize int
	// Duty is the share of the time the batches may take (Pace). 0: DefaultCleanupDuty; 1: no
	// pause.
	Duty float64
	// SkipVacuum turns the vacuum of the key table after a pass off.
	SkipVacuum bool
	// Wait makes every batch of a pass wait for the cleanup lock, and take the cleanup lease
	// over, instead of skipping the pass (or stopping it there) when another process's batch
	// holds the lock or its pass the lease: a pass that must run to its end, such as a pass by
	// hand. The other pass stops at its next batch.
	Wait bool
	// Logger receives the passes and their failures. Nil: slog.Default().
	Logger *slog.Logger
	// Observer receives the passes, for metrics. Nil: none.
	Observer CleanerObserver
}

// DefaultCleanupInterval is the time between two passes of a scheduled cleaner by default.
const DefaultCleanupInterval = time.Minute

// MaxCleanupBatch is the largest batch a Cleaner takes.
const MaxCleanupBatch = 1_000_000

// Check returns an error naming the first option out of its bounds.
func (o CleanerOptions) Check() error {
	switch {
	case o.Interval != 0 && (o.Interval < time.Millisecond || o.Interval > MaxInterval):
		return fmt.Errorf("idem: CleanerOptions.Interval must be 0 (a minute) or from 1ms to 10 years, got %s", o.Interval)
	case o.BatchSize < 0 || o.BatchSize > MaxCleanupBatch:
		return fmt.Errorf("idem: CleanerOptions.BatchSize must be 0 (the SQL default) or from 1 to %d, got %d", MaxCleanupBatch, o.BatchSize)
	case o.Duty != 0 && !(o.Duty >= MinCleanupDuty && o.Duty <= 1):
		return fmt.Errorf("idem: CleanerOptions.Duty must be 0 (%.1f) or from %.2f to 1, got %v", DefaultCleanupDuty, MinCleanupDuty, o.Duty)
	}
	return nil
}

// Cleaner deletes expired idempotency keys in batches, and vacuums the key table once its
// passes have deleted more rows than autovacuum's threshold for the table (when its role
// may: on PostgreSQL 15 only the table's owner can).
type Cleaner struct {
	db        Querier
	interval  time.Duration
	batchSize int
	duty      float64 // the share of the time its batches may take (1: no pause between them)
	vacuum    bool
	wait      bool          // each batch waits for the cleanup lock (CleanerOptions.Wait)
	bound     time.Duration // a batch statement's bound, 0 when it waits (CleanupBatchTimeout)
	log       *slog.Logger
	observer  CleanerObserver

	unvacuumed    atomic.Int64 // rows this process deleted since its last vacuum
	vacuumRefused sync.Once

	mu   sync.Mutex
	stop func() // the schedule's, once started
}

// NewCleaner returns a cleaner on db (a pool: each batch is a statement of its own) with these
// options, after checking them.
func NewCleaner(db Querier, o CleanerOptions) (*Cleaner, error) {
	if db == nil {
		return nil, errors.New("idem: a Cleaner needs a database (a pool)")
	}
	if err := o.Check(); err != nil {
		return nil, err
	}
	c := &Cleaner{db: db, interval: o.Interval, batchSize: o.BatchSize, duty: o.Duty, vacuum: !o.SkipVacuum,
		wait: o.Wait, log: o.Logger, observer: o.Observer}
	if !c.wait {
		c.bound = CleanupBatchTimeout
	}
	if c.interval == 0 {
		c.interval = DefaultCleanupInterval
	}
	if c.duty == 0 {
		c.duty = DefaultCleanupDuty
	}
	if c.log == nil {
		c.log = slog.Default()
	}
	// The passes log from the scheduler's goroutine, where a handler's panic would end the
	// process (D222).
	c.log = safelog.Wrap(c.log)
	if c.observer == nil {
		c.observer = nopCleanerObserver{}
	}
	return c, nil
}

// batchSQL is one cleanup batch of pass $1 as one statement, in a transaction of its own:
// idem_cleanup_leased takes the cleanup lock for the transaction (so it also works behind
// PgBouncer in transaction mode) and the cleanup lease for the pass, deletes up to $2 expired
// keys and returns how many, keeping the lease for the pause that duty $3 asks after it (or
// freeing it when the batch came back short); NULL when a batch of another process holds the
// lock, or another pass the lease.
const batchSQL = `SELECT idem.idem_cleanup_leased($1::uuid, $2::integer, $3::float8, false)`

// batchWaitSQL is batchSQL that waits for the lock and takes the lease over
// (CleanerOptions.Wait), whatever lock_timeout the session has (a role's ALTER ROLE ... SET
// lock_timeout): a maintenance window holds the lock for as long as it needs, as
// idem_cleanup_all waits for it. The wait is its transaction's, the statement's own;
// lock_timeout 0 lasts as long.
const batchWaitSQL = `SELECT idem.idem_cleanup_leased($1::uuid, $2::integer, $3::float8, true)
	  FROM (SELECT pg_advisory_xact_lock($4) FROM ` + noLockTimeout + ` OFFSET 0) AS l`

// waitCut tells whether err is a waiting batch's (CleanerOptions.Wait) wait for the cleanup
// lock that the server cut (57014) while ctx goes on: a statement_timeout of the role or the
// database, which lock_timeout 0 does not lift, ended the wait, not the batch's work. The
// batch waits again, so a maintenance window holds the pass up for as long as it lasts
// (D227). The wait is the statement's only part outside a function: a cut inside idem_cleanup
// (its work taking longer than the statement_timeout) names it in the error's context, and
// fails the pass.
func waitCut(ctx context.Context, err error) bool {
	var pgErr *pgconn.PgError
	return err != nil && ctx.Err() == nil && errors.As(err, &pgErr) && pgErr.Code == "57014" && pgErr.Where == ""
}

// waitCutPause is the pause before a waiting batch whose wait the server cut waits again: a
// statement_timeout of a few milliseconds, or a cancel sent again and again, would otherwise
// turn the wait into a loop of round trips.
const waitCutPause = 100 * time.Millisecond

// noLockTimeout is a subquery that sets lock_timeout to 0 for the transaction (the statement's,
// when it has none of its own); the lock is taken in the target list of a query over it, so
// after it.
const noLockTimeout = `(SELECT pg_catalog.set_config('lock_timeout', '0', true) OFFSET 0) AS nl`

// workersSQL is, under the cleanup lock, one pass of idem_cleanup_workers: locked tells
// whether this transaction took the lock (the pass runs only then), and the array is
// {deleted, done (0 or 1)}, or NULL where the database has no workers to ask (plain
// PostgreSQL, a Citus worker) or the lock was not taken.
var workersSQL = fmt.Sprintf(workersSQLFormat, "SELECT pg_try_advisory_xact_lock($4) AS locked OFFSET 0")

// workersSQLFormat is workersSQL with its lock left to fill in.
const workersSQLFormat = `SELECT l.locked, CASE WHEN l.locked THEN (SELECT ARRAY[w.deleted, w.done::integer]
	  FROM idem.idem_cleanup_workers(p_batch_size => $1::integer, p_duty => $2::float8, p_max_time => $3::interval) AS w) END
	  FROM (%s) AS l`

// workersWaitSQL is workersSQL that waits for the lock (CleanerOptions.Wait): locked is true.
var workersWaitSQL = fmt.Sprintf(workersSQLFormat, "SELECT pg_advisory_xact_lock($4) IS NOT NULL AS locked FROM "+noLockTimeout+" OFFSET 0")

// Pass deletes expired keys, batch by batch, until a batch comes back short, and returns how
// many it deleted and whether it ran. One pass runs at a time across every process on the
// database: each batch takes the cleanup lock for its own transaction and, under it, the
// cleanup lease for this pass (idem_cleanup_leased), for twice the pause after it (at most an
// hour) and 10 seconds; the
// batch that comes back short frees the lease. A pass whose first batch finds another
// process's batch running, or another pass holding the lease, is skipped; a pass that finds
// one later stops there (the other pass goes on). With CleanerOptions.Wait each batch waits for
// the lock and takes the lease over instead, and the pass runs to its end. A pass stopped part
// way (ctx ended, a batch failed, the process died) keeps the lease until it runs out: twice
// the pause after its last batch, and 10 seconds. The pass holds at most one connection, and
// only while a statement runs: with a pool of two the API always has one, and behind PgBouncer
// a pool of one suffices. When ctx ends it stops and returns ctx's error.
//
// On a Citus coordinator the pass is passes of idem_cleanup_workers instead, each under the
// lock: every worker cleans its own shards, paced to the cleaner's duty there, for up to
// CleanupWorkersTime, in parallel, until every node is drained. The coordinator then pays one
// round of new connections to the workers per CleanupWorkersTime, not per batch. Those rounds
// run one at a time, back to back, without the lease: there are no pauses between them for
// another pass to start in.
func (c *Cleaner) Pass(ctx context.Context) (int, bool, error) {
	start := time.Now()
	batch := c.batchSize
	if batch <= 0 {
		// The pass's first statement, bounded as a batch is: a connection that went silent
		// between two passes (most of the time: a pass lasts milliseconds a minute) meets it
		// here first.
		bctx, cancel := c.batchContext(ctx, 0)
		d, err := ReadDefaults(bctx, c.db)
		cancel()
		if err != nil {
			c.observer.PassEnded(failure(ctx), 0, time.Since(start))
			return 0, false, batchError(bctx, err)
		}
		batch = d.BatchSize
	}
	total, ran, workers, err := c.workersPass(ctx, batch)
	if err != nil {
		c.observer.PassEnded(failure(ctx), total, time.Since(start))
		return total, true, classifyRead(err)
	}
	if !ran {
		c.observer.PassEnded(PassSkipped, 0, 0)
		return 0, false, nil
	}
	if workers {
		return c.finish(ctx, start, total, true)
	}
	pass := uuid.NewString() // names the pass for the lease, the same for each of its batches
	for {
		var n *int
		began := time.Now()
		sql, args := batchSQL, []any{pass, batch, c.duty}
		if c.wait {
			sql, args = batchWaitSQL, append(args, CleanupLock)
		}
		bctx, cancel := c.batchContext(ctx, 0)
		err := c.db.QueryRow(bctx, sql, args...).Scan(&n)
		cancel()
		if c.wait && waitCut(ctx, err) && sleep(ctx, waitCutPause) {
			continue // the lock is still held: wait for it again
		}
		if err != nil {
			c.observer.PassEnded(failure(ctx), total, time.Since(start))
			return total, true, classifyRead(batchError(bctx, err))
		}
		if n == nil {
			if total == 0 {
				c.observer.PassEnded(PassSkipped, 0, 0)
				return 0, false, nil
			}
			break // another process's pass took over
		}
		total += *n
		if *n < batch {
			break
		}
		if err := Pace(ctx, c.duty, time.Since(began)); err != nil {
			c.observer.PassEnded(failure(ctx), total, time.Since(start))
			return total, true, err
		}
	}
	return c.finish(ctx, start, total, false)
}

// workersPass runs passes of idem_cleanup_workers under the cleanup lock until every node is
// drained. It returns how many keys they deleted, whether the pass ran (false: another
// process held the lock at the first), and whether the database has workers at all (false:
// clean batch by batch here). A pass that finds the lock taken later stops there.
func (c *Cleaner) workersPass(ctx context.Context, batch int) (total int, ran, workers bool, err error) {
	for {
		var locked bool
		var r []int64
		sql := workersSQL
		if c.wait {
			sql = workersWaitSQL
		}
		bctx, cancel := c.batchContext(ctx, CleanupWorkersTime)
		err := c.db.QueryRow(bctx, sql, batch, WorkerDuty(c.duty), interval(CleanupWorkersTime),
			CleanupLock).Scan(&locked, &r)
		cancel()
		if c.wait && waitCut(ctx, err) && sleep(ctx, waitCutPause) {
			continue
		}
		if err != nil {
			return total, true, workers, batchError(bctx, err)
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
// vacuums when due, and reports the pass.
func (c *Cleaner) finish(ctx context.Context, start time.Time, total int, workers bool) (int, bool, error) {
	var err error
	if total > 0 && c.vacuum {
		err = c.vacuumKeys(ctx, c.unvacuumed.Add(int64(total)), workers)
	}
	if err != nil {
		c.observer.PassEnded(failure(ctx), total, time.Since(start))
		return total, true, err
	}
	c.observer.PassEnded(PassDone, total, time.Since(start))
	return total, true, nil
}

// CleanupBatchTimeout bounds one batch statement of a scheduled cleanup pass (on Citus, one
// round of the workers' passes: CleanupWorkersTime more; not a pass whose batches wait for the
// cleanup lock, CleanerOptions.Wait): a connection that stops answering (a primary gone
// without a word, a black-holed network) fails the pass, in the metrics and the log, instead of
// holding it until the kernel gives the connection up (about 15 minutes). A batch of the
// largest size (a million keys) takes seconds.
const CleanupBatchTimeout = 2 * time.Minute

// batchContext is the context of one batch statement: ctx, bounded by c.bound and extra unless
// the batches wait for the cleanup lock (a `server cleanup` by hand waits for a maintenance
// window's lock as long as it is held, and its operator sees it wait).
func (c *Cleaner) batchContext(ctx context.Context, extra time.Duration) (context.Context, context.CancelFunc) {
	if c.bound == 0 {
		return context.WithCancel(ctx)
	}
	return context.WithTimeoutCause(ctx, c.bound+extra, errBatchTimeout)
}

// errBatchTimeout is the cause of a batch statement cut at CleanupBatchTimeout.
var errBatchTimeout = errors.New("idem: a cleanup batch got no answer within CleanupBatchTimeout (2 minutes)")

// batchError is err of a batch statement run on bctx; one cut at its bound says so.
func batchError(bctx context.Context, err error) error {
	if context.Cause(bctx) == errBatchTimeout {
		return fmt.Errorf("%w: %w", errBatchTimeout, err)
	}
	return err
}

// failure is the result a pass that ended in an error counts as: stopped when its context
// ended (the service is shutting down, a pause or a batch was cut short), failed otherwise.
func failure(ctx context.Context) string {
	if ctx.Err() != nil {
		return PassStopped
	}
	return PassFailed
}

// vacuumKeys vacuums the key table when deleted, the rows deleted since the last vacuum,
// passes autovacuum's own threshold for the table (autovacuum_vacuum_threshold plus
// autovacuum_vacuum_scale_factor times its rows, the table's settings first). Autovacuum
// applies the same rule, but only when it next looks at the database (autovacuum_naptime, a
// minute by default); vacuuming at the moment the rows are deleted lets the next claims
// reuse their space instead of growing the table, and on a large table with a long TTL it
// rarely happens, since each vacuum reads the whole of both indexes. VACUUM cannot run in a
// transaction or a function, and on PostgreSQL 15 only the table's owner (or a member of its
// role) may run it: a cleaner that connects as another role logs that once and leaves the
// table to autovacuum. On a Citus coordinator (workers) the table's rows are the estimate of
// every shard's (idem_health), not the coordinator's own table's (empty), and VACUUM there
// vacuums every shard on its worker.
func (c *Cleaner) vacuumKeys(ctx context.Context, deleted int64, workers bool) error {
	var owner bool
	var threshold int64
	if err := c.db.QueryRow(ctx, `
		SELECT pg_has_role(c.relowner, 'USAGE'), floor(
		       coalesce((SELECT option_value FROM pg_options_to_table(c.reloptions)
		                  WHERE option_name = 'autovacuum_vacuum_threshold'),
		                current_setting('autovacuum_vacuum_threshold'))::float8
		     + coalesce((SELECT option_value FROM pg_options_to_table(c.reloptions)
		                  WHERE option_name = 'autovacuum_vacuum_scale_factor'),
		                current_setting('autovacuum_vacuum_scale_factor'))::float8
		       * CASE WHEN $1 THEN (SELECT h.estimated_keys FROM idem.idem_health() AS h)::float8
		              ELSE greatest(c.reltuples, 0) END)::bigint
		  FROM pg_class AS c WHERE c.oid = 'idem.idempotency_keys'::regclass`, workers).Scan(&owner, &threshold); err != nil {
		return err
	}
	if !owner {
		c.unvacuumed.Store(0)
		c.vacuumRefused.Do(func() {
			c.log.Info("cleanup does not vacuum the key table: this role does not own it (autovacuum does; see docs/operations.md)")
		})
		return nil
	}
	if deleted <= threshold {
		return nil
	}
	// VACUUM (SKIP_LOCKED) succeeds with only a WARNING when another session holds a lock
	// that conflicts (another VACUUM, an ANALYZE, CREATE INDEX CONCURRENTLY): the table's
	// count of manual vacuums tells whether one ran, so that a skipped one is neither counted
	// nor forgotten (the next pass tries again). On a Citus coordinator the shards are
	// vacuumed on their workers, and the coordinator's count says nothing about them.
	const vacuums = `SELECT pg_stat_get_vacuum_count('idem.idempotency_keys'::regclass)`
	var before, after int64
	if !workers {
		if err := c.db.QueryRow(ctx, vacuums).Scan(&before); err != nil {
			return err
		}
	}
	if _, err := c.db.Exec(ctx, `VACUUM (SKIP_LOCKED) idem.idempotency_keys`); err != nil {
		return err
	}
	if !workers {
		if err := c.db.QueryRow(ctx, vacuums).Scan(&after); err != nil {
			return err
		}
		if after == before {
			c.log.Info("cleanup's vacuum of the key table was skipped: another session held a conflicting lock; the next pass tries again")
			return nil
		}
	}
	c.unvacuumed.Store(0)
	c.observer.Vacuumed()
	return nil
}

// Start runs a pass every Interval (never two at once in this process) until Stop is called
// or ctx ends. A pass that fails is logged at error level and the next one runs on schedule.
// Start once: a second call returns an error.
func (c *Cleaner) Start(ctx context.Context) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.stop != nil {
		return errors.New("idem: the cleaner is started already")
	}
	s, err := gocron.NewScheduler()
	if err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(ctx)
	_, err = s.NewJob(gocron.DurationJob(c.interval),
		gocron.NewTask(func(ctx context.Context) {
			n, ran, err := c.Pass(ctx)
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
		return err
	}
	s.Start()
	var once sync.Once
	c.stop = func() {
		once.Do(func() {
			cancel()
			_ = s.Shutdown()
		})
	}
	return nil
}

// Stop ends the schedule: it cancels a running pass and waits for it (the next pass, in any
// process, picks up where it stopped). With pgx's default handling of a canceled context the
// batch statement in flight is not canceled on the server: it may still delete expired keys
// after Stop returns. Safe to call more than once, and on a cleaner that was
// never started.
func (c *Cleaner) Stop() {
	c.mu.Lock()
	stop := c.stop
	c.mu.Unlock()
	if stop != nil {
		stop()
	}
}

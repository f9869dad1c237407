package idem

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/pgidem/pgidem/internal/dbidem"
	"github.com/pgidem/pgidem/internal/safelog"
)

// Cleanup: expired keys stay in the table until something deletes them. A service starts a
// Cleaner in one call (StartCleaner); pg_cron (docs/sql-api.md) or `server cleanup` do the
// same from outside. Every minute, paced, one pass at a time across processes: the table then
// holds about one TTL of keys, and the API's latency barely notices the cleaner.

// CleanerOptions configure a Cleaner. The zero value has the defaults; NewCleaner checks the
// bounds.
type CleanerOptions struct {
	// Interval is the time between two passes of a started cleaner. Default 0: a minute
	// (DefaultCleanupInterval), so the table holds its TTL of keys plus at most a minute's.
	// From a millisecond to 10 years.
	Interval time.Duration
	// BatchSize is the rows deleted per batch, each batch a transaction of its own. Default 0:
	// the SQL API's default (1000, idem_defaults()). From 1 to 1,000,000.
	BatchSize int
	// Duty is the share of the time the batches of a pass may take: after each batch the
	// cleaner pauses so that batches take at most this share (Pace). Default 0:
	// DefaultCleanupDuty (0.4); 1: no pause. From 0.01 to 1.
	Duty float64
	// SkipVacuum turns off the VACUUM of the key table that a pass runs once the passes of
	// this process have deleted more keys than autovacuum's threshold for the table. Default
	// false: vacuum, when the cleaner's role owns the table (on PostgreSQL 15 only the owner
	// may; a cleaner that runs as the application role logs once that it leaves the table to
	// autovacuum).
	SkipVacuum bool
	// Wait makes every batch of a pass wait for CleanupLock when another process's batch
	// holds it, and take the cleanup lease over from another process's pass, instead of
	// skipping the pass (or stopping it there, leaving the rest to that process). Default
	// false, what a scheduled cleaner wants: no pass waits for another's. Set it for a pass
	// that must run to its end, such as a pass by hand to catch up: the other process's pass
	// then stops at its next batch, and a transaction that holds
	// CleanupLock holds it up until it ends, whatever lock_timeout and statement_timeout the
	// role has (a wait the server cuts is waited again; a batch's own work still gets the
	// role's statement_timeout).
	Wait bool
	// Logger receives a line per pass that deleted keys, and every failure. Default nil:
	// slog.Default(). A record whose handler panics is dropped (a started Cleaner logs from
	// its scheduler's goroutine, where a panic would end the process).
	Logger *slog.Logger
	// Metrics observes every pass. Default nil: none. The Prometheus adapter is package
	// github.com/pgidem/pgidem/idem/idemprom.
	Metrics CleanupObserver
}

// DefaultCleanupInterval is the time between two passes of a started Cleaner by default.
const DefaultCleanupInterval = time.Minute

// CleanupLock is the advisory lock that makes one cleanup batch run at a time across every
// process on a database ("idem" in ASCII, then "clean"): each batch takes it for its own transaction
// (pg_try_advisory_xact_lock). Holding it (pg_advisory_xact_lock in a transaction of your
// own) pauses every Cleaner. One pass at a time is the cleanup lease's work, which each batch
// takes under this lock (idem_cleanup_leased, docs/sql-api.md).
const CleanupLock int64 = 0x6964656d636c6e

// PassResult is how a cleanup pass ended.
type PassResult string

// The results of a cleanup pass.
const (
	// PassDone: the pass deleted every expired key it found (or handed over to a pass that
	// took the cleanup lease over, or stopped at a maintenance window that held CleanupLock),
	// and its vacuum, if any, succeeded.
	PassDone PassResult = "done"
	// PassSkipped: another process's batch held the lock, or another pass the cleanup
	// lease: it is cleaning.
	PassSkipped PassResult = "skipped"
	// PassFailed: a batch, the read of the defaults or the vacuum failed.
	PassFailed PassResult = "failed"
	// PassStopped: the pass's context ended (the service is shutting down).
	PassStopped PassResult = "stopped"
)

// PassResults lists every PassResult, in a fixed order.
func PassResults() []PassResult { return []PassResult{PassDone, PassSkipped, PassFailed, PassStopped} }

// CleanupObserver receives the events of a Cleaner, for metrics. Implementations must be safe
// for concurrent use and must not block: the pass calls them. A panic of theirs is recovered
// (the first logged at error, with its stack) and costs that event only.
type CleanupObserver interface {
	// PassEnded is called once per pass: how it ended, how many keys it deleted (also when it
	// failed part way), and how long it took, pauses and vacuum included (0 when skipped).
	PassEnded(result PassResult, deleted int, took time.Duration)
	// Vacuumed is called after each VACUUM of the key table the cleaner ran.
	Vacuumed()
}

// cleanupObserver adapts a CleanupObserver to the implementation's. A panic of the observer
// is recovered, and the first one logged at error with its stack: the passes of a started
// Cleaner run on the scheduler's goroutine, where a panic would end the process, and a
// Vacuumed that panicked lost its pass's PassEnded (D222).
type cleanupObserver struct {
	o CleanupObserver
	firstPanic
}

func (a cleanupObserver) PassEnded(result string, deleted int, took time.Duration) {
	defer a.recovered("PassEnded")
	a.o.PassEnded(PassResult(result), deleted, took)
}

func (a cleanupObserver) Vacuumed() {
	defer a.recovered("Vacuumed")
	a.o.Vacuumed()
}

// Cleaner deletes expired keys: a pass deletes them batch by batch, each batch one statement in
// a transaction of its own under CleanupLock, until a batch comes back short, pausing after
// each so that batches take at most Duty of the time. With several processes on one database
// one pass runs at a time: each batch also takes the cleanup lease for its pass (a row of
// idem.cleanup_lease) for twice the pause the duty share asks after it (at most an hour) and
// 10 seconds, and the pass's last batch frees it, so a pass
// that starts while another process's batch runs, or during another pass's pauses, is
// skipped. A pass stopped part way (its process shut down or died) keeps the lease until it runs
// out, twice its last pause and 10 seconds. A pass holds at most one connection, and only
// while a statement runs. Rows that a request holds are skipped, never waited for. A batch
// statement that gets no answer within two minutes (a connection that stopped answering) fails
// the pass, which the metrics count as failed; a cleaner whose batches wait for the lock
// (CleanerOptions.Wait) waits as long as the lock is held. Safe for concurrent use.
type Cleaner struct{ c *dbidem.Cleaner }

// NewCleaner returns a cleaner on db (a pool: each batch is a statement of its own, never
// run inside a transaction of yours) after checking the options. Start it, or run a Pass by
// hand.
func NewCleaner(db Querier, o CleanerOptions) (*Cleaner, error) {
	io := dbidem.CleanerOptions{Interval: o.Interval, BatchSize: o.BatchSize, Duty: o.Duty, SkipVacuum: o.SkipVacuum, Wait: o.Wait,
		Logger: o.Logger}
	if o.Metrics != nil {
		log := o.Logger
		if log == nil {
			log = slog.Default()
		}
		io.Observer = cleanupObserver{o: o.Metrics, firstPanic: firstPanic{what: "CleanupObserver", log: safelog.Wrap(log), once: new(sync.Once)}}
	}
	c, err := dbidem.NewCleaner(db, io)
	if err != nil {
		return nil, err
	}
	return &Cleaner{c}, nil
}

// StartCleaner checks the options and the database's schema (CheckSchema), and starts a
// cleaner on db: a pass every Interval until ctx ends or Stop is called. The one call a
// service makes:
//
//	cleaner, err := idem.StartCleaner(ctx, pool, idem.CleanerOptions{})
//	if err != nil {
//		return err
//	}
//	defer cleaner.Stop()
func StartCleaner(ctx context.Context, db Querier, o CleanerOptions) (*Cleaner, error) {
	c, err := NewCleaner(db, o)
	if err != nil {
		return nil, err
	}
	if err := CheckSchema(ctx, db); err != nil {
		return nil, err
	}
	for _, fn := range []string{dbidem.CleanupWorkersSignature, dbidem.CleanupLeasedSignature} {
		if err := dbidem.CheckCall(ctx, db, fn); err != nil {
			return nil, err
		}
	}
	if err := c.Start(ctx); err != nil {
		return nil, err
	}
	return c, nil
}

// Start runs a pass every Interval (never two at once in this process; the first one Interval
// after the start) until Stop is called or ctx ends. A pass that fails is logged at error
// level, and the next one runs on schedule. A cleaner starts once.
func (c *Cleaner) Start(ctx context.Context) error { return c.c.Start(ctx) }

// Stop ends the schedule: it cancels a running pass and waits for it (the next pass, in any
// process, picks up where it stopped). With pgx's default handling of a canceled context the
// batch statement in flight is not canceled on the server: it may still delete expired keys
// after Stop returns. Safe to call more than once, and on a cleaner never
// started.
func (c *Cleaner) Stop() { c.c.Stop() }

// Pass runs one pass now and returns how many keys it deleted and whether it ran (false: it
// was skipped, another process's batch holds the lock or another pass the cleanup lease;
// never with CleanerOptions.Wait). When
// ctx ends it stops and returns ctx's error. For a command that cleans by hand, set Duty to 1
// (no pauses) and Wait.
func (c *Cleaner) Pass(ctx context.Context) (deleted int, ran bool, err error) { return c.c.Pass(ctx) }

// Cleanup deletes expired keys in batches of batchSize (0: the SQL API's default; else from 1
// to 1,000,000, as CleanerOptions.BatchSize, or ErrInvalidArgument) until a
// batch comes back short, and returns how many it deleted, without pauses, without the
// cleanup lock and without the cleanup lease (its batches run alongside the cleaners': rows
// one of them has locked are skipped, none is deleted twice; the SQL API's idem_cleanup_all,
// for pg_cron, takes both). Pass a pool, so
// that each batch is a short transaction of its own. On a Citus coordinator every worker cleans
// its own shards, in parallel (idem_cleanup_workers). A Cleaner is what a service runs.
func Cleanup(ctx context.Context, db Querier, batchSize int) (int, error) {
	return dbidem.Cleanup(ctx, db, batchSize)
}

// DefaultCleanupDuty is the share of the time a Cleaner's batches take by default: measured to
// keep the API's p99 within a fifth of its value without cleanup while deleting many times
// faster than keys expire (docs/operations.md, "Cleanup").
const DefaultCleanupDuty = 0.4

// MinCleanupDuty is the smallest duty Pace honours (a pause of at most 99 times the batch).
const MinCleanupDuty = 0.01

// CleanupPaced is Cleanup with a pause after every batch, so that the batches take at most
// duty of the time, as Pace counts it (DefaultCleanupDuty beside the API; 1 or more, or NaN:
// no pause; below MinCleanupDuty counts as it; on a Citus coordinator each worker paces its own batches). When ctx ends,
// during a batch or a pause, it returns the count so far and ctx.Err().
func CleanupPaced(ctx context.Context, db Querier, batchSize int, duty float64) (int, error) {
	return dbidem.CleanupPaced(ctx, db, batchSize, duty)
}

// Pace waits, after a batch of cleanup that took took, so that batches take at most duty of
// the time. A duty of 1 or more (or NaN) means no wait; one below MinCleanupDuty (0 and
// negative ones included) counts as MinCleanupDuty; a pause is at most an hour. It returns early with ctx.Err() when ctx ends.
func Pace(ctx context.Context, duty float64, took time.Duration) error {
	return dbidem.Pace(ctx, duty, took)
}

package tests

// The idem library behind PgBouncer 1.18 in transaction pool mode, from a review of that path.
// Every test goes through a private PgBouncer (pgtest.PgBouncer) in the documented form
// (default_query_exec_mode=exec).

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/idem/idemprom"
	"github.com/pgidem/pgidem/internal/pgbouncer"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// bouncerSession is what a server connection keeps from one transaction to the next: the state that
// would leak to another client through PgBouncer in transaction mode.
type bouncerSession struct {
	PID                                   int32
	Prepared, Advisory, Listening, Cursor int64
	TempSchema                            int64
	Settings                              string
}

// serverSessionState reads the session state of the server connection q's statement lands on.
func serverSessionState(t *testing.T, q idem.Querier) bouncerSession {
	t.Helper()
	var s bouncerSession
	err := q.QueryRow(context.Background(), `SELECT pg_backend_pid(),
		(SELECT count(*) FROM pg_prepared_statements),
		(SELECT count(*) FROM pg_locks WHERE pid = pg_backend_pid() AND locktype = 'advisory'),
		(SELECT count(*) FROM pg_listening_channels()),
		(SELECT count(*) FROM pg_cursors),
		pg_my_temp_schema()::oid::int8,
		(SELECT coalesce(string_agg(name || '=' || setting, ', ' ORDER BY name), '')
		   FROM pg_settings WHERE source NOT IN ('default', 'configuration file', 'override', 'environment variable')
		    AND name NOT IN ('transaction_isolation', 'transaction_read_only', 'transaction_deferrable'))`).
		Scan(&s.PID, &s.Prepared, &s.Advisory, &s.Listening, &s.Cursor, &s.TempSchema, &s.Settings)
	if err != nil {
		t.Fatalf("session state: %v", err)
	}
	return s
}

func bouncerClaim(key, body string, lease time.Duration) idem.Claim {
	return idem.Claim{Principal: "p", Key: key, Action: "POST /bouncer", Fingerprint: sha256.Sum256([]byte(body)), Lease: lease}
}

// TestBouncerSessionHygiene: behind PgBouncer with ONE server connection (every client's
// transaction lands on it), every public path of the library (claims, replays, mismatches,
// lock timeouts, lost claims, final answers, Do, DoLease with steps and heartbeats,
// operators' reads and lever, the cleanup with its vacuum, the Prometheus gauges) leaves
// that server connection as it found it: no prepared statement, no session advisory lock,
// no LISTEN, no cursor, no temporary schema, no setting changed for the session. This is the
// promise of docs/operations.md ("the functions keep no session state") and of
// docs/sql-api.md ("Nothing depends on session state ... take no session advisory locks, and
// need no SQL PREPARE").
func TestBouncerSessionHygiene(t *testing.T) {
	t.Parallel()
	url := pgtest.NewDB(t)
	b := pgtest.PgBouncer(t, map[string]string{"default_pool_size": "1", "query_wait_timeout": "20"})
	pool := bouncerPool(t, url, b, pgx.QueryExecModeExec, 4)
	direct := pgtest.Connect(t, url)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()

	before := serverSessionState(t, pool)
	check := func(phase string) {
		t.Helper()
		after := serverSessionState(t, pool)
		if after.PID != before.PID {
			t.Logf("%s: the server connection changed (%d -> %d): PgBouncer closed it", phase, before.PID, after.PID)
			before = serverSessionState(t, pool)
			return
		}
		if after != before {
			t.Errorf("%s: the server connection's session state changed:\n before %+v\n after  %+v", phase, before, after)
		}
	}

	// Transactional claims: claimed+completed, replay, mismatch, final answer after a failed
	// statement, a claim lost at completion.
	for i, body := range []string{"a", "a", "b"} {
		err := idem.RunTx(ctx, pool, idem.TxOptions{}, func(tx *idem.Tx) error {
			d, err := tx.Claim(ctx, bouncerClaim("t1", body, 0))
			if err != nil {
				return err
			}
			if d.Outcome == idem.Claimed {
				tx.CompleteOnCommit(idem.Response{Status: 201, Body: []byte("first")})
			}
			return nil
		})
		if err != nil {
			t.Fatalf("claim %d: %v", i, err)
		}
	}
	err := idem.RunTx(ctx, pool, idem.TxOptions{}, func(tx *idem.Tx) error {
		if _, err := tx.Claim(ctx, bouncerClaim("t2", "x", 0)); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, `SELECT 1/0`)
		if err == nil {
			return errors.New("no error")
		}
		tx.FinalOnCommit(idem.Response{Status: 422, Body: []byte("final")})
		return nil
	})
	if err != nil {
		t.Fatalf("final answer: %v", err)
	}
	check("transactional claims")

	// A lock timeout inside idem_begin (its SET clause and its set_config): a claim of a key an
	// uncommitted transaction holds (from a direct connection).
	holder, err := direct.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := idem.Begin(ctx, holder, bouncerClaim("held", "x", 0)); err != nil {
		t.Fatal(err)
	}
	c := bouncerClaim("held", "x", 0)
	c.LockTimeout = 50 * time.Millisecond
	err = idem.RunTx(ctx, pool, idem.TxOptions{MaxAttempts: 1}, func(tx *idem.Tx) error {
		_, err := tx.Claim(ctx, c)
		return err
	})
	if !errors.Is(err, idem.ErrInProgress) {
		t.Fatalf("claim of a held key: %v, want ErrInProgress", err)
	}
	_ = holder.Rollback(ctx)
	check("lock timeout in idem_begin")

	// Lease claims by hand: claim, extend, complete with a wrong token (55000 raised inside a
	// function with SET clauses), yield, release.
	var d idem.Decision
	err = idem.RunTx(ctx, pool, idem.TxOptions{}, func(tx *idem.Tx) error {
		var err error
		d, err = tx.Claim(ctx, bouncerClaim("l1", "x", 10*time.Second))
		return err
	})
	if err != nil || d.Outcome != idem.Claimed {
		t.Fatalf("lease claim: %+v %v", d, err)
	}
	if _, err := idem.Extend(ctx, pool, "p", "l1", d.Attempt, 10*time.Second); err != nil {
		t.Fatal(err)
	}
	if err := idem.Complete(ctx, pool, "p", "l1", d.Attempt+1000, idem.Response{Status: 200}); !errors.Is(err, idem.ErrClaimLost) {
		t.Fatalf("complete with a wrong token: %v", err)
	}
	if ok, err := idem.Yield(ctx, pool, "p", "l1", d.Attempt); !ok || err != nil {
		t.Fatalf("yield: %v %v", ok, err)
	}
	check("lease claims by hand")

	// Do: claimed, replay, fn failure.
	job := idem.Job{Principal: "p", Key: "do1", Action: "bouncer", Input: map[string]int{"n": 1}}
	for i := 0; i < 2; i++ {
		if _, _, err := idem.Do(ctx, pool, job, idem.TxOptions{}, func(ctx context.Context, tx pgx.Tx) (int, error) {
			return 7, nil
		}); err != nil {
			t.Fatal(err)
		}
	}
	job.Key = "do2"
	if _, _, err := idem.Do(ctx, pool, job, idem.TxOptions{}, func(ctx context.Context, tx pgx.Tx) (int, error) {
		_, err := tx.Exec(ctx, `SELECT 1`)
		if err != nil {
			return 0, err
		}
		return 0, errors.New("boom")
	}); err == nil {
		t.Fatal("Do with a failing fn succeeded")
	}
	check("Do")

	// DoLease with steps: a step with an outside call before its first statement, one whose
	// fn uses tx.Conn() only, heartbeats during a work longer than the lease.
	lj := idem.Job{Principal: "p", Key: "dl1", Action: "bouncer", Lease: time.Second, Timeout: 20 * time.Second}
	r, _, err := idem.DoLease(ctx, pool, lj, func(ctx context.Context, lc idem.LeaseClaim) (string, error) {
		a, err := idem.Step(ctx, "a", func(ctx context.Context, tx pgx.Tx) (int, error) {
			time.Sleep(1500 * time.Millisecond) // outside call, no statement yet: holds no server connection
			var n int
			return n, tx.QueryRow(ctx, `SELECT 41 + 1`).Scan(&n)
		})
		if err != nil {
			return "", err
		}
		bb, err := idem.Step(ctx, "b", func(ctx context.Context, tx pgx.Tx) (int, error) {
			var n int
			return n, tx.Conn().QueryRow(ctx, `SELECT 1`).Scan(&n)
		})
		if err != nil {
			return "", err
		}
		return fmt.Sprint(a, bb), nil
	})
	if err != nil || r != "42 1" {
		t.Fatalf("DoLease: %q %v", r, err)
	}
	check("DoLease with steps")

	// Operators: health, summary, key, stuck, release_stuck; the gauges.
	if _, err := idem.ReadHealth(ctx, pool); err != nil {
		t.Fatal(err)
	}
	if _, err := idem.ReadSummary(ctx, pool, true); err != nil {
		t.Fatal(err)
	}
	if _, _, err := idem.ReadKey(ctx, pool, "p", "t1"); err != nil {
		t.Fatal(err)
	}
	err = idem.RunTx(ctx, pool, idem.TxOptions{}, func(tx *idem.Tx) error {
		var err error
		d, err = tx.Claim(ctx, bouncerClaim("stuck", "x", time.Minute))
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := idem.ReadStuck(ctx, pool, 0, 10); err != nil {
		t.Fatal(err)
	}
	if err := idem.ReleaseStuck(ctx, pool, "p", "stuck", d.Attempt, "bouncer review"); err != nil {
		t.Fatal(err)
	}
	if err := idem.ReleaseStuck(ctx, pool, "p", "stuck", d.Attempt, "again"); !errors.Is(err, idem.ErrClaimLost) {
		t.Fatalf("second release: %v", err)
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(idemprom.NewHealthCollector(pool, time.Millisecond, slog.New(slog.NewTextHandler(io.Discard, nil))))
	if mf, err := reg.Gather(); err != nil || len(mf) == 0 {
		t.Fatalf("gauges: %d families, %v", len(mf), err)
	}
	check("operators and gauges")

	// Cleanup: Cleanup, and a Cleaner pass with its vacuum (the test role owns the table).
	pgtest.InsertExpired(t, direct, "p", 500)
	if n, err := idem.Cleanup(ctx, pool, 100); err != nil || n != 500 {
		t.Fatalf("Cleanup: %d %v", n, err)
	}
	pgtest.InsertExpired(t, direct, "p", 500)
	cl, err := idem.NewCleaner(pool, idem.CleanerOptions{BatchSize: 100, Duty: 1, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	if n, ran, err := cl.Pass(ctx); err != nil || !ran || n != 500 {
		t.Fatalf("Pass: %d %v %v", n, ran, err)
	}
	wl, err := idem.NewCleaner(pool, idem.CleanerOptions{BatchSize: 100, Duty: 1, Wait: true, SkipVacuum: true})
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := wl.Pass(ctx); err != nil {
		t.Fatal(err)
	}
	check("cleanup")
}

// isCanceled: SQLSTATE 57014 (canceling statement due to user request).
func isCanceled(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "57014"
}

// TestBouncerCancelStaysOnItsClient: pgx (v5.12, its default context watcher) closes a
// connection whose statement's context ended, and sends a cancel request first
// (asyncClose). Behind PgBouncer in transaction mode the cancel names the client, and
// PgBouncer forwards it to the server connection the client holds at that moment. With a pool
// of ONE server connection, client A's statements keep timing out right around the moment
// they finish (their server connection goes back to the pool while the cancel is on its way)
// while client B runs the library's statements (Extend, ReadKey, claims) back to back on the
// same server connection. A cancel that reached B's statement would be a 57014 on B: an
// extension that failed (a lease lost by the clock), a claim answered "in progress". Asserts:
// B never sees 57014.
func TestBouncerCancelStaysOnItsClient(t *testing.T) {
	t.Parallel()
	url := pgtest.NewDB(t)
	b := pgtest.PgBouncer(t, map[string]string{"default_pool_size": "1", "query_wait_timeout": "20"})
	poolA := bouncerPool(t, url, b, pgx.QueryExecModeExec, 4)
	poolB := bouncerPool(t, url, b, pgx.QueryExecModeExec, 2)
	ctx := context.Background()
	var d idem.Decision
	err := idem.RunTx(ctx, poolB, idem.TxOptions{}, func(tx *idem.Tx) error {
		var err error
		d, err = tx.Claim(ctx, bouncerClaim("lease", "x", time.Hour))
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	stop := make(chan struct{})
	var aTimeouts, aDone atomic.Int64
	var wg sync.WaitGroup
	for w := 0; w < 1; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				// pg_sleep(3 ms) with a deadline of 1 to 6 ms: some end before, some around,
				// some after the statement's end.
				actx, cancel := context.WithTimeout(ctx, time.Duration(2+(i*7+w)%12)*time.Millisecond)
				_, err := poolA.Exec(actx, `SELECT pg_sleep(0.003)`)
				cancel()
				if err != nil {
					aTimeouts.Add(1)
				} else {
					aDone.Add(1)
				}
			}
		}()
	}
	var bErrs []error
	var bCanceled, bOK int
	deadline := time.Now().Add(6 * time.Second)
	for i := 0; time.Now().Before(deadline); i++ {
		bctx, cancel := context.WithTimeout(ctx, 25*time.Second)
		var err error
		switch i % 3 {
		case 0:
			_, err = idem.Extend(bctx, poolB, "p", "lease", d.Attempt, time.Hour)
		case 1:
			_, _, err = idem.ReadKey(bctx, poolB, "p", "lease")
		case 2:
			err = idem.RunTx(bctx, poolB, idem.TxOptions{MaxAttempts: 1}, func(tx *idem.Tx) error {
				d, err := tx.Claim(bctx, bouncerClaim(fmt.Sprintf("k%d", i), "x", 0))
				if err == nil && d.Outcome == idem.Claimed {
					tx.CompleteOnCommit(idem.Response{Status: 200})
				}
				return err
			})
		}
		cancel()
		switch {
		case err == nil:
			bOK++
		case isCanceled(err):
			bCanceled++
			bErrs = append(bErrs, err)
		default:
			bErrs = append(bErrs, err)
		}
	}
	close(stop)
	wg.Wait()
	t.Logf("A: %d timed out, %d done; B: %d ok, %d canceled, %d other errors", aTimeouts.Load(), aDone.Load(), bOK, bCanceled, len(bErrs)-bCanceled)
	if bCanceled > 0 || len(bErrs) > 0 {
		t.Fatalf("client B's statements failed %d times (%d of them 57014, another client's cancel): first %v", len(bErrs), bCanceled, bErrs[0])
	}
	if aTimeouts.Load() == 0 {
		t.Fatal("client A never timed out: the race was not exercised")
	}
}

// TestBouncerDoCancelledMidStatement: idem.Do whose context ends while its work's statement
// waits on a row lock, behind PgBouncer (pgx closes the client connection and sends a cancel
// request; PgBouncer closes the server connection that was in the transaction). Asserts: no
// effect committed and no key left behind; the retry runs fn once and commits; a repeat
// replays the retry's answer; meanwhile another client's statements on the same PgBouncer
// never fail.
func TestBouncerDoCancelledMidStatement(t *testing.T) {
	t.Parallel()
	url := pgtest.NewDB(t)
	b := pgtest.PgBouncer(t, map[string]string{"default_pool_size": "2", "query_wait_timeout": "20"})
	pool := bouncerPool(t, url, b, pgx.QueryExecModeExec, 4)
	other := bouncerPool(t, url, b, pgx.QueryExecModeExec, 1)
	direct := pgtest.Connect(t, url)
	ctx := context.Background()
	pgtest.Exec(t, direct, `CREATE TABLE cancel_effects (k text, n int); CREATE TABLE cancel_gate (id int PRIMARY KEY); INSERT INTO cancel_gate VALUES (1)`)
	holder, err := direct.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, holder, `SELECT 1 FROM cancel_gate WHERE id = 1 FOR UPDATE`)

	stop := make(chan struct{})
	otherErr := make(chan error, 1)
	go func() {
		for {
			select {
			case <-stop:
				otherErr <- nil
				return
			default:
			}
			if _, _, err := idem.ReadKey(ctx, other, "p", "c1"); err != nil {
				otherErr <- err
				return
			}
		}
	}()

	var runs atomic.Int64
	job := idem.Job{Principal: "p", Key: "c1", Action: "bouncer"}
	work := func(ctx context.Context, tx pgx.Tx) (int64, error) {
		n := runs.Add(1)
		if _, err := tx.Exec(ctx, `INSERT INTO cancel_effects VALUES ('c1', $1)`, n); err != nil {
			return 0, err
		}
		if _, err := tx.Exec(ctx, `SELECT 1 FROM cancel_gate WHERE id = 1 FOR UPDATE`); err != nil {
			return 0, err
		}
		return n, nil
	}
	cctx, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
	_, _, err = idem.Do(cctx, pool, job, idem.TxOptions{}, work)
	cancel()
	if err == nil {
		t.Fatal("Do whose context ended mid-statement succeeded")
	}
	_ = holder.Rollback(ctx)
	pgtest.WaitFor(t, direct, `SELECT (count(*) = 0)::int FROM pg_locks WHERE relation = 'cancel_effects'::regclass`)
	if n := pgtest.Count(t, direct, `SELECT count(*) FROM cancel_effects`); n != 0 {
		t.Fatalf("%d effects committed by the cancelled Do", n)
	}
	if n := pgtest.Count(t, direct, `SELECT count(*) FROM idem.idempotency_keys WHERE key = 'c1'`); n != 0 {
		t.Fatalf("the cancelled Do left its key (%d rows)", n)
	}
	first, replayed, err := idem.Do(ctx, pool, job, idem.TxOptions{}, work)
	if err != nil || replayed {
		t.Fatalf("retry: %v replayed %v", err, replayed)
	}
	again, replayed, err := idem.Do(ctx, pool, job, idem.TxOptions{}, work)
	if err != nil || !replayed || again != first {
		t.Fatalf("repeat: %d replayed %v %v, want %d replayed", again, replayed, err, first)
	}
	if n := pgtest.Count(t, direct, `SELECT count(*) FROM cancel_effects`); n != 1 {
		t.Fatalf("%d effects, want 1", n)
	}
	close(stop)
	if err := <-otherErr; err != nil {
		t.Fatalf("another client's read failed: %v", err)
	}
}

// TestBouncerWaitingClaimsWithinTheSizing: a claim that waits on a key's row lock is a
// transaction, and behind PgBouncer it holds a server connection for its whole wait; the bound
// on waiting claims is each process's. Three processes, each with a pool of 4 and
// MaxWaitingClaims 1: process A works on keys k1 and k2 (transactional, slow); process B gets a
// duplicate of k1, process C one of k2, each waiting on the key's row (within its bound). Then
// process B, with idle connections in its pool, runs a job with a fresh key k3. Behind a
// default_pool_size of 4 (the pool alone, as docs/operations.md sized it before), k3 waited in
// PgBouncer's queue until a duplicate's lock timeout (2 s) freed a server connection. Sized as
// the docs now say, 4 plus the processes' waiting claims (3), k3 is done at once.
func TestBouncerWaitingClaimsWithinTheSizing(t *testing.T) {
	t.Parallel()
	url := pgtest.NewDB(t)
	b := pgtest.PgBouncer(t, map[string]string{"default_pool_size": "7", "query_wait_timeout": "20"})
	procA := bouncerPool(t, url, b, pgx.QueryExecModeExec, 4)
	procB := bouncerPool(t, url, b, pgx.QueryExecModeExec, 4)
	procC := bouncerPool(t, url, b, pgx.QueryExecModeExec, 4)
	direct := pgtest.Connect(t, url)
	gateA := idem.NewGate(idem.GateOptions{MaxWaitingClaims: 1})
	gateB := idem.NewGate(idem.GateOptions{MaxWaitingClaims: 1})
	gateC := idem.NewGate(idem.GateOptions{MaxWaitingClaims: 1})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	stop := slowHoldersAndWaiters(t, ctx, direct, [3]*pgxpool.Pool{procA, procB, procC}, [3]*idem.Gate{gateA, gateB, gateC}, false)
	defer stop()
	// Both duplicates wait on their key's row (two backends wait on a lock, past their 5 ms
	// probe: the claim that took the process's wait slot).
	pgtest.WaitFor(t, direct, `SELECT count(*) - 1 FROM pg_stat_activity WHERE datname = current_database()
		AND wait_event_type = 'Lock' AND clock_timestamp() - query_start > interval '200 ms'`)
	servers := pgtest.PgBouncerServers(t, b, dbName(t, url))
	start := time.Now()
	r, _, err := idem.Do(ctx, procB, bouncerJob("k3", gateB), idem.TxOptions{}, func(ctx context.Context, tx pgx.Tx) (string, error) {
		return "fresh", nil
	})
	took := time.Since(start)
	t.Logf("PgBouncer server connections before k3: %d of 7; process B's fresh key k3: %q %v in %s", servers, r, err, took)
	if err != nil || took > time.Second {
		t.Fatalf("a fresh key in a process with idle connections took %s (%v): the duplicates' waits held every server connection of PgBouncer", took.Round(time.Millisecond), err)
	}
}

// TestBouncerLeaseBesideWaitingClaims: three processes as in
// TestBouncerWaitingClaimsWithinTheSizing. Process C runs DoLease (Lease 1 s) on key L, which
// nobody else touches; its fn makes an outside call (holding no connection) and then writes a
// Step. Meanwhile process A works on k1 and k2 and processes B and C each keep a duplicate of one
// of them waiting on the key's row. Behind a default_pool_size of 4 the heartbeats waited in
// PgBouncer's queue behind the duplicates' waits and were cut, the lease counted as lost by the
// clock, and work that no other attempt touched was given up. Sized as the docs say (4 + 3), the
// lease holds, as it does against PostgreSQL directly (the control).
func TestBouncerLeaseBesideWaitingClaims(t *testing.T) {
	t.Parallel()
	for _, via := range []string{"direct", "pgbouncer"} { // direct: the control, which holds
		t.Run(via, func(t *testing.T) { leaseBesideWaiters(t, via) })
	}
}

// leaseBesideWaiters runs TestBouncerLeaseBesideWaitingClaims against PostgreSQL directly or
// through a PgBouncer sized as docs/operations.md says.
func leaseBesideWaiters(t *testing.T, via string) {
	url := pgtest.NewDB(t)
	var b *pgbouncer.Bouncer
	if via == "pgbouncer" {
		b = pgtest.PgBouncer(t, map[string]string{"default_pool_size": "7", "query_wait_timeout": "20"})
	}
	mk := func() *pgxpool.Pool {
		if via == "direct" {
			cfg, err := pgxpool.ParseConfig(url)
			if err != nil {
				t.Fatal(err)
			}
			cfg.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeExec
			cfg.MaxConns = 4
			p, err := pgxpool.NewWithConfig(context.Background(), cfg)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(p.Close)
			return p
		}
		return bouncerPool(t, url, b, pgx.QueryExecModeExec, 4)
	}
	procA, procB, procC := mk(), mk(), mk()
	direct := pgtest.Connect(t, url)
	gateA := idem.NewGate(idem.GateOptions{MaxWaitingClaims: 1})
	gateB := idem.NewGate(idem.GateOptions{MaxWaitingClaims: 1})
	gateC := idem.NewGate(idem.GateOptions{MaxWaitingClaims: 1})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	started := make(chan struct{})
	type leaseResult struct {
		r   string
		err error
	}
	leaseDone := make(chan leaseResult, 1)
	go func() {
		lj := idem.Job{Principal: "p", Key: "L", Action: "bouncer-lease", Gate: gateC, Lease: time.Second, Timeout: 20 * time.Second}
		r, _, err := idem.DoLease(ctx, procC, lj, func(ctx context.Context, lc idem.LeaseClaim) (string, error) {
			close(started)
			time.Sleep(2500 * time.Millisecond) // the outside call: no connection held
			return idem.Step(ctx, "write", func(ctx context.Context, tx pgx.Tx) (string, error) {
				_, err := tx.Exec(ctx, `SELECT 1`)
				return "written", err
			})
		})
		leaseDone <- leaseResult{r, err}
	}()
	<-started

	stop := slowHoldersAndWaiters(t, ctx, direct, [3]*pgxpool.Pool{procA, procB, procC}, [3]*idem.Gate{gateA, gateB, gateC}, true)
	defer stop()
	lr := <-leaseDone
	t.Logf("DoLease of the untouched key L: %q %v", lr.r, lr.err)
	if lr.err != nil {
		t.Fatalf("DoLease of a key no other attempt touched failed: %v (its heartbeats waited for a PgBouncer server connection behind the duplicates' waits)", lr.err)
	}
}

// bouncerJob is the job of key in the sizing tests, through gate g.
func bouncerJob(key string, g *idem.Gate) idem.Job {
	return idem.Job{Principal: "p", Key: key, Action: "bouncer", Gate: g}
}

// slowHoldersAndWaiters starts, in process procs[0], two units of work on keys k1 and k2 that
// stay in their transactions until stop, and once both have claimed, a duplicate of k1 in
// procs[1] and one of k2 in procs[2], which wait on the keys' rows; with again, each claims again
// after every lock timeout (as the middleware's duplicates do until DuplicateWait) until stop.
// stop ends the holders and waits for every goroutine.
func slowHoldersAndWaiters(t *testing.T, ctx context.Context, direct *pgx.Conn, procs [3]*pgxpool.Pool, gates [3]*idem.Gate, again bool) (stop func()) {
	t.Helper()
	release := make(chan struct{})
	var wg sync.WaitGroup
	for _, k := range []string{"k1", "k2"} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, _, err := idem.Do(ctx, procs[0], bouncerJob(k, gates[0]), idem.TxOptions{}, func(ctx context.Context, tx pgx.Tx) (string, error) {
				<-release // slow work in the request's transaction
				return "done", nil
			})
			if err != nil {
				t.Errorf("holder %s: %v", k, err)
			}
		}()
	}
	stop = func() { close(release); wg.Wait() }
	// Both claims made: two transactions idle after the claim's savepoint.
	pgtest.WaitFor(t, direct, `SELECT count(*) - 1 FROM pg_stat_activity WHERE datname = current_database()
		AND state = 'idle in transaction' AND query LIKE 'SAVEPOINT idem_claim%'`)
	for i, key := range []string{"k1", "k2"} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				_, _, _ = idem.Do(ctx, procs[i+1], bouncerJob(key, gates[i+1]), idem.TxOptions{}, func(ctx context.Context, tx pgx.Tx) (string, error) {
					return "dup", nil
				})
				select {
				case <-release:
					return
				default:
				}
				if !again || ctx.Err() != nil {
					return
				}
			}
		}()
	}
	return stop
}

package dbidem_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/internal/dbidem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestThirdInLineForAKeyRowWaits (review finding): three processes (three Gates) and one key
// whose answer expired. A re-claims it and works (idem_begin's UPDATE, uncommitted: A holds
// the row); B's duplicate waits on the row; C's duplicate queues behind B on the row's tuple
// lock, and a timeout there has no "while locking tuple (x,y)" context line. C was told the key
// table is locked (ErrStoreBusy, 503) within about 90 ms; it must wait for A's answer and
// replay it.
func TestThirdInLineForAKeyRowWaits(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 8)
	thirdInLine(t, pool, "third")
}

// thirdInLine runs the three processes of TestThirdInLineForAKeyRowWaits on pool's database.
func thirdInLine(t *testing.T, pool *pgxpool.Pool, key string) {
	t.Helper()
	thirdInLineSeen(t, pool, key, "pg_stat_activity")
}

// thirdInLineSeen is thirdInLine with the sessions' waits read from activity (a view with
// pg_stat_activity's columns: citus_stat_activity on Citus, whose waits are on the workers).
func thirdInLineSeen(t *testing.T, pool *pgxpool.Pool, key, activity string) {
	t.Helper()
	ctx := context.Background()
	c := claim(key, `{}`)
	c.LockTimeout = 3 * time.Second
	if err := dbidem.NewGate(dbidem.GateOptions{}).Run(ctx, pool, dbidem.TxOptions{}, c, func(tx *dbidem.Tx, d dbidem.Decision) error {
		tx.CompleteOnCommit(dbidem.Response{Status: 201, Body: []byte("first")})
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, pool, `UPDATE idem.idempotency_keys SET expires_at = now() - interval '1 hour',
		lease_expires_at = now() - interval '1 hour' WHERE key = $1`, key)

	// A: the re-claim of the expired key, held until C waits.
	aClaimed, release := make(chan struct{}), make(chan struct{})
	aDone := make(chan error, 1)
	go func() {
		aDone <- dbidem.NewGate(dbidem.GateOptions{}).Run(ctx, pool, dbidem.TxOptions{}, c, func(tx *dbidem.Tx, d dbidem.Decision) error {
			if d.Outcome != dbidem.Claimed {
				return errors.New("A: " + string(d.Outcome))
			}
			close(aClaimed)
			<-release
			tx.CompleteOnCommit(dbidem.Response{Status: 201, Body: []byte("A")})
			return nil
		})
	}()
	select {
	case <-aClaimed:
	case err := <-aDone:
		t.Fatalf("A: %v", err)
	}
	defer func() {
		select {
		case <-release:
		default:
			close(release)
		}
	}()
	waiters := `SELECT (count(*) >= $1)::int FROM ` + activity + ` WHERE datname = current_database() AND wait_event_type = 'Lock'
		AND query LIKE '%idem_begin%' AND pid <> pg_backend_pid()`
	// B: a duplicate in another process, waiting on the row.
	bDone := make(chan error, 1)
	var bGot dbidem.Decision
	go func() {
		bDone <- dbidem.NewGate(dbidem.GateOptions{}).Run(ctx, pool, dbidem.TxOptions{}, c, func(_ *dbidem.Tx, d dbidem.Decision) error {
			bGot = d
			return nil
		})
	}()
	pgtest.WaitFor(t, pool, waiters, 1)
	// C: a duplicate in a third process, queued behind B.
	cDone := make(chan error, 1)
	var cGot dbidem.Decision
	go func() {
		cDone <- dbidem.NewGate(dbidem.GateOptions{}).Run(ctx, pool, dbidem.TxOptions{}, c, func(_ *dbidem.Tx, d dbidem.Decision) error {
			cGot = d
			return nil
		})
	}()
	// Both wait, on the row; C's probe (5 ms) has timed out by now, and C waits on.
	pgtest.WaitFor(t, pool, waiters, 2)
	time.Sleep(200 * time.Millisecond)
	select {
	case err := <-cDone:
		var pgErr *pgconn.PgError
		where := ""
		if errors.As(err, &pgErr) {
			where = pgErr.Where
		}
		t.Fatalf("C, queued on a held key's row, returned before its answer: %v (%s); the 55P03's context: %q", err, cGot.Outcome, where)
	default:
	}
	close(release)
	if err := <-aDone; err != nil {
		t.Fatalf("A: %v", err)
	}
	for name, r := range map[string]struct {
		err error
		d   *dbidem.Decision
	}{"B": {<-bDone, &bGot}, "C": {<-cDone, &cGot}} {
		if r.err != nil || r.d.Outcome != dbidem.Replay || string(r.d.Response.Body) != "A" {
			t.Errorf("%s: %v %q %q, want A's answer replayed", name, r.err, r.d.Outcome, r.d.Response.Body)
		}
	}
}

// TestLockedTableIsNoKeyWaitForAnExpiredKey: the locking read of an expired key's row is a
// key wait when it times out, but a table locked against reads stops the claim before it (at
// its first read), and that stays ErrStoreBusy, answered at once.
func TestLockedTableIsNoKeyWaitForAnExpiredKey(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 4)
	ctx := context.Background()
	c := claim("locked", `{}`)
	if err := dbidem.NewGate(dbidem.GateOptions{}).Run(ctx, pool, dbidem.TxOptions{}, c, func(tx *dbidem.Tx, d dbidem.Decision) error {
		tx.CompleteOnCommit(dbidem.Response{Status: 201})
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, pool, `UPDATE idem.idempotency_keys SET expires_at = now() - interval '1 hour',
		lease_expires_at = now() - interval '1 hour' WHERE key = 'locked'`)
	locker, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = locker.Rollback(ctx) }()
	pgtest.Exec(t, locker, `LOCK TABLE idem.idempotency_keys IN ACCESS EXCLUSIVE MODE`)
	start := time.Now()
	gate := dbidem.NewGate(dbidem.GateOptions{})
	err = gate.Run(ctx, pool, dbidem.TxOptions{}, c, func(*dbidem.Tx, dbidem.Decision) error {
		return errors.New("the claim ran under a table lock")
	})
	if !errors.Is(err, dbidem.ErrStoreBusy) || dbidem.IsKeyWait(err) || time.Since(start) > time.Second {
		t.Fatalf("a claim of an expired key under a locked table: %v after %s, want ErrStoreBusy at once", err, time.Since(start))
	}
	// Refused counts duplicates told the key is in progress without waiting on the database
	// (the middleware's 409s); a locked table is ErrStoreBusy (its 503), which the
	// middleware never counted there, and a bare Gate counted (D274).
	if n := gate.Refused(); n != 0 {
		t.Errorf("the Gate counted %d refused for a locked table, want 0", n)
	}
}

// TestEndedDuringTableBusyPausesIsNotInProgress (review finding): a caller whose context ends
// while the Gate pauses between probes of a locked key table gets its context's error, never
// ErrInProgress: no key was in progress, and a job runner snoozes on that.
func TestEndedDuringTableBusyPausesIsNotInProgress(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 4)
	ctx := context.Background()
	locker, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = locker.Rollback(ctx) }()
	pgtest.Exec(t, locker, `LOCK TABLE idem.idempotency_keys IN ACCESS EXCLUSIVE MODE`)
	g := dbidem.NewGate(dbidem.GateOptions{})
	for i := range 12 {
		deadline := time.Duration(10+5*i) * time.Millisecond
		cctx, cancel := context.WithTimeout(ctx, deadline)
		err := g.Run(cctx, pool, dbidem.TxOptions{}, claim(fmt.Sprintf("busy-%d", i), `{}`), func(*dbidem.Tx, dbidem.Decision) error {
			return errors.New("ran under a locked table")
		})
		cancel()
		if err == nil || errors.Is(err, dbidem.ErrInProgress) {
			t.Errorf("a claim whose context ended after %s while the key table was locked: %v, want its context's error or ErrStoreBusy", deadline, err)
		}
	}
}

// TestExclusiveTableLockIsStoreBusyForExpiredKeysToo (D275): LOCK TABLE ... IN EXCLUSIVE MODE
// (reads pass) is a locked table for every claim. It was the documented exception: the claim
// of an expired key on a connection that had run idem_begin's locking read before got as far
// as that read and waited there as for a key (ErrInProgress after its whole lock timeout, with
// a wait slot). idem_begin now waits for a writer of a row due for a write with its INSERT
// first, which meets the table's lock as a fresh key's claim does: ErrStoreBusy at once.
func TestExclusiveTableLockIsStoreBusyForExpiredKeysToo(t *testing.T) {
	t.Parallel()
	pool, url := pgtest.NewPool(t, 1)
	admin := pgtest.Connect(t, url)
	ctx := context.Background()
	expired := func(key string) dbidem.Claim {
		c := claim(key, `{}`)
		if err := dbidem.NewGate(dbidem.GateOptions{}).Run(ctx, pool, dbidem.TxOptions{}, c, func(tx *dbidem.Tx, d dbidem.Decision) error {
			tx.CompleteOnCommit(dbidem.Response{Status: 201})
			return nil
		}); err != nil {
			t.Fatal(err)
		}
		pgtest.Exec(t, admin, `UPDATE idem.idempotency_keys SET expires_at = now() - interval '1 hour',
			lease_expires_at = now() - interval '1 hour' WHERE key = $1`, key)
		return c
	}
	run := func(c dbidem.Claim, lockTimeout time.Duration) (time.Duration, error) {
		c.LockTimeout = lockTimeout
		start := time.Now()
		err := dbidem.NewGate(dbidem.GateOptions{}).Run(ctx, pool, dbidem.TxOptions{}, c, func(tx *dbidem.Tx, d dbidem.Decision) error {
			if d.Outcome != dbidem.Claimed {
				return errors.New(string(d.Outcome))
			}
			tx.CompleteOnCommit(dbidem.Response{Status: 201})
			return nil
		})
		return time.Since(start), err
	}
	// The pool's one connection runs the locking read once (the re-claim of an expired key).
	if _, err := run(expired("warm"), 600*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	c := expired("exclusive")
	pgtest.Exec(t, admin, `BEGIN; LOCK TABLE idem.idempotency_keys IN EXCLUSIVE MODE`)
	// a lock timeout of 4 s, which "at once" is told from with room for a loaded machine
	if took, err := run(c, 4*time.Second); !errors.Is(err, dbidem.ErrStoreBusy) || dbidem.IsKeyWait(err) || took > 2*time.Second {
		t.Errorf("an expired key under an EXCLUSIVE table lock: %v after %s, want ErrStoreBusy at once", err, took)
	}
	if took, err := run(claim("exclusive-fresh", `{}`), 4*time.Second); !errors.Is(err, dbidem.ErrStoreBusy) || took > 2*time.Second {
		t.Errorf("a fresh key under an EXCLUSIVE table lock: %v after %s, want ErrStoreBusy at once", err, took)
	}
	pgtest.Exec(t, admin, `ROLLBACK`)
}

package dbidem_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgidem/pgidem/internal/dbidem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestEndedWaitCancelsNoLaterStatement: when a claim's wait context ends (the client left, a
// shutdown began) while its claim statement waits on the key's row lock, the gate cancels the
// statement with a cancel request, which the server acts on whenever it arrives. The gate must
// not let the connection go on before that request is through: otherwise it lands on whatever
// the connection runs next, the work's next statement or, once the connection is back in the
// pool, another request's. Here each key's row is held by another transaction, the claim's
// wait on it ends by its lock timeout about when its wait context ends (a little before or
// after, round by round), the pool has one connection, and the statement run on it right after
// the unit of work must not be cancelled.
func TestEndedWaitCancelsNoLaterStatement(t *testing.T) {
	t.Parallel()
	pool, url := pgtest.NewPool(t, 1)
	ctx := context.Background()
	holder, err := pgtest.Connect(t, url).Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = holder.Rollback(ctx) }()
	gate := dbidem.NewGate(dbidem.GateOptions{})
	cancelled := 0
	for i := range 60 {
		c := claim(fmt.Sprintf("k%d", i), `{}`)
		if _, err := dbidem.Begin(ctx, holder, c); err != nil {
			t.Fatal(err)
		}
		c.LockTimeout = dbidem.Probe + 20*time.Millisecond
		ended, cancel := context.WithTimeout(ctx, dbidem.Probe+time.Duration(10+i%20)*time.Millisecond)
		err := gate.RunDetached(ended, ctx, pool, dbidem.TxOptions{}, c, 0,
			func(*dbidem.Tx, dbidem.Decision) error { return errors.New("claimed a key another transaction holds") })
		cancel()
		if errors.Is(err, context.DeadlineExceeded) {
			cancelled++
		}
		if _, err := pool.Exec(ctx, `SELECT pg_sleep(0.005)`); err != nil {
			var pgErr *pgconn.PgError
			if errors.As(err, &pgErr) && pgErr.Code == "57014" {
				t.Fatalf("round %d: the statement after a unit of work whose wait had ended was cancelled: %v", i, err)
			}
			t.Fatalf("round %d: %v", i, err)
		}
	}
	if cancelled == 0 {
		t.Error("no claim's wait was ended by its wait context: the rounds did not reach the cancel request")
	}
}

// TestProbeRunsToItsEndWhenTheWaitHasEnded (D161): the wait context ends only waits on
// another holder of the key. A claim's first try (the probe) waits at most Probe on any lock
// and runs to its end: a fresh key is claimed and its work runs, where the probe used to be
// cancelled (a shutdown's drain turned every fresh claim under way into a false "in
// progress"). A trigger makes the fresh claim's INSERT take 300 ms, so that a cancel request
// would arrive while it runs. A key that another transaction holds is answered at once, without
// the wait on its row, and a locked table as a locked table, after its probes.
func TestProbeRunsToItsEndWhenTheWaitHasEnded(t *testing.T) {
	t.Parallel()
	pool, url := pgtest.NewPool(t, 2)
	ctx := context.Background()
	pgtest.Exec(t, pool, `CREATE FUNCTION public.slow_claim() RETURNS trigger LANGUAGE plpgsql AS
		$$BEGIN PERFORM pg_sleep(0.3); RETURN NEW; END$$`)
	pgtest.Exec(t, pool, `CREATE TRIGGER slow_claim BEFORE INSERT ON idem.idempotency_keys
		FOR EACH ROW EXECUTE FUNCTION public.slow_claim()`)
	gate := dbidem.NewGate(dbidem.GateOptions{})
	ended, cancel := context.WithCancel(ctx)
	cancel()
	complete := func(tx *dbidem.Tx, d dbidem.Decision) error {
		if d.Outcome != dbidem.Claimed {
			return fmt.Errorf("decision %s, want claimed", d.Outcome)
		}
		tx.CompleteOnCommit(dbidem.Response{Status: 201})
		return nil
	}
	if err := gate.RunDetached(ended, ctx, pool, dbidem.TxOptions{}, claim("fresh", `{}`), 0, complete); err != nil {
		t.Fatalf("a fresh claim whose wait context had ended: %v, want it claimed and completed", err)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem.idempotency_keys WHERE key = 'fresh' AND state = 'c' AND response_status = 201`); n != 1 {
		t.Fatalf("%d completed rows for the fresh key, want 1", n)
	}

	holder, err := pgtest.Connect(t, url).Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	c := claim("held", `{}`)
	if _, err := dbidem.Begin(ctx, holder, c); err != nil {
		t.Fatal(err)
	}
	c.LockTimeout = 5 * time.Second
	start := time.Now()
	err = gate.RunDetached(ended, ctx, pool, dbidem.TxOptions{}, c, 0, complete)
	if !errors.Is(err, context.Canceled) || !dbidem.IsKeyWait(err) || time.Since(start) > time.Second {
		t.Errorf("a key another transaction holds, the wait context ended: %v after %s, want context.Canceled and the probe's key wait at once",
			err, time.Since(start).Round(time.Millisecond))
	}
	_ = holder.Rollback(ctx)

	locker, err := pgtest.Connect(t, url).Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = locker.Rollback(ctx) }()
	pgtest.Exec(t, locker, `LOCK TABLE idem.idempotency_keys IN ACCESS EXCLUSIVE MODE`)
	err = gate.RunDetached(ended, ctx, pool, dbidem.TxOptions{}, claim("locked", `{}`), 0, complete)
	// The probes of a locked table are the first try's too: they run their pauses under the
	// work's context, and the claim is told the table is locked (TestTableBusyProbesOutliveTheirWait).
	if !errors.Is(err, dbidem.ErrStoreBusy) || errors.Is(err, dbidem.ErrInProgress) {
		t.Errorf("a locked key table, the wait context ended: %v, want ErrStoreBusy, not ErrInProgress", err)
	}
}

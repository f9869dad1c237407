package dbidem_test

import (
	"context"
	"encoding/json"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/internal/canon"
	"github.com/pgidem/pgidem/internal/dbidem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestStepResumes: DoLease's work in three steps fails after the second; the retry (the lease
// was yielded) is told the two steps, skips them (their writes happened once) and gets what
// they saved; the third runs once, and the answer clears the steps. A new generation (the key
// released) runs every step again.
func TestStepResumes(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 6)
	ctx := context.Background()
	pgtest.Exec(t, pool, `CREATE TABLE effects (step text, note text)`)
	job := dbidem.Job{Principal: "p", Key: "steps-1", Action: "order", Input: map[string]int{"amount": 7}, Lease: 5 * time.Second}
	insert := func(step string) func(ctx context.Context, tx pgx.Tx) (string, error) {
		return func(ctx context.Context, tx pgx.Tx) (string, error) {
			_, err := tx.Exec(ctx, `INSERT INTO effects VALUES ($1, 'x')`, step)
			return step + "-id", err
		}
	}
	failAfter := "b"
	var points []string
	work := func(ctx context.Context, c dbidem.LeaseClaim) (string, error) {
		points = append(points, c.RecoveryPoint)
		a, err := dbidem.Step(ctx, "a", insert("a"))
		if err != nil {
			return "", err
		}
		b, err := dbidem.Step(ctx, "b", insert("b"))
		if err != nil {
			return "", err
		}
		if failAfter == "b" {
			return "", errors.New("the provider failed")
		}
		cc, err := dbidem.Step(ctx, "c", insert("c"))
		return a + "," + b + "," + cc, err
	}
	if _, _, err := dbidem.DoLease(ctx, pool, job, work); err == nil || err.Error() != "the provider failed" {
		t.Fatalf("first run: %v, want the work's error", err)
	}
	failAfter = ""
	got, replayed, err := dbidem.DoLease(ctx, pool, job, work)
	if err != nil || replayed || got != "a-id,b-id,c-id" {
		t.Fatalf("the retry: %q %v %v, want a-id,b-id,c-id from the saved values", got, replayed, err)
	}
	if len(points) != 2 || points[0] != "" || points[1] != "b" {
		t.Fatalf("recovery points seen: %q, want [\"\" \"b\"]", points)
	}
	counts := func() string {
		var s string
		if err := pool.QueryRow(ctx, `SELECT string_agg(step || '=' || n, ',' ORDER BY step) FROM
			(SELECT step, count(*) AS n FROM effects GROUP BY step) s`).Scan(&s); err != nil {
			t.Fatal(err)
		}
		return s
	}
	if c := counts(); c != "a=1,b=1,c=1" {
		t.Fatalf("effects %s, want each step once", c)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem.idempotency_keys WHERE key = 'steps-1' AND recovery_saved IS NULL AND state = 'c'`); n != 1 {
		t.Fatal("the answer did not clear the steps")
	}

	// A new generation: the same work, every step again.
	job.Key = "steps-2"
	failAfter = "b"
	_, _, _ = dbidem.DoLease(ctx, pool, job, work)
	var attempt int64
	if err := pool.QueryRow(ctx, `SELECT attempt FROM idem.idempotency_keys WHERE key = 'steps-2'`).Scan(&attempt); err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, pool, `UPDATE idem.idempotency_keys SET lease_expires_at = now() + interval '1 minute' WHERE key = 'steps-2'`)
	if ok, err := dbidem.Release(ctx, pool, "p", "steps-2", attempt); err != nil || !ok {
		t.Fatalf("release: %v %v", ok, err)
	}
	failAfter = ""
	if _, _, err := dbidem.DoLease(ctx, pool, job, work); err != nil {
		t.Fatal(err)
	}
	if c := counts(); c != "a=3,b=3,c=2" {
		t.Fatalf("effects %s, want a and b twice more (a failed generation, then a new one), c once more", c)
	}

	// Outside a lease's work, Step refuses.
	if _, err := dbidem.Step(ctx, "x", insert("x")); !errors.Is(err, dbidem.ErrNoSteps) {
		t.Fatalf("Step outside a lease: %v, want ErrNoSteps", err)
	}
}

// TestStepFenceRowLock proves both orders of a step's transaction and a takeover, with real
// row locks on two connections: a takeover that comes while a step's transaction holds its
// recovery point waits for it (pg_stat_activity says so) and is then told the step; a step
// whose claim a takeover got first is refused (ErrClaimLost) and its writes roll back.
func TestStepFenceRowLock(t *testing.T) {
	t.Parallel()
	pool, url := pgtest.NewPool(t, 4)
	ctx := context.Background()
	pgtest.Exec(t, pool, `CREATE TABLE effects (step text)`)
	holder := pgtest.Connect(t, url)
	taker := pgtest.Connect(t, url)
	c := claim("fence", `{"amount":1}`)
	c.Lease = time.Minute
	d, err := dbidem.Begin(ctx, pool, c)
	if err != nil || d.Outcome != dbidem.Claimed {
		t.Fatalf("claim: %+v %v", d, err)
	}

	// 1. The lease has run out; the step's transaction records its point first and a
	// takeover comes: it waits on the row lock, and once the step commits it is told the step.
	// (The lease runs out first: the test's UPDATE would wait on the step's row lock.)
	pgtest.Exec(t, pool, `UPDATE idem.idempotency_keys SET lease_expires_at = now() - interval '1 s' WHERE key = 'fence'`)
	tx, err := holder.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, tx, `INSERT INTO effects VALUES ('reserve')`)
	if err := dbidem.RecordStep(ctx, tx, c.Principal, c.Key, d.Attempt, "reserve", json.RawMessage(`{"id":9}`)); err != nil {
		t.Fatal(err)
	}
	var takerPID uint32 = taker.PgConn().PID()
	type result struct {
		d   dbidem.Decision
		err error
	}
	got := make(chan result, 1)
	go func() {
		c2 := c
		c2.LockTimeout = 10 * time.Second
		d2, err := dbidem.Begin(ctx, taker, c2)
		got <- result{d2, err}
	}()
	pgtest.WaitUntilBlocked(t, pool, takerPID)
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	r := <-got
	if r.err != nil || r.d.Outcome != dbidem.Claimed || r.d.RecoveryPoint != "reserve" || string(r.d.Steps["reserve"]) != `{"id": 9}` {
		t.Fatalf("the takeover after the step: %+v %v, want claimed, told reserve and its value", r.d, r.err)
	}

	// 2. The old holder's next step: its transaction writes, the takeover has committed, the
	// recovery point is refused and the writes roll back.
	tx, err = holder.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, tx, `INSERT INTO effects VALUES ('settle')`)
	err = dbidem.RecordStep(ctx, tx, c.Principal, c.Key, d.Attempt, "settle", nil)
	if !errors.Is(err, dbidem.ErrClaimLost) {
		t.Fatalf("a step of the holder taken over: %v, want ErrClaimLost", err)
	}
	_ = tx.Rollback(ctx)
	// The new holder records it; recording it twice is refused.
	if err := dbidem.RecordStep(ctx, pool, c.Principal, c.Key, r.d.Attempt, "settle", nil); err != nil {
		t.Fatal(err)
	}
	if err := dbidem.RecordStep(ctx, pool, c.Principal, c.Key, r.d.Attempt, "settle", nil); !errors.Is(err, dbidem.ErrStepRecorded) {
		t.Fatalf("a step recorded twice: %v, want ErrStepRecorded", err)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM effects WHERE step = 'settle'`); n != 0 {
		t.Fatalf("the refused step's write committed (%d rows)", n)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM effects WHERE step = 'reserve'`); n != 1 {
		t.Fatalf("reserve has %d rows, want 1", n)
	}
}

// TestStepLosesLease: a takeover while DoLease's work runs: the work's next Step is refused,
// its writes roll back, the lease counts as lost (DoLease returns ErrLeaseLost) and nothing of
// the work is stored.
func TestStepLosesLease(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 6)
	ctx := context.Background()
	pgtest.Exec(t, pool, `CREATE TABLE effects (step text)`)
	job := dbidem.Job{Principal: "p", Key: "lost", Action: "order", Input: 1, Lease: 5 * time.Second}
	var stepErr error
	_, _, err := dbidem.DoLease(ctx, pool, job, func(ctx context.Context, c dbidem.LeaseClaim) (int, error) {
		pgtest.Exec(t, pool, `UPDATE idem.idempotency_keys SET lease_expires_at = now() - interval '1 s' WHERE key = 'lost'`)
		fp := canon.Compute("DO", "order", []byte("1")) // DoLease's fingerprint of the job
		other := dbidem.Claim{Principal: "p", Key: "lost", Action: "order", Fingerprint: fp.Sum, Fields: fp.Fields, Lease: 5 * time.Second}
		if d, err := dbidem.Begin(ctx, pool, other); err != nil || d.Outcome != dbidem.Claimed {
			t.Errorf("takeover: %+v %v", d, err)
		}
		_, stepErr = dbidem.Step(ctx, "reserve", func(ctx context.Context, tx pgx.Tx) (int, error) {
			_, err := tx.Exec(ctx, `INSERT INTO effects VALUES ('reserve')`)
			return 1, err
		})
		return 1, stepErr
	})
	if !errors.Is(stepErr, dbidem.ErrLeaseLost) || !errors.Is(stepErr, dbidem.ErrClaimLost) {
		t.Fatalf("Step after a takeover: %v, want ErrLeaseLost and ErrClaimLost", stepErr)
	}
	if !errors.Is(err, dbidem.ErrLeaseLost) {
		t.Fatalf("DoLease: %v, want ErrLeaseLost", err)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM effects`); n != 0 {
		t.Fatalf("the refused step's write committed (%d rows)", n)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem.idempotency_keys WHERE key = 'lost' AND state = 'p'`); n != 1 {
		t.Fatal("the lost work's answer was stored")
	}
}

package dbidem_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/internal/dbidem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestStepCommitLostFreesTheKey: a step's COMMIT lost on the way (the connection stops
// answering right after idem_step's reply) left the server's transaction idle, holding the
// key's row that idem_step locked, with no bound but the server's TCP stack (hours with its
// defaults): the holder's lease ran out, and every retry of the work was told "in progress"
// (55P03) meanwhile, with nothing written. The step's transaction is now bounded idle as a
// lease claim's own is (5 s): the server ends it, the step's writes roll back, and a retry
// takes the key over and does the step once. D254; on the previous code the retry was still
// refused 15 s after the COMMIT was lost.
func TestStepCommitLostFreesTheKey(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	direct, url := pgtest.NewPool(t, 4)
	pgtest.Exec(t, direct, `CREATE TABLE reserves (attempt bigint)`)
	p := pgtest.NewProxy(t, pgtest.TCPAddr(t))
	proxied, err := pgxpool.New(ctx, pgtest.Via(t, url, p.Addr)+" pool_max_conns=4")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(proxied.Close)
	job := dbidem.Job{Principal: "alice", Key: "hole", Action: "payout", Input: map[string]int{"amount": 7},
		Lease: 2 * time.Second, TTL: time.Hour, LockTimeout: 300 * time.Millisecond}
	work := func(hole bool) func(ctx context.Context, c dbidem.LeaseClaim) (string, error) {
		return func(ctx context.Context, c dbidem.LeaseClaim) (string, error) {
			return dbidem.Step(ctx, "reserve", func(ctx context.Context, tx pgx.Tx) (string, error) {
				if _, err := tx.Exec(ctx, `INSERT INTO reserves VALUES ($1)`, c.Attempt); err != nil {
					return "", err
				}
				if hole {
					p.CommitHole.Store(true) // the step's COMMIT, and all after it, is swallowed
				}
				return "reserved", nil
			})
		}
	}
	aDone := make(chan error, 1)
	go func() {
		_, _, err := dbidem.DoLease(ctx, proxied, job, work(true))
		aDone <- err
	}()
	// The step's statements are in; its COMMIT is swallowed: the server's transaction is idle,
	// holding the key's row.
	pgtest.WaitFor(t, direct, `SELECT count(*) FROM pg_stat_activity
		WHERE datname = current_database() AND state = 'idle in transaction' AND query LIKE '%jsonb::text%'`)
	lost := time.Now()
	var got string
	for {
		v, _, err := dbidem.DoLease(ctx, direct, job, work(false))
		if err == nil {
			got = v
			break
		}
		if !errors.Is(err, dbidem.ErrInProgress) {
			t.Fatalf("a retry: %v; want ErrInProgress until the key is free, then the work", err)
		}
		if time.Since(lost) > 15*time.Second {
			t.Fatalf("a retry is still refused (%v) %s after the step's COMMIT was lost: the server's transaction holds the key's row",
				err, time.Since(lost).Round(time.Millisecond))
		}
		time.Sleep(250 * time.Millisecond)
	}
	t.Logf("the retry did the work %s after the step's COMMIT was lost", time.Since(lost).Round(time.Millisecond))
	if got != "reserved" {
		t.Errorf("the retry's result %q, want reserved", got)
	}
	if n := pgtest.Count(t, direct, `SELECT count(*) FROM reserves`); n != 1 {
		t.Errorf("%d reserves, want 1: the lost COMMIT's step rolled back, the retry's committed", n)
	}
	p.CommitHole.Store(false)
	select {
	case err := <-aDone:
		if err == nil {
			t.Errorf("the attempt whose step's COMMIT was lost returned no error")
		}
	case <-time.After(20 * time.Second):
		t.Errorf("the attempt whose step's COMMIT was lost did not return")
	}
}

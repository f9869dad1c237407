package idem_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestStepsCallingOutDoNotStarveThePool: a step whose fn calls a provider first (the pattern
// the docs give, with the provider key) held a connection of the pool from before fn ran. When
// the call needs a connection of the same pool (the reference server's simulated provider
// does, and so would a service that records its outgoing calls), as many such steps as the pool
// has connections each held one and waited for another: nothing moved until the leases were
// lost. A step takes its connection when fn first sends a statement, or to record the step.
func TestStepsCallingOutDoNotStarveThePool(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	const size = 3
	pool, _ := pgtest.NewPool(t, size)
	pgtest.Exec(t, pool, `CREATE TABLE provider_calls (key text PRIMARY KEY)`)
	provider := func(ctx context.Context, key string) (string, error) {
		// Its own connection of the same pool, held through the provider's delay.
		conn, err := pool.Acquire(ctx)
		if err != nil {
			return "", err
		}
		defer conn.Release()
		if _, err := conn.Exec(ctx, `INSERT INTO provider_calls VALUES ($1) ON CONFLICT DO NOTHING`, key); err != nil {
			return "", err
		}
		time.Sleep(200 * time.Millisecond)
		return "ref-" + key[:8], nil
	}
	var wg sync.WaitGroup
	errs := make([]error, 2*size)
	began := time.Now()
	for i := range errs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			job := idem.Job{Principal: "alice", Key: "pay-" + string(rune('a'+i)), Action: "pay", Lease: 2 * time.Second}
			_, _, errs[i] = idem.DoLease(ctx, pool, job, func(ctx context.Context, c idem.LeaseClaim) (string, error) {
				return idem.Step(ctx, "pay", func(ctx context.Context, _ pgx.Tx) (string, error) {
					return provider(ctx, c.ProviderKey)
				})
			})
		}()
	}
	wg.Wait()
	took := time.Since(began)
	for i, err := range errs {
		if err != nil {
			t.Errorf("job %d: %v", i, err)
		}
	}
	// 6 calls of 200 ms on 3 connections take about 400 ms; a starved pool waits out the
	// leases (2 s) and fails.
	if took > 1500*time.Millisecond {
		t.Errorf("%d steps calling a provider that shares a pool of %d took %v", len(errs), size, took.Round(time.Millisecond))
	}
	if n := pgtest.Count(t, pool, `SELECT count(*)::int FROM provider_calls`); n != len(errs) {
		t.Errorf("%d provider calls recorded, want %d", n, len(errs))
	}
}

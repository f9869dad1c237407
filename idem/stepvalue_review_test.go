package idem_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

type svProviderAnswer struct {
	ID      string   `json:"id,omitempty"`
	Refunds []string `json:"refunds,omitempty"`
}

// TestStepValueEmptyOmittedSlice: a step calls a provider (counted) and saves its answer,
// decoded into a struct whose only set field is an empty list tagged omitempty (what a JSON
// decoder gives for "refunds": []). D195's first check refused it as "exports none of its
// fields", so the step was never recorded: every attempt of the job called the provider again
// and failed again. Asserts the first DoLease succeeds and the provider is called once over two
// calls.
func TestStepValueEmptyOmittedSlice(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	var calls atomic.Int32
	run := func() error {
		_, _, err := idem.DoLease(ctx, pool, idem.Job{Principal: "alice", Key: "step-empty", Action: "pay", Lease: 5 * time.Second},
			func(ctx context.Context, claim idem.LeaseClaim) (int, error) {
				_, err := idem.Step(ctx, "provider", func(ctx context.Context, tx pgx.Tx) (svProviderAnswer, error) {
					calls.Add(1) // the provider's call
					return svProviderAnswer{Refunds: []string{}}, nil
				})
				return 1, err
			})
		return err
	}
	err1 := run()
	err2 := run()
	if err1 != nil || calls.Load() != 1 {
		t.Fatalf("first DoLease: %v; second: %v; the provider was called %d times; want success and one call", err1, err2, calls.Load())
	}
}

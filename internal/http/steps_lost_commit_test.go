package idemhttp_test

import (
	"context"
	"encoding/json"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/internal/dbidem"
)

// TestStepLostCommitThenRecordedGetsTheStoredForm: docs/http.md (D203): "Every attempt
// gets that stored form, the one that ran the step too, so a json.RawMessage or a json.Number
// is the same in every attempt." A step whose COMMIT's reply is lost (ErrCommitUnknown) and
// that is asked for again once the COMMIT landed returns through Steps.recorded
// (recovery_saved -> name); its value must be jsonb's form, as on every other path, and fn
// must not run again.
func TestStepLostCommitThenRecordedGetsTheStoredForm(t *testing.T) {
	t.Parallel()
	const lease = 20 * time.Second
	z := newGapApp(t, lease, nil)
	hold := z.proxy.rule("commit\x00", gapHoldRequest)
	job := gapJob("step-raw-lost-reply", lease)
	const value = `{"b":1,"a":[1e+21,2]}`
	var stored string
	if err := z.direct.QueryRow(context.Background(), `SELECT $1::jsonb::text`, value).Scan(&stored); err != nil {
		t.Fatal(err)
	}
	var runs atomic.Int32
	stepFn := func(ctx context.Context, tx pgx.Tx) (json.RawMessage, error) {
		runs.Add(1)
		return json.RawMessage(value), nil
	}
	var first, third error
	var got, again json.RawMessage
	_, _, err := dbidem.DoLease(context.Background(), z.proxied, job, func(ctx context.Context, c dbidem.LeaseClaim) (int, error) {
		hold.arm(1)
		sctx, cancel := context.WithTimeout(ctx, time.Second)
		_, first = dbidem.Step(sctx, "raw", stepFn)
		cancel()
		hold.free()
		for range 50 {
			got, third = dbidem.Step(ctx, "raw", stepFn)
			if !errors.Is(third, dbidem.ErrCommitUnknown) {
				break
			}
			time.Sleep(100 * time.Millisecond)
		}
		if third != nil {
			return 0, third
		}
		again, third = dbidem.Step(ctx, "raw", stepFn)
		return 1, third
	})
	hold.free()
	if !errors.Is(first, dbidem.ErrCommitUnknown) {
		t.Fatalf("the first Step did not end with ErrCommitUnknown (%v): the scenario did not happen", first)
	}
	if err != nil || third != nil || runs.Load() != 1 {
		t.Fatalf("after the lost COMMIT landed: DoLease %v, Step %v, fn runs %d; want fn run once", err, third, runs.Load())
	}
	if string(got) != stored || string(again) != stored {
		t.Errorf("the step's value read back after a lost COMMIT: %s, then %s; want jsonb's form %s on every path", got, again, stored)
	}
}

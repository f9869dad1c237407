package idem_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestStepFnsOwnClaimLostIsFns (D269): a step's fn that fails with an error wrapping
// idem.ErrClaimLost of its own (idem.Complete of another key's claim) made Step take this
// job's lease for lost: every later Step failed, DoLease returned ErrLeaseLost instead of the
// result, and the key stayed in progress, not given up, until its lease ran out. It is fn's
// failure, returned as it is, and the lease stands.
func TestStepFnsOwnClaimLostIsFns(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 8)
	job := idem.Job{Principal: "p", Key: "k", Action: "a", Lease: 30 * time.Second}
	childErr := fmt.Errorf("the child job's claim: %w", idem.ErrClaimLost)
	var e1, e2 error
	got, _, err := idem.DoLease(ctx, pool, job, func(ctx context.Context, c idem.LeaseClaim) (string, error) {
		_, e1 = idem.Step(ctx, "child", func(context.Context, pgx.Tx) (int, error) { return 0, childErr })
		_, e2 = idem.Step(ctx, "next", func(context.Context, pgx.Tx) (int, error) { return 2, nil })
		return "done", e2
	})
	if !errors.Is(e1, childErr) || errors.Is(e1, idem.ErrLeaseLost) {
		t.Errorf("the step whose fn failed: %v; want fn's error as it is, not ErrLeaseLost", e1)
	}
	if e2 != nil || err != nil || got != "done" {
		t.Fatalf("the next step: %v; DoLease: %q %v; want both to go on", e2, got, err)
	}
	again, replayed, err := idem.DoLease(ctx, pool, job, func(context.Context, idem.LeaseClaim) (string, error) { return "rerun", nil })
	if err != nil || !replayed || again != "done" {
		t.Errorf("a retry right after: %q replayed %v, %v; want the stored result", again, replayed, err)
	}
}

// TestStepUnderATakeoverSaysLeaseLost (D269): when the heartbeat finds the claim taken over
// while a step's fn runs, fn's context ends and its statement fails with context.Canceled;
// Step returned that as it was, neither ErrLeaseLost nor ErrClaimLost, though DoLease said
// ErrLeaseLost. It says what every later Step says now.
func TestStepUnderATakeoverSaysLeaseLost(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, url := pgtest.NewPool(t, 8)
	admin := pgtest.Connect(t, url)
	job := idem.Job{Principal: "p", Key: "k", Action: "a", Lease: time.Second}
	var stepErr error
	_, _, err := idem.DoLease(ctx, pool, job, func(ctx context.Context, c idem.LeaseClaim) (int, error) {
		_, stepErr = idem.Step(ctx, "s", func(sctx context.Context, tx pgx.Tx) (int, error) {
			// The lease ran out and another process took the key over.
			if _, err := admin.Exec(ctx, `UPDATE idem.idempotency_keys SET lease_expires_at = clock_timestamp() - interval '1 second'`); err != nil {
				return 0, err
			}
			fp := idem.ComputeFingerprint("DO", job.Action, nil)
			if d, err := idem.Begin(ctx, admin, idem.Claim{Principal: job.Principal, Key: job.Key, Action: job.Action,
				Fingerprint: fp.Sum, Fields: fp.Fields, Lease: job.Lease}); err != nil || d.Outcome != idem.Claimed {
				return 0, fmt.Errorf("the takeover: %+v %v", d, err)
			}
			// The heartbeat (every third of the lease) finds it and ends the step's context.
			select {
			case <-sctx.Done():
			case <-time.After(5 * time.Second):
				return 0, errors.New("the step's context did not end within 5 s of the takeover")
			}
			_, err := tx.Exec(sctx, `SELECT 1`)
			return 1, err
		})
		return 0, stepErr
	})
	if !errors.Is(err, idem.ErrLeaseLost) {
		t.Fatalf("DoLease: %v; want ErrLeaseLost", err)
	}
	if !errors.Is(stepErr, idem.ErrLeaseLost) || !errors.Is(stepErr, idem.ErrClaimLost) {
		t.Errorf("the step whose claim was taken over: %v; want ErrLeaseLost and ErrClaimLost", stepErr)
	}
}

type d269Payout struct {
	ID   string          `json:"id"`
	Meta map[string]any  `json:"meta"`
	Raw  json.RawMessage `json:"raw"`
	Note string          `json:"-"` // not stored: no caller gets it
}

// TestDoReturnsTheStoredResultFirstToo (D269): Do and DoLease gave the first caller fn's
// value and every replay the value decoded from its JSON: an int in an interface came back a
// float64, a []string a []any, a json.RawMessage with other spacing (v.(int) worked on the
// first call and panicked on a replay). Every caller now gets the stored form.
func TestDoReturnsTheStoredResultFirstToo(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 8)
	fn := func() d269Payout {
		return d269Payout{ID: "po_1", Meta: map[string]any{"attempts": 1, "tags": []string{"eu"}}, Raw: json.RawMessage(`{"b": 1, "a":2.50}`),
			Note: "in-process"}
	}
	do := func(key string, lease time.Duration) (d269Payout, bool) {
		t.Helper()
		job := idem.Job{Principal: "p", Key: key, Action: "pay", Lease: lease}
		var v d269Payout
		var replayed bool
		var err error
		if lease == 0 {
			v, replayed, err = idem.Do(ctx, pool, job, idem.TxOptions{}, func(context.Context, pgx.Tx) (d269Payout, error) { return fn(), nil })
		} else {
			v, replayed, err = idem.DoLease(ctx, pool, job, func(context.Context, idem.LeaseClaim) (d269Payout, error) { return fn(), nil })
		}
		if err != nil {
			t.Fatal(err)
		}
		return v, replayed
	}
	for _, c := range []struct {
		name  string
		lease time.Duration
	}{{"do", 0}, {"dolease", 5 * time.Second}} {
		first, r1 := do(c.name, c.lease)
		again, r2 := do(c.name, c.lease)
		if r1 || !r2 {
			t.Fatalf("%s: replayed %v then %v", c.name, r1, r2)
		}
		if !reflect.DeepEqual(first, again) {
			t.Errorf("%s: the first call got %#v, its replay %#v; want one value", c.name, first, again)
		}
		if first.Note != "" {
			t.Errorf("%s: the first call's Note %q, a field JSON skips: no repeat can get it", c.name, first.Note)
		}
		if _, ok := first.Meta["attempts"].(float64); !ok {
			t.Errorf("%s: the first call's attempts is a %T, want the float64 every replay decodes", c.name, first.Meta["attempts"])
		}
	}
}

package idem_test

// Review of Job's fields: Input's fingerprint, and the bounds of the durations.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

type hiddenTransfer struct {
	to     string // unexported: JSON writes {}
	amount int64
}

// TestDoInputThatJSONDropsIsOneRequest: "Input ... is JSON-encoded and fingerprinted
// (canonical JSON), so the same key with another input is ErrMismatch." An Input whose JSON
// drops what it holds (a struct of unexported fields) fingerprints every value alike: another
// transfer under the key replays the first one's result, where the package refuses, for the
// same reason ("two inputs would fingerprint alike"), a string that is not UTF-8.

// TestDoInputThatJSONDropsIsRefused: an Input whose JSON holds nothing of it (a struct that
// exports none of its fields encodes as {}) fingerprinted every value alike: a second transfer
// to another account under the same key replayed the first one's result. It is
// ErrInvalidArgument before fn runs.
func TestDoInputThatJSONDropsIsRefused(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	ran := false
	_, _, err := idem.Do(ctx, pool, idem.Job{Principal: "alice", Key: "xfer-1", Action: "transfer", Input: hiddenTransfer{"bob", 100}},
		idem.TxOptions{}, func(context.Context, pgx.Tx) (string, error) { ran = true; return "sent", nil })
	if !errors.Is(err, idem.ErrInvalidArgument) || ran {
		t.Fatalf("an Input that encodes as {}: %v, fn ran %v; want ErrInvalidArgument before fn", err, ran)
	}
	// Its zero value, and a struct without fields, say all they hold: accepted.
	for i, in := range []any{hiddenTransfer{}, struct{}{}, &struct{}{}} {
		if _, _, err := idem.Do(ctx, pool, idem.Job{Principal: "alice", Key: fmt.Sprintf("empty-%d", i), Action: "transfer", Input: in},
			idem.TxOptions{}, func(context.Context, pgx.Tx) (string, error) { return "ok", nil }); err != nil {
			t.Errorf("Input %#v: %v", in, err)
		}
	}
}

// TestDoInputThatCannotEncode: an Input JSON cannot encode is refused before anything runs;
// like every other refused argument of Do ("a caller or configuration error, not a reason to
// retry"), as ErrInvalidArgument.
func TestDoInputThatCannotEncode(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	for _, in := range []any{math.NaN(), math.Inf(-1), make(chan int), map[[2]int]int{{1, 2}: 3}, badMarshal{}, json.RawMessage(`{`)} {
		var ran bool
		_, _, err := idem.Do(ctx, pool, idem.Job{Principal: "alice", Key: "in", Action: "a", Input: in}, idem.TxOptions{},
			func(context.Context, pgx.Tx) (int, error) { ran = true; return 0, nil })
		if ran || err == nil {
			t.Errorf("%T: ran %v err %v", in, ran, err)
			continue
		}
		if !errors.Is(err, idem.ErrInvalidArgument) {
			t.Errorf("input %T: %v: not ErrInvalidArgument", in, err)
		}
	}
}

// TestDoInputFingerprint: the same input written otherwise is the same request; another is
// ErrMismatch.
func TestDoInputFingerprint(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	runs := 0
	do := func(key string, in any) (int, bool, error) {
		return idem.Do(ctx, pool, idem.Job{Principal: "alice", Key: key, Action: "a", Input: in}, idem.TxOptions{},
			func(context.Context, pgx.Tx) (int, error) { runs++; return runs, nil })
	}
	same := []any{
		json.RawMessage(`{"a":1,"b":[1,2],"c":{"y":1,"x":2}}`),
		json.RawMessage(` { "c" : { "x" : 2.0, "y" : 1e0 }, "b" : [ 1 , 2 ] , "a" : 10e-1 } `),
		map[string]any{"c": map[string]int{"x": 2, "y": 1}, "b": []int{1, 2}, "a": 1.0},
		struct {
			B []int          `json:"b"`
			A int            `json:"a"`
			C map[string]int `json:"c"`
		}{[]int{1, 2}, 1, map[string]int{"y": 1, "x": 2}},
	}
	for i, in := range same {
		v, replayed, err := do("fp", in)
		if err != nil || v != 1 || (i > 0 && !replayed) {
			t.Errorf("form %d: %d %v %v", i, v, replayed, err)
		}
	}
	for i, in := range []any{
		json.RawMessage(`{"a":1,"b":[2,1],"c":{"y":1,"x":2}}`),
		json.RawMessage(`{"a":1,"b":[1,2],"c":{"y":1,"x":2},"d":null}`),
		json.RawMessage(`{"a":1.0000000000000001,"b":[1,2],"c":{"y":1,"x":2}}`),
		nil,
	} {
		if _, _, err := do("fp", in); !errors.Is(err, idem.ErrMismatch) {
			t.Errorf("other input %d: %v, want ErrMismatch", i, err)
		}
	}
	// nil, a typed nil and JSON null.
	var p *hiddenTransfer
	_, _, e1 := do("nil", nil)
	_, _, e2 := do("nil", p)
	_, _, e3 := do("nil", json.RawMessage(`null`))
	t.Logf("nil then typed nil: %v; then JSON null: %v", e2, e3)
	_ = e1
}

// TestDoJobDurations: the bounds of Job's durations.
func TestDoJobDurations(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	try := func(name string, job idem.Job, lease bool) error {
		job.Principal, job.Action = "alice", "a"
		job.Key = fmt.Sprintf("dur-%d", time.Now().UnixNano())
		var err error
		cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		if lease {
			_, _, err = idem.DoLease(cctx, pool, job, func(ctx context.Context, _ idem.LeaseClaim) (string, error) {
				dl, ok := ctx.Deadline()
				return fmt.Sprint(ok, time.Until(dl).Round(time.Minute)), nil
			})
		} else {
			_, _, err = idem.Do(cctx, pool, job, idem.TxOptions{}, func(context.Context, pgx.Tx) (int, error) { return 1, nil })
		}
		t.Logf("%s: %v", name, err)
		return err
	}
	if err := try("LockTimeout over MaxLockTimeout", idem.Job{LockTimeout: idem.MaxLockTimeout + time.Millisecond}, false); !errors.Is(err, idem.ErrInvalidArgument) {
		t.Errorf("LockTimeout over MaxLockTimeout: %v; want ErrInvalidArgument", err)
	}
	if err := try("LockTimeout MaxLockTimeout", idem.Job{LockTimeout: idem.MaxLockTimeout}, false); err != nil {
		t.Errorf("LockTimeout MaxLockTimeout: %v", err)
	}
	if err := try("LockTimeout 1ns", idem.Job{LockTimeout: time.Nanosecond}, false); err != nil {
		t.Logf("a positive LockTimeout of 1ns: %v", err)
	}
	if err := try("TTL 1ns", idem.Job{TTL: time.Nanosecond}, false); err != nil {
		t.Logf("a positive TTL of 1ns: %v", err)
	}
	if err := try("TTL MaxDuration", idem.Job{TTL: idem.MaxDuration}, false); err != nil {
		t.Errorf("TTL MaxDuration: %v", err)
	}
	if err := try("Lease 1s", idem.Job{Lease: time.Second}, true); err != nil {
		t.Errorf("Lease 1s: %v", err)
	}
	if err := try("Lease MaxDuration", idem.Job{Lease: idem.MaxDuration}, true); err != nil {
		t.Errorf("Lease MaxDuration: %v", err)
	}
	if err := try("negative Timeout", idem.Job{Lease: time.Second, Timeout: -time.Second}, true); err != nil {
		t.Errorf("a negative Timeout: %v; want it taken as the default, as documented", err)
	}
}

// TestDoLockTimeoutOutOfRangeIsAlwaysRefused: a Job.LockTimeout PostgreSQL cannot hold (over
// MaxLockTimeout) was accepted while the key was free (the first try sends only the probe's)
// and refused only when a duplicate had to wait: a configuration error that passed every test
// and surfaced in production under contention. It is ErrInvalidArgument either way.
func TestDoLockTimeoutOutOfRangeIsAlwaysRefused(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, url := pgtest.NewPool(t, 4)
	job := idem.Job{Principal: "alice", Key: "lt-free", Action: "a", LockTimeout: 100 * 24 * time.Hour}
	_, _, errFree := idem.Do(ctx, pool, job, idem.TxOptions{}, func(context.Context, pgx.Tx) (int, error) { return 1, nil })
	job.Key = "lt-held"
	release := holdKey(t, url, job)
	defer release()
	cctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	_, _, errHeld := idem.Do(cctx, pool, job, idem.TxOptions{}, func(context.Context, pgx.Tx) (int, error) { return 1, nil })
	t.Logf("free key: %v; held key: %v", errFree, errHeld)
	if !errors.Is(errFree, idem.ErrInvalidArgument) || !errors.Is(errHeld, idem.ErrInvalidArgument) {
		t.Errorf("LockTimeout of 100 days: on a free key %v, on a held key %v; want ErrInvalidArgument on both", errFree, errHeld)
	}
}

// TestDoInputOddNames: member names and values JSON can hold but jsonb or text cannot.
func TestDoInputOddNames(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	for i, in := range []any{
		map[string]int{"a\x00b": 1},
		map[string]string{"a": "x\x00y"},
		map[string]int{"A": 1, "a": 2},
		map[string]int{"\ufeff": 1},
	} {
		var ran bool
		key := fmt.Sprintf("odd-%d", i)
		v, _, err := idem.Do(ctx, pool, idem.Job{Principal: "alice", Key: key, Action: "a", Input: in}, idem.TxOptions{},
			func(context.Context, pgx.Tx) (int, error) { ran = true; return i, nil })
		v2, replayed, err2 := idem.Do(ctx, pool, idem.Job{Principal: "alice", Key: key, Action: "a", Input: in}, idem.TxOptions{},
			func(context.Context, pgx.Tx) (int, error) { return -1, nil })
		t.Logf("%v: %d ran=%v %v; again %d %v %v", in, v, ran, err, v2, replayed, err2)
		if err != nil && ran {
			t.Errorf("%v: fn ran, then %v", in, err)
		}
		if err == nil && (err2 != nil || !replayed || v2 != v) {
			t.Errorf("%v: the repeat %d %v %v", in, v2, replayed, err2)
		}
	}
}

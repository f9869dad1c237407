package idem_test

import (
	"context"
	"encoding/json"
	"errors"
	"reflect"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestStepValueIsTheSameInEveryAttempt: a step's value whose JSON text jsonb rewrites (a
// json.RawMessage kept as a provider sent it, nested, with members out of jsonb's order; a
// json.Number with an exponent) came back to the attempt that recorded it as fn returned it,
// and to the takeover after a yield as jsonb stored it: one step, two values. Every attempt
// gets the stored form now, the same JSON value as fn's.
func TestStepValueIsTheSameInEveryAttempt(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	type ref struct {
		Amount json.Number `json:"amount"`
	}
	raw := json.RawMessage(`{"id":"ch_1","b":1,"a":[2,{"zz":1,"y":"<"}],"n":1e+21}`)
	num := ref{Amount: json.Number("1e+21")}
	job := idem.Job{Principal: "alice", Key: "stored-step", Action: "charge", Lease: 5 * time.Second}
	var firstRaw, againRaw, secondRaw json.RawMessage
	var firstNum, secondNum ref
	fail := true
	work := func(ctx context.Context, c idem.LeaseClaim) (string, error) {
		r, err := idem.Step(ctx, "reply", func(context.Context, pgx.Tx) (json.RawMessage, error) { return raw, nil })
		if err != nil {
			return "", err
		}
		n, err := idem.Step(ctx, "amount", func(context.Context, pgx.Tx) (ref, error) { return num, nil })
		if err != nil {
			return "", err
		}
		if fail {
			firstRaw, firstNum = r, n
			againRaw, err = idem.Step(ctx, "reply", func(context.Context, pgx.Tx) (json.RawMessage, error) {
				return nil, errors.New("ran again")
			})
			if err != nil {
				return "", err
			}
			return "", errors.New("the provider call failed") // DoLease yields
		}
		secondRaw, secondNum = r, n
		return "ok", nil
	}
	if _, _, err := idem.DoLease(ctx, pool, job, work); err == nil || err.Error() != "the provider call failed" {
		t.Fatalf("the first DoLease: %v; want fn's error after its steps", err)
	}
	fail = false
	if got, _, err := idem.DoLease(ctx, pool, job, work); err != nil || got != "ok" {
		t.Fatalf("the takeover: %q %v", got, err)
	}
	if string(againRaw) != string(firstRaw) || string(secondRaw) != string(firstRaw) {
		t.Errorf("json.RawMessage step: the recording attempt got %s, then %s; the takeover got %s", firstRaw, againRaw, secondRaw)
	}
	if secondNum != firstNum {
		t.Errorf("json.Number step: the recording attempt got %v, the takeover got %v", firstNum, secondNum)
	}
	var want, got any
	if err := json.Unmarshal(raw, &want); err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(secondRaw, &got); err != nil || !reflect.DeepEqual(got, want) {
		t.Errorf("the stored value %s is not the JSON value fn returned (%s): %v", secondRaw, raw, err)
	}
	if f, err := secondNum.Amount.Float64(); err != nil || f != 1e21 {
		t.Errorf("the stored number %q is not 1e21: %v", secondNum.Amount, err)
	}
}

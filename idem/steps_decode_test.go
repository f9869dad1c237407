package idem_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// storedCompact is a value whose UnmarshalJSON takes only compact JSON (as a type that checks a
// signature over the bytes it is given would): its own JSON (Go's, compact) decodes back into
// the same value, so Step's round-trip check passes, but jsonb's text (a space after each comma
// and colon) does not decode.
type storedCompact struct {
	A int `json:"a"`
	B int `json:"b"`
}

func (c *storedCompact) UnmarshalJSON(b []byte) error {
	if bytes.ContainsAny(b, " \n\t") {
		return fmt.Errorf("storedCompact: not compact JSON: %s", b)
	}
	type plain storedCompact
	return json.Unmarshal(b, (*plain)(c))
}

// TestStepValueThatDoesNotComeBackFromJsonbIsRefusedBeforeCommit: idem.Step's doc says a
// value "that would not come back the same from its JSON into T ... is ErrInvalidArgument
// after fn ran, and its transaction rolls back ... recorded, it would stop every later attempt
// of the generation at this step", and that every attempt gets the stored jsonb form (D203).
// The round-trip check ran on Go's JSON only, and the stored form was decoded after the step
// had committed: every attempt then failed at the step. It is decoded before the commit now.
func TestStepValueThatDoesNotComeBackFromJsonbIsRefusedBeforeCommit(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	pgtest.Exec(t, pool, `CREATE TABLE public.step_writes (n int)`)
	job := idem.Job{Principal: "alice", Key: "compact", Action: "a", Lease: 5 * time.Second}
	runs := 0
	var stepErr error
	work := func(ctx context.Context, c idem.LeaseClaim) (string, error) {
		_, stepErr = idem.Step(ctx, "s", func(ctx context.Context, tx pgx.Tx) (storedCompact, error) {
			runs++
			if _, err := tx.Exec(ctx, `INSERT INTO public.step_writes VALUES (1)`); err != nil {
				return storedCompact{}, err
			}
			return storedCompact{A: 1, B: 2}, nil
		})
		if stepErr != nil {
			return "", stepErr
		}
		return "ok", nil
	}
	_, _, err := idem.DoLease(ctx, pool, job, work)
	writes := pgtest.Count(t, pool, `SELECT count(*) FROM public.step_writes`)
	recorded := pgtest.Count(t, pool, `SELECT count(*) FROM idem.idempotency_keys WHERE key = 'compact' AND recovery_saved ? 's'`)
	t.Logf("DoLease: %v; Step: %v; writes committed %d, step recorded %d", err, stepErr, writes, recorded)
	if stepErr == nil {
		return // the attempt got a value: nothing stuck
	}
	if !errors.Is(stepErr, idem.ErrInvalidArgument) {
		t.Errorf("Step of a value whose stored form does not decode into T: %v; want ErrInvalidArgument", stepErr)
	}
	if writes != 0 || recorded != 0 {
		t.Errorf("Step failed, yet its writes (%d) and its recovery point (%d) committed: every later attempt of the generation is stopped at this step", writes, recorded)
	}
}

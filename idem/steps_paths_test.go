package idem_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestStepRawValuesAreTheSameOnEveryPath: for json.RawMessage values jsonb rewrites (escapes,
// U+2028, duplicate members, deep nesting, numbers far out of float64, -0, exponents), the
// attempt that records the step, the same name again in that attempt, a takeover
// (Decision.Steps) and the unsure path's read (recovery_saved -> name, scanned as bytes, as
// Steps.recorded does) all see the same text.
func TestStepRawValuesAreTheSameOnEveryPath(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	deep := strings.Repeat("[", 900) + strings.Repeat("]", 900)
	values := []string{
		`"<a&b>\u2028\u2029\t\"\\ \u00e9 \ud83d\ude00 \u001f"`,
		`{"b":1,"a":2,"a":3,"":{"z":[1,2,{"y":null}]}}`,
		deep,
		`[1e400, -1E-400, 0.10, -0, 1.0e1, 123456789012345678901234567890.000]`,
		`{"n":1e+21,"m":1E2,"k":5e-324}`,
		`null`, `true`, `""`, `{}`, `[]`,
	}
	for i, v := range values {
		v := v
		t.Run(fmt.Sprint(i), func(t *testing.T) {
			key := fmt.Sprintf("paths-%d", i)
			job := idem.Job{Principal: "alice", Key: key, Action: "a", Lease: 5 * time.Second}
			var first, again, second json.RawMessage
			fail := true
			work := func(ctx context.Context, c idem.LeaseClaim) (string, error) {
				r, err := idem.Step(ctx, "v", func(context.Context, pgx.Tx) (json.RawMessage, error) { return json.RawMessage(v), nil })
				if err != nil {
					return "", err
				}
				if fail {
					first = r
					if again, err = idem.Step(ctx, "v", func(context.Context, pgx.Tx) (json.RawMessage, error) {
						return nil, errors.New("ran again")
					}); err != nil {
						return "", err
					}
					return "", errors.New("yield")
				}
				second = r
				return "ok", nil
			}
			if _, _, err := idem.DoLease(ctx, pool, job, work); err == nil || err.Error() != "yield" {
				t.Fatalf("first DoLease: %v", err)
			}
			var unsure []byte
			if err := pool.QueryRow(ctx, `SELECT k.recovery_saved -> 'v' FROM idem.idempotency_keys AS k WHERE k.key = $1`, key).Scan(&unsure); err != nil {
				t.Fatal(err)
			}
			fail = false
			if _, _, err := idem.DoLease(ctx, pool, job, work); err != nil {
				t.Fatalf("takeover: %v", err)
			}
			if string(first) != string(again) || string(first) != string(second) || string(first) != string(unsure) {
				t.Errorf("value %s: recording attempt %s, same name again %s, takeover %s, recovery read %s", v, first, again, second, unsure)
			}
		})
	}
}

package dbidem_test

import (
	"context"
	"errors"
	"net/http"
	"reflect"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/internal/canon"
	"github.com/pgidem/pgidem/internal/dbidem"
)

var errLookOnly = errors.New("look only")

// claimInTx is Tx.Claim's decision (idem_begin's row read as one record where the connection
// reads results in binary, as columns otherwise), in a transaction that is rolled back.
func claimInTx(t *testing.T, pool *pgxpool.Pool, c dbidem.Claim) dbidem.Decision {
	t.Helper()
	var d dbidem.Decision
	err := dbidem.RunTx(context.Background(), pool, dbidem.TxOptions{MaxAttempts: 1}, func(tx *dbidem.Tx) error {
		var err error
		if d, err = tx.Claim(context.Background(), c); err != nil {
			return err
		}
		return errLookOnly
	})
	if !errors.Is(err, errLookOnly) {
		t.Fatalf("claim %q: %v", c.Key, err)
	}
	return d
}

// TestClaimStatementsAgree: RunTx's claim reads idem_begin's row as one composite value where
// the connection reads binary results (BeginRecordSQL), and as columns where it cannot
// (BeginSQL, which Begin always sends). Both give the same Decision for every outcome and
// every column: a replay's status, headers, binary body, resource id and withheld body; a
// mismatch's changed fields (named, none, unknown); an in-progress lease's retry_after; a
// fresh claim's token and provider key.
func TestClaimStatementsAgree(t *testing.T) {
	t.Parallel()
	modes(t, func(t *testing.T, pool *pgxpool.Pool) {
		ctx := context.Background()
		store := func(c dbidem.Claim, r dbidem.Response) {
			t.Helper()
			if err := dbidem.RunTx(ctx, pool, dbidem.TxOptions{}, func(tx *dbidem.Tx) error {
				if _, err := tx.Claim(ctx, c); err != nil {
					return err
				}
				tx.CompleteOnCommit(r)
				return nil
			}); err != nil {
				t.Fatal(err)
			}
		}
		body := `{"amount":100,"to":"acc_2"}`
		store(claim("replay", body), dbidem.Response{Status: 201, Body: []byte("{\"id\":7}\n\x00\xff"), ResourceID: "7",
			Header: http.Header{"Content-Type": {"application/json"}, "Vary": {"Accept, Origin"}}})
		store(claim("secret", body), dbidem.Response{Status: 201, Withheld: "one_time_secret",
			Header: http.Header{"Content-Type": {"application/json"}}})
		lease := claim("lease", body)
		lease.Lease = time.Minute
		if d, err := dbidem.Begin(ctx, pool, lease); err != nil || d.Outcome != dbidem.Claimed {
			t.Fatalf("lease: %+v %v", d, err)
		}
		moved := claim("replay", body)
		moved.Fingerprint = canon.Compute("POST", "/v1/elsewhere", []byte(body)).Sum
		transactional := lease
		transactional.Lease = 0

		for _, c := range map[string]dbidem.Claim{
			"replay":                  claim("replay", body),
			"withheld":                claim("secret", body),
			"mismatch":                claim("replay", `{"amount":500,"to":"acc_2","memo":"x"}`),
			"mismatch without fields": claim("replay", `not json`),
			"mismatch on the path":    moved,
			"in progress":             transactional,
		} {
			record := claimInTx(t, pool, c)
			columns, err := dbidem.Begin(ctx, pool, c)
			if err != nil {
				t.Fatal(err)
			}
			if d := record.RetryAfter - columns.RetryAfter; d < 0 || d > time.Second || (columns.RetryAfter == 0) != (record.RetryAfter == 0) {
				t.Errorf("%s: retry after %v in the claim, %v in Begin", c.Key, record.RetryAfter, columns.RetryAfter)
			}
			record.Sent, columns.Sent, record.RetryAfter, columns.RetryAfter = time.Time{}, time.Time{}, 0, 0
			if !reflect.DeepEqual(record, columns) {
				t.Errorf("%s: the claim's decision\n%+v\nBegin's\n%+v", c.Key, record, columns)
			}
		}
		if d := claimInTx(t, pool, transactional); d.Outcome != dbidem.InProgress || d.RetryAfter < 58*time.Second || d.RetryAfter > time.Minute ||
			len(d.ProviderKey) != 64 {
			t.Errorf("a transactional claim of a running lease: %+v", d)
		}
		fresh := claimInTx(t, pool, claim("fresh", body))
		if fresh.Outcome != dbidem.Claimed || fresh.Attempt < 1 || len(fresh.ProviderKey) != 64 || fresh.Response.Status != 0 ||
			fresh.ChangedFields != nil || fresh.RetryAfter != 0 || fresh.RecoveryPoint != "" || fresh.Steps != nil {
			t.Errorf("fresh: %+v", fresh)
		}
	})
}

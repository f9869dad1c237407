package dbidem_test

import (
	"context"
	"testing"
	"time"

	"github.com/pgidem/pgidem/internal/dbidem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestLeaseClaimIdleTimeoutOnlyInItsOwnUnit: the server ends a lease claim's own transaction
// once idle (D168), the Gate's unit whose fn returns at once; a lease claim made with Tx.Claim
// in a caller's transaction, among the caller's statements, keeps the session's setting: its
// idle time is the caller's to bound.
func TestLeaseClaimIdleTimeoutOnlyInItsOwnUnit(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	idle := func(tx *dbidem.Tx) string {
		t.Helper()
		var v string
		if err := tx.QueryRow(ctx, `SELECT current_setting('idle_in_transaction_session_timeout')`).Scan(&v); err != nil {
			t.Fatal(err)
		}
		return v
	}
	claim := func(key string) dbidem.Claim {
		return dbidem.Claim{Principal: "p", Key: key, Action: "a", Fingerprint: [32]byte{1}, Lease: 5 * time.Second}
	}
	var inUnit, inCallers string
	if err := dbidem.NewGate(dbidem.GateOptions{}).RunHolding(ctx, pool, dbidem.TxOptions{}, claim("unit"), 0,
		func(tx *dbidem.Tx, d dbidem.Decision) error {
			if d.Outcome != dbidem.Claimed {
				t.Fatalf("the unit's claim: %s", d.Outcome)
			}
			inUnit = idle(tx)
			return nil
		}); err != nil {
		t.Fatal(err)
	}
	if err := dbidem.RunTx(ctx, pool, dbidem.TxOptions{}, func(tx *dbidem.Tx) error {
		if _, err := tx.Exec(ctx, `SELECT 1`); err != nil {
			return err
		}
		d, err := tx.Claim(ctx, claim("callers"))
		if err != nil || d.Outcome != dbidem.Claimed {
			t.Fatalf("the caller's claim: %v %v", d.Outcome, err)
		}
		inCallers = idle(tx)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if inUnit != "5s" || inCallers != "0" {
		t.Fatalf("idle_in_transaction_session_timeout in the Gate's lease unit %q (want 5s), in a caller's transaction %q (want the session's 0)",
			inUnit, inCallers)
	}
}

package dbidem

import (
	"context"
	"crypto/sha256"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestClaimTellsWhetherTheCommitMayWaitForAStandby: the claim's statement in RunTx reports
// whether the transaction's COMMIT may wait for a synchronous standby (standbyWaitColumn), and
// RunTx sends the COMMIT from a goroutine of its own, never canceled, only then (D108, D136).
// On the test server no synchronous standby is named: the COMMIT cannot wait, with any
// synchronous_commit. With Citus' settings present (here a placeholder of its name) it may: a
// coordinator commits on workers whose settings it does not show. The case of a named standby
// is TestCommitWaitingForTheStandbyIsNeverCanceled (package idem), which fails when the flag is
// wrong there.
func TestClaimTellsWhetherTheCommitMayWaitForAStandby(t *testing.T) {
	t.Parallel()
	pool, err := pgxpool.New(context.Background(), pgtest.NewDB(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	for i, c := range []struct {
		set         string
		lease       bool
		noWaitWants bool
	}{
		{"", false, true},
		{"SET synchronous_commit = remote_apply", false, true},
		{"SET synchronous_commit = local", true, true},
		{"SET citus.version = '13.2.2'", false, false},
		{"SET citus.version = '13.2.2'", true, false},
	} {
		var noWait bool
		err := RunTx(context.Background(), pool, TxOptions{}, func(tx *Tx) error {
			if c.set != "" {
				if err := tx.begin(context.Background()); err != nil {
					return err
				}
				if _, err := tx.tx.Exec(context.Background(), "SET LOCAL"+c.set[len("SET"):]); err != nil {
					return err
				}
			}
			claim := Claim{Principal: "p", Key: "standby-" + string(rune('a'+i)), Action: "POST /x",
				Fingerprint: sha256.Sum256([]byte{byte(i)})}
			if c.lease {
				claim.Lease = time.Minute
			}
			d, err := tx.Claim(context.Background(), claim)
			if err != nil {
				return err
			}
			noWait = tx.noStandbyWait
			if d.Outcome == Claimed {
				tx.CompleteOnCommit(Response{Status: 201})
			}
			return nil
		})
		if err != nil {
			t.Fatalf("%q (lease %v): %v", c.set, c.lease, err)
		}
		if noWait != c.noWaitWants {
			t.Errorf("%q (lease %v): the claim says the COMMIT cannot wait for a standby: %v, want %v", c.set, c.lease, noWait, c.noWaitWants)
		}
	}
}

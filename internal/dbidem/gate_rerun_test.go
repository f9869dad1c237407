package dbidem_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/internal/dbidem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestGateRerunAfter40001NeedsNoSlot: a claim that waited on another process's row (with a
// wait slot) takes the key once that process rolls back; its slot is freed as the claim returns
// (D211). Its work then hits a serialization failure (40001), so RunTx runs the unit again
// (RunTx: "fn runs again in a new transaction, up to opts.MaxAttempts times"). Meanwhile another
// key's claim took the one free slot. The rerun's claim finds the key free (its own claim rolled
// back; nobody else holds it): it waits on no row, so it needs no slot. The Gate's doc gives
// ErrInProgress for want of a slot only to "waiting on a key's row lock (held by another
// process)". In a build of D211 the rerun was refused ErrInProgress (no slot) for a key
// nobody held.
func TestGateRerunAfter40001NeedsNoSlot(t *testing.T) {
	t.Parallel()
	pool, url := pgtest.NewPool(t, 6)
	ctx := context.Background()
	gate := dbidem.NewGate(dbidem.GateOptions{MaxWaitingClaims: 1})

	// "Another process" holds key r1, uncommitted.
	other := holdElsewhere(t, url, "r1")

	aIn, aGo := make(chan struct{}), make(chan struct{})
	var goOnce sync.Once
	t.Cleanup(func() { goOnce.Do(func() { close(aGo) }) })
	var runs atomic.Int32
	var lastA atomic.Value
	aDone := make(chan error, 1)
	go func() {
		c := claim("r1", `{}`)
		c.LockTimeout = 5 * time.Second
		aDone <- gate.Run(ctx, pool, dbidem.TxOptions{}, c, func(tx *dbidem.Tx, d dbidem.Decision) error {
			lastA.Store(d.Outcome)
			if d.Outcome != dbidem.Claimed {
				return nil
			}
			if runs.Add(1) == 1 {
				close(aIn)
				<-aGo
				_, err := tx.Exec(ctx, `DO $$BEGIN RAISE EXCEPTION 'serialization' USING ERRCODE = '40001'; END$$`)
				return err
			}
			tx.CompleteOnCommit(dbidem.Response{Status: 201, Body: []byte(`{}`)})
			return nil
		})
	}()
	gateWait(t, "A waits on r1's row with the slot", func() bool { return gate.LockWaits() == 1 })
	_ = other.Rollback(ctx)
	select {
	case <-aIn:
	case <-time.After(10 * time.Second):
		t.Fatal("A never claimed r1")
	}
	gateWait(t, "A's slot freed once claimed", func() bool { return gate.LockWaits() == 0 })

	// Another process holds key r2; B (this process) waits on it with the one slot.
	other2 := holdElsewhere(t, url, "r2")
	bDone := make(chan error, 1)
	go func() {
		c := claim("r2", `{}`)
		c.LockTimeout = 5 * time.Second
		bDone <- gate.Run(ctx, pool, dbidem.TxOptions{}, c, func(tx *dbidem.Tx, d dbidem.Decision) error {
			if d.Outcome == dbidem.Claimed {
				tx.CompleteOnCommit(dbidem.Response{Status: 201, Body: []byte(`{}`)})
			}
			return nil
		})
	}()
	gateWait(t, "B waits on r2's row with the slot", func() bool { return gate.LockWaits() == 1 })

	// A's work hits 40001: the unit runs again; r1 is free.
	goOnce.Do(func() { close(aGo) })
	var errA error
	select {
	case errA = <-aDone:
	case <-time.After(15 * time.Second):
		t.Fatal("A never returned")
	}
	_ = other2.Rollback(ctx)
	if err := <-bDone; err != nil {
		t.Logf("B: %v", err)
	}
	if errA != nil {
		t.Errorf("A's rerun after a serialization failure, on a key nobody holds: %v (IsNoSlot=%v, IsRefusedByGate=%v, runs with a claim=%d); "+
			"want the rerun to claim r1 and answer (it waits on no row, so it needs no slot)",
			errA, dbidem.IsNoSlot(errA), dbidem.IsRefusedByGate(errA), runs.Load())
	}
	t.Logf("r1 rows: %d; A's last decision %v", pgtest.Count(t, pool, `SELECT count(*) FROM idem.idempotency_keys WHERE key = 'r1'`), lastA.Load())
	if gate.LockWaits() != 0 || gate.Waiting() != 0 {
		t.Errorf("after: LockWaits()=%d Waiting()=%d", gate.LockWaits(), gate.Waiting())
	}
}

// TestGatePanicAfterWaitedClaimFreesSlotOnce: a claim that waited on another
// process's row (with the one wait slot) takes the key, and its fn panics after the slot was
// freed as the claim returned. The slot is freed once: LockWaits() is 0 after, never negative
// (a double free would block on the channel), and the next claim of another held key gets the
// slot and waits.
func TestGatePanicAfterWaitedClaimFreesSlotOnce(t *testing.T) {
	t.Parallel()
	pool, url := pgtest.NewPool(t, 6)
	ctx := context.Background()
	gate := dbidem.NewGate(dbidem.GateOptions{MaxWaitingClaims: 1})
	other := holdElsewhere(t, url, "p1")
	panicked := make(chan any, 1)
	go func() {
		defer func() { panicked <- recover() }()
		c := claim("p1", `{}`)
		c.LockTimeout = 5 * time.Second
		_ = gate.Run(ctx, pool, dbidem.TxOptions{}, c, func(tx *dbidem.Tx, d dbidem.Decision) error {
			if d.Outcome == dbidem.Claimed {
				panic("boom")
			}
			return nil
		})
	}()
	gateWait(t, "the claim waits with the slot", func() bool { return gate.LockWaits() == 1 })
	_ = other.Rollback(ctx)
	select {
	case r := <-panicked:
		if r == nil {
			t.Fatal("fn did not panic")
		}
	case <-time.After(10 * time.Second):
		t.Fatal("never returned")
	}
	if n := gate.LockWaits(); n != 0 {
		t.Errorf("after the panic: LockWaits()=%d", n)
	}
	// The key is free and its flight gone: a claim of it runs.
	var out dbidem.Outcome
	c := claim("p1", `{}`)
	c.LockTimeout = 2 * time.Second
	if err := gate.Run(ctx, pool, dbidem.TxOptions{}, c, func(tx *dbidem.Tx, d dbidem.Decision) error {
		out = d.Outcome
		tx.CompleteOnCommit(dbidem.Response{Status: 201, Body: []byte(`{}`)})
		return nil
	}); err != nil || out != dbidem.Claimed {
		t.Errorf("after: %v %q", err, out)
	}
	if gate.LockWaits() != 0 || gate.Waiting() != 0 {
		t.Errorf("end: LockWaits()=%d Waiting()=%d", gate.LockWaits(), gate.Waiting())
	}
}

// holdElsewhere claims key in a transaction of another connection ("another process") and keeps
// it uncommitted; the test ends it (Rollback or Commit), or its cleanup rolls it back.
func holdElsewhere(t *testing.T, url, key string) pgx.Tx {
	t.Helper()
	ctx := context.Background()
	tx, err := pgtest.Connect(t, url).Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback(ctx) })
	if _, err := dbidem.Begin(ctx, tx, claim(key, `{}`)); err != nil {
		t.Fatal(err)
	}
	return tx
}

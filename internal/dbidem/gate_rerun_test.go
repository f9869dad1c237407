package dbidem_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

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
// process)". In D211's second build the rerun was refused ErrInProgress (no slot) for a key
// nobody held.
func TestGateRerunAfter40001NeedsNoSlot(t *testing.T) {
	t.Parallel()
	pool, url := pgtest.NewPool(t, 6)
	ctx := context.Background()
	gate := dbidem.NewGate(dbidem.GateOptions{MaxWaitingClaims: 1})

	// "Another process" holds key r1, uncommitted.
	other, err := pgtest.Connect(t, url).Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = other.Rollback(ctx) }()
	if _, err := dbidem.Begin(ctx, other, claim("r1", `{}`)); err != nil {
		t.Fatal(err)
	}

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
	other2, err := pgtest.Connect(t, url).Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = other2.Rollback(ctx) }()
	if _, err := dbidem.Begin(ctx, other2, claim("r2", `{}`)); err != nil {
		t.Fatal(err)
	}
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

// TestGateFreshClaimBesideFlightTakesIt: D211: "one that claims it afresh takes its
// flight at once, before its work runs, so that the requests after it wait for that work in Go:
// one flight at a time". Two requests X and Y claim an open key side by side (both wait on
// another process's uncommitted claim, which rolls back). X claims first (and takes the flight),
// its work hits 40001; during its rerun's backoff Y claims the key afresh and takes the flight
// over. X's rerun waits on Y's row past its lock timeout and leaves; a newcomer N of this
// process waits in Go for Y's work (the Probe doc: "A request of this process never waits on a
// key that another request of this process holds"). In D211's second build Y got no flight
// (X's was there), and once X left, N probed and waited on Y's row in the database with a slot.
func TestGateFreshClaimBesideFlightTakesIt(t *testing.T) {
	t.Parallel()
	pool, url := pgtest.NewPool(t, 10)
	ctx := context.Background()
	gate := dbidem.NewGate(dbidem.GateOptions{MaxWaitingClaims: 4})
	c := claim("beside", `{"amount":1}`)
	c.LockTimeout = 5 * time.Second
	opts := dbidem.TxOptions{Backoff: 100 * time.Millisecond}

	fIn, fRel := make(chan struct{}), make(chan struct{})
	wIn, wRel := make(chan struct{}), make(chan struct{})
	yIn, yRel := make(chan struct{}), make(chan struct{})
	var once sync.Once
	t.Cleanup(func() {
		once.Do(func() {
			for _, ch := range []chan struct{}{fRel, wRel, yRel} {
				select {
				case <-ch:
				default:
					close(ch)
				}
			}
		})
	})
	hold := func(in, rel chan struct{}) func(tx *dbidem.Tx, d dbidem.Decision) error {
		return func(tx *dbidem.Tx, d dbidem.Decision) error {
			if d.Outcome == dbidem.Claimed {
				tx.CompleteOnCommit(dbidem.Response{Status: 201, Body: []byte(`{}`)})
			}
			close(in)
			<-rel
			return nil
		}
	}
	fDone := make(chan error, 1)
	go func() { fDone <- gate.Run(ctx, pool, opts, c, hold(fIn, fRel)) }()
	<-fIn
	wDone := make(chan error, 1)
	go func() { wDone <- gate.Run(ctx, pool, opts, c, hold(wIn, wRel)) }()
	gateWait(t, "W waits in Go", func() bool { return gate.Waiting() == 1 })
	close(fRel)
	if err := <-fDone; err != nil {
		t.Fatal(err)
	}
	<-wIn // W replays side by side and holds: the key is open
	pgtest.Exec(t, pool, `DELETE FROM idem.idempotency_keys WHERE key = 'beside'`)

	other, err := pgtest.Connect(t, url).Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = other.Rollback(ctx) }()
	if d, err := dbidem.Begin(ctx, other, c); err != nil || d.Outcome != dbidem.Claimed {
		t.Fatalf("the other process's claim: %+v %v", d, err)
	}
	var fresh atomic.Int32
	xy := func(tx *dbidem.Tx, d dbidem.Decision) error {
		if d.Outcome != dbidem.Claimed {
			return nil
		}
		switch fresh.Add(1) {
		case 1: // X: a serialization failure, then a rerun after a backoff
			_, err := tx.Exec(ctx, `DO $$BEGIN RAISE EXCEPTION 'serialization' USING ERRCODE = '40001'; END$$`)
			return err
		case 2: // Y: a long handler
			close(yIn)
			<-yRel
		}
		tx.CompleteOnCommit(dbidem.Response{Status: 201, Body: []byte(`{}`)})
		return nil
	}
	xyDone := make(chan error, 2)
	short := c
	short.LockTimeout = 800 * time.Millisecond
	for range 2 {
		go func() { xyDone <- gate.Run(ctx, pool, opts, short, xy) }()
	}
	gateWait(t, "X and Y wait on the other process's claim", func() bool { return gate.LockWaits() == 2 })
	_ = other.Rollback(ctx)
	select {
	case <-yIn:
	case <-time.After(10 * time.Second):
		t.Fatal("Y never claimed afresh")
	}
	// X's rerun waits on Y's row and gives up past its lock timeout.
	var xErr error
	select {
	case xErr = <-xyDone:
	case <-time.After(10 * time.Second):
		t.Fatal("X never returned")
	}
	t.Logf("X: %v", xErr)

	// Y holds the key (this process). A newcomer should wait for it in Go.
	nDone := make(chan error, 1)
	var nOut atomic.Value
	go func() {
		nDone <- gate.Run(ctx, pool, opts, c, func(tx *dbidem.Tx, d dbidem.Decision) error { nOut.Store(d.Outcome); return nil })
	}()
	deadline := time.Now().Add(2 * time.Second)
	for gate.Waiting() == 0 && gate.LockWaits() == 0 && time.Now().Before(deadline) {
		time.Sleep(2 * time.Millisecond)
	}
	time.Sleep(50 * time.Millisecond)
	waiting, lockWaits := gate.Waiting(), gate.LockWaits()
	close(yRel)
	close(wRel)
	once.Do(func() {})
	if err := <-xyDone; err != nil {
		t.Errorf("Y: %v", err)
	}
	if err := <-wDone; err != nil {
		t.Errorf("W: %v", err)
	}
	nErr := <-nDone
	t.Logf("while Y (this process) worked on the key: newcomer N: Waiting()=%d LockWaits()=%d; N then: %v %v",
		waiting, lockWaits, nErr, nOut.Load())
	if lockWaits != 0 || waiting != 1 {
		t.Errorf("a newcomer while Y, a request of this process, worked on its fresh claim: Waiting()=%d LockWaits()=%d; "+
			"want it waiting in Go (1, 0), not on Y's row in the database", waiting, lockWaits)
	}
	if gate.Waiting() != 0 || gate.LockWaits() != 0 {
		t.Errorf("after: Waiting()=%d LockWaits()=%d", gate.Waiting(), gate.LockWaits())
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
	other, err := pgtest.Connect(t, url).Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = other.Rollback(ctx) }()
	if _, err := dbidem.Begin(ctx, other, claim("p1", `{}`)); err != nil {
		t.Fatal(err)
	}
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

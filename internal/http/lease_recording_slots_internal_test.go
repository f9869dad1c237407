package idemhttp

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/pgidem/pgidem/internal/dbidem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestAbandonedRecordingKeepsItsSlotWhileItWaitsOnALock (review, held when written): an
// answer's recording on the lease slots (pool of 2, one slot), its key's row locked by another
// session: its context ends while it waits on the row, and Complete returns ErrCommitUnknown
// (it was sent); the slot stays taken until PostgreSQL answers (its function's lock timeout
// ends the wait within the slot's hold), then goes back exactly once. A second recording whose
// context ends while it waits for that slot returns its context's error, not an outcome
// unknown, and sends nothing.
func TestAbandonedRecordingKeepsItsSlotWhileItWaitsOnALock(t *testing.T) {
	t.Parallel()
	pool, url := pgtest.NewPool(t, 2)
	ctx := context.Background()
	s := slotted{q: pool, slots: newLeaseSlots(1, 2)}
	c := dbidem.Claim{Principal: "p", Key: "abandoned", Action: "a", Fingerprint: [32]byte{1}, Lease: 30 * time.Second}
	d, err := dbidem.Begin(ctx, pool, c)
	if err != nil || d.Outcome != dbidem.Claimed {
		t.Fatalf("claim: %+v %v", d, err)
	}
	locker := pgtest.Connect(t, url)
	pgtest.Exec(t, locker, `BEGIN`)
	pgtest.Exec(t, locker, `SELECT 1 FROM idem.idempotency_keys WHERE key = 'abandoned' FOR UPDATE`)
	cctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	err = dbidem.Complete(cctx, s, "p", "abandoned", d.Attempt, dbidem.Response{Status: 201})
	cancel()
	if !errors.Is(err, dbidem.ErrCommitUnknown) {
		t.Fatalf("a recording abandoned while it waited on the row: %v, want ErrCommitUnknown", err)
	}
	if len(s.slots) != 1 {
		t.Fatalf("%d slots taken while the abandoned recording still waits on the row, want 1", len(s.slots))
	}
	// A second recording finds no slot: its context's end is not an outcome unknown.
	cctx, cancel = context.WithTimeout(ctx, 200*time.Millisecond)
	err = dbidem.Complete(cctx, s, "p", "abandoned", d.Attempt, dbidem.Response{Status: 202})
	cancel()
	if errors.Is(err, dbidem.ErrCommitUnknown) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("a recording that never got a slot: %v, want its context's end and not ErrCommitUnknown", err)
	}
	pgtest.Exec(t, locker, `COMMIT`)
	deadline := time.Now().Add(3 * time.Second)
	for len(s.slots) != 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if len(s.slots) != 0 {
		t.Fatalf("%d slots still taken after the abandoned recording was answered", len(s.slots))
	}
	var status int
	if err := pool.QueryRow(ctx, `SELECT response_status FROM idem.idempotency_keys WHERE key = 'abandoned'`).Scan(&status); err != nil || status != 201 {
		t.Fatalf("stored status %d (%v), want 201 (the abandoned recording's; the second was never sent)", status, err)
	}
	// Exactly once: one slot, and it can be taken and given back again.
	release, err := takeWithin(s.slots, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	release()
	if len(s.slots) != 0 {
		t.Fatalf("%d slots taken", len(s.slots))
	}
}

// TestRecordingLandingPastTheDeadlineCounts (review, held when written): pool of 2, one slot; the
// recording waits on its key's row past the answer deadline and lands 300 ms after it (the
// row freed): it gives its slot back when answered, and PersistAnswer's read past the
// deadline (D168) takes it and finds the answer stored: nil. No deadlock between the
// recording and the read when the recording ends within that second.
func TestRecordingLandingPastTheDeadlineCounts(t *testing.T) {
	t.Parallel()
	pool, url := pgtest.NewPool(t, 2)
	ctx := context.Background()
	s := slotted{q: pool, slots: newLeaseSlots(1, 2)}
	c := dbidem.Claim{Principal: "p", Key: "late-landing", Action: "a", Fingerprint: [32]byte{2}, Lease: 30 * time.Second}
	d, err := dbidem.Begin(ctx, pool, c)
	if err != nil || d.Outcome != dbidem.Claimed {
		t.Fatalf("claim: %+v %v", d, err)
	}
	locker := pgtest.Connect(t, url)
	pgtest.Exec(t, locker, `BEGIN`)
	pgtest.Exec(t, locker, `SELECT 1 FROM idem.idempotency_keys WHERE key = 'late-landing' FOR UPDATE`)
	pctx, cancel := context.WithTimeout(ctx, 800*time.Millisecond)
	defer cancel()
	unlocked := make(chan struct{})
	go func() {
		defer close(unlocked)
		time.Sleep(1100 * time.Millisecond)
		_, _ = locker.Exec(context.Background(), `COMMIT`)
	}()
	err = dbidem.PersistAnswer(pctx, s, s, c, d.Attempt, dbidem.Response{Status: 201})
	<-unlocked
	if err != nil {
		t.Fatalf("an answer that landed 300 ms past its deadline: %v, want nil (D168)", err)
	}
}

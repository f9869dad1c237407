package idem_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestLateResultPastTheKeysTTLIsStored: DoLease records a result fn returns after its lease
// was lost while nobody took the key over. Past the TTL after the lease's end too (the key's
// row locked so that no extension landed, and fn returning 2.3 s after the loss with a 2 s
// TTL, which leaves the stored answer 2 s for the replay below), where the key is free: the result is stored for it (a new generation's answer) and
// returned, and the next DoLease of the job replays it instead of running fn again under a new
// provider key, which an outside provider would have taken for new work (D255, as D249 for a
// lease route). On the previous code DoLease returned ErrLeaseLost and the next one ran fn.
func TestLateResultPastTheKeysTTLIsStored(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, url := pgtest.NewPool(t, 8)
	job := idem.Job{Principal: "alice", Key: "late-expired", Action: "payout", Input: map[string]int{"amount": 5},
		Lease: time.Second, TTL: 2 * time.Second, LockTimeout: 100 * time.Millisecond}
	locker := pgtest.Connect(t, url)
	var firstKey string
	n, _, err := idem.DoLease(ctx, pool, job, func(ctx context.Context, c idem.LeaseClaim) (int, error) {
		firstKey = c.ProviderKey
		tx, err := locker.Begin(context.Background())
		if err != nil {
			return 0, err
		}
		defer func() { _ = tx.Rollback(context.Background()) }()
		if _, err := tx.Exec(context.Background(), `SELECT 1 FROM idem.idempotency_keys WHERE key = $1 FOR UPDATE`, job.Key); err != nil {
			return 0, err
		}
		select {
		case <-ctx.Done():
		case <-time.After(10 * time.Second):
			return 0, errors.New("the lease was not lost while its row was locked")
		}
		time.Sleep(2300 * time.Millisecond) // past the lease's end plus the TTL
		if err := tx.Rollback(context.Background()); err != nil {
			return 0, err
		}
		return 42, nil
	})
	if err != nil || n != 42 {
		t.Fatalf("DoLease whose late result came past the key's TTL: %d, %v; want 42, stored", n, err)
	}
	ran := false
	n2, replayed, err := idem.DoLease(ctx, pool, job, func(ctx context.Context, c idem.LeaseClaim) (int, error) {
		ran = true
		return 7, nil
	})
	if err != nil || n2 != 42 || !replayed || ran {
		t.Fatalf("the next DoLease: %d, replayed %v, ran %v, %v; want the late result 42 replayed, fn not run (its provider key was %q)",
			n2, replayed, ran, err, firstKey)
	}
}

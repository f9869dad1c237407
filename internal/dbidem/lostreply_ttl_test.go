package dbidem_test

import (
	"context"
	"testing"
	"time"

	"github.com/pgidem/pgidem/internal/dbidem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestLostReplyOfAnAnswerPastItsTTL: PersistAnswer tells an answer that landed from one that
// did not when the completion's reply was lost. It asked idem_begin for a replay with its
// attempt; since D200 a lease claim's answer is kept the TTL after the answer, not until the
// lease's end plus the TTL, so once the answer's TTL had passed idem_begin no longer replayed
// it, and an answer that landed was reported lost: DoLease returned ErrLeaseLost for work that
// ran and whose result was stored (its caller ran it again, under a new generation and
// provider key), and a lease route answered 409 where no other attempt held the key. It reads
// the key's row now: completed with its attempt.
func TestLostReplyOfAnAnswerPastItsTTL(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 8)
	ctx := context.Background()
	db := &lostReply{Pool: pool, after: 700 * time.Millisecond}
	job := dbidem.Job{Principal: "p", Key: "d200-lost-reply", Action: "payout", Input: map[string]int{"amount": 5},
		Lease: 30 * time.Second, TTL: 300 * time.Millisecond}
	runs := 0
	n, replayed, err := dbidem.DoLease(ctx, db, job, func(context.Context, dbidem.LeaseClaim) (int, error) { runs++; return 42, nil })
	if !db.lost.Load() {
		t.Fatal("no reply was lost")
	}
	var state string
	var attempt int64
	if err := pool.QueryRow(ctx, `SELECT state, attempt FROM idem.idem_key('p', 'd200-lost-reply')`).Scan(&state, &attempt); err != nil {
		t.Fatal(err)
	}
	if err != nil || n != 42 || replayed {
		t.Fatalf("DoLease whose recording landed (key %s, attempt %d) and whose reply was lost for 700 ms, TTL 300 ms, "+
			"lease 30 s: %d, replayed %v, err %v; want 42, nil (the answer stored is this attempt's)", state, attempt, n, replayed, err)
	}
}

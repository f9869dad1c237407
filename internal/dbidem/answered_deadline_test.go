package dbidem_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/internal/dbidem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// slowAcquire: a read takes 20 ms to start (a new connection dialled, TLS), longer than the
// 2 ms left.
type slowAcquire struct{ *pgxpool.Pool }

func (p slowAcquire) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	time.Sleep(20 * time.Millisecond)
	return p.Pool.QueryRow(ctx, sql, args...)
}

// TestAnsweredPastTheDeadline: D168 (lease.go, PersistAnswer): "The deadline came while a try's
// outcome was unknown (abandoned, or its reply lost): it may have landed since. A read, which
// stores nothing, is allowed a moment past the deadline; an answer found is this one." A reply
// lost, then ErrClaimLost just before the deadline, and the deadline passed before the first
// read of the key's row: the read's error ("could not be read") returned at once, and the read
// past the deadline never ran; the answer stored with its attempt was reported unknown (a lease
// route answered 503 outcome_unknown). It falls through to that read now.
func TestAnsweredPastTheDeadline(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 8)
	ctx := context.Background()
	c := dbidem.Claim{Principal: "p", Key: "late-deadline", Action: "payout", Fingerprint: [32]byte{9},
		Lease: 30 * time.Second}
	d, err := dbidem.Begin(ctx, pool, c)
	if err != nil || d.Outcome != dbidem.Claimed {
		t.Fatalf("claim: %+v %v", d, err)
	}
	pctx, cancel := context.WithTimeout(ctx, 1500*time.Millisecond)
	defer cancel()
	deadline, _ := pctx.Deadline()
	// The second idem_complete's 55000 (the claim is completed, by this very attempt) comes 2 ms
	// before the answer's deadline.
	q := &lostReply{Pool: pool, next: func() { time.Sleep(time.Until(deadline.Add(-2 * time.Millisecond))) }}
	err = dbidem.PersistAnswer(pctx, q, slowAcquire{pool}, c, d.Attempt, dbidem.Response{Status: 201, Body: []byte(`{"paid":1}`)})
	t.Logf("PersistAnswer: %v (pctx %v)", err, pctx.Err())
	var state string
	var attempt int64
	if rerr := pool.QueryRow(ctx, `SELECT state, attempt FROM idem.idem_key('p', 'late-deadline')`).Scan(&state, &attempt); rerr != nil {
		t.Fatal(rerr)
	}
	if state != "completed" || attempt != d.Attempt || q.n.Load() != 2 {
		t.Fatalf("setup: key %s attempt %d (want completed %d), Complete calls %d", state, attempt, d.Attempt, q.n.Load())
	}
	if err != nil {
		t.Errorf("PersistAnswer of an answer stored with its attempt, the loss found at the deadline: %v; want nil "+
			"(D168: a read is allowed a moment past the deadline)", err)
	}
}

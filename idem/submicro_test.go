package idem_test

import (
	"context"
	"testing"
	"time"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestSubMicrosecondDurationsStayPositive: a Claim's TTL, Lease and LockTimeout are sent in
// whole microseconds, rounded up, so a positive one below a microsecond is a positive interval.
// Truncated, it was "0 microseconds", which idem_begin refuses (22023): ErrInvalidArgument for
// a positive value, where the docs refuse only negative ones.
func TestSubMicrosecondDurationsStayPositive(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 2)
	for i, c := range []idem.Claim{
		{TTL: 500 * time.Nanosecond},
		{LockTimeout: time.Nanosecond},
		{Lease: 999 * time.Nanosecond, TTL: time.Hour},
	} {
		c.Principal, c.Key, c.Action = "alice", "sub-"+string(rune('a'+i)), "POST /x"
		c.Fingerprint = idem.ComputeFingerprint("POST", "/x", nil).Sum
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		d, err := idem.Begin(ctx, tx, c)
		if err != nil || d.Outcome != idem.Claimed {
			t.Errorf("claim %d (TTL %v, Lease %v, LockTimeout %v): %+v, %v; want claimed", i, c.TTL, c.Lease, c.LockTimeout, d, err)
		}
		_ = tx.Rollback(ctx)
	}
}

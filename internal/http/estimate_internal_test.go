package idemhttp

import (
	"testing"
	"time"
)

// TestRetryAfterIsCappedByTheLeaseLeftWhenSent (D275): a duplicate's 409 request_in_progress
// says Retry-After "at least a second and at most the lease's rest" (docs/http.md). The cap was
// the rest the duplicate's claim read when it arrived, not what was left when the 409 went out
// after the duplicate's wait: with the work's typical length here longer than the lease, a
// duplicate that waited 1.2 s of a 5 s lease was told 5 s where 3.8 were left (a review with two
// processes, one with slower payouts).
func TestRetryAfterIsCappedByTheLeaseLeftWhenSent(t *testing.T) {
	q := &request{m: &Middleware{}, action: "POST /v1/payouts"}
	q.m.typical.add(q.action, time.Minute)
	now := time.Now()
	for _, c := range []struct {
		rest, waited time.Duration
		want         time.Duration
	}{
		{5 * time.Second, 0, 5 * time.Second},
		{5 * time.Second, 1200 * time.Millisecond, 3800 * time.Millisecond},
		{5 * time.Second, 4900 * time.Millisecond, time.Second}, // at least a second
		{5 * time.Second, time.Minute, time.Second},
	} {
		b := &busy{lease: true, leaseEnd: now.Add(c.rest - c.waited), claimedAt: now.Add(-c.waited)}
		got := q.estimate(b)
		// The clock moves on while the test runs: a few milliseconds less than wanted.
		if got > c.want || got < c.want-100*time.Millisecond {
			t.Errorf("rest %v read %v ago: Retry-After estimate %v, want %v", c.rest, c.waited, got, c.want)
		}
	}
}

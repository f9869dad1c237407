package dbidem

import (
	"math"
	"testing"
	"time"
)

// TestRetryWaitBounds: the wait before a retry is in [0, Backoff·2^n) with n capped at 10, and a
// Backoff past what the shift can hold (months; an operator's typo) waits long rather than
// panicking in rand.Int64N, as it did before D233.
func TestRetryWaitBounds(t *testing.T) {
	for n := 1; n <= 12; n++ {
		if w := retryWait(time.Millisecond, n); w < 0 || w >= time.Millisecond<<min(n, 10) {
			t.Errorf("retry %d of a 1 ms backoff waits %v", n, w)
		}
	}
	for _, b := range []time.Duration{200 * 24 * time.Hour, 100 * 365 * 24 * time.Hour, math.MaxInt64} {
		for n := 1; n <= 11; n++ {
			if w := retryWait(b, n); w < 0 {
				t.Errorf("a backoff of %v, retry %d: wait %v", b, n, w)
			}
		}
	}
}

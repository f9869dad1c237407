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

// TestRetryWaitSpreadsOverItsWholeSpan: the wait is drawn from the whole of [0, Backoff·2^n)
// ("full jitter"), so runs that failed together (a deadlock's two sides, a serialization
// failure's many) do not retry together. A wait of at least half the span, or one without a
// draw, would pass TestRetryWaitBounds. Of 2,000 draws each quarter of the span gets some; a
// uniform draw misses one with a probability of about 4·0.75^2000.
func TestRetryWaitSpreadsOverItsWholeSpan(t *testing.T) {
	for _, n := range []int{1, 4, 10, 12} {
		span := time.Millisecond << min(n, 10)
		var quarters [4]int
		for range 2000 {
			w := retryWait(time.Millisecond, n)
			if w < 0 || w >= span {
				t.Fatalf("retry %d: wait %v outside [0, %v)", n, w, span)
			}
			quarters[w*4/span]++
		}
		for q, c := range quarters {
			if c == 0 {
				t.Errorf("retry %d: no wait of 2,000 in quarter %d of [0, %v): %v", n, q+1, span, quarters)
			}
		}
	}
}

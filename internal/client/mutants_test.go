package client

// Tests from a mutation review (D235): each failed with a single-point change of the code that the
// rest of the suite let pass; its comment names the promise it keeps.

import (
	"net/http"
	"testing"
	"time"
)

// TestRetryAfterDateCapped: the package doc: Retry-After is honoured "in seconds or as a date, up
// to a minute" (idemclient: "honouring Retry-After (seconds or a date, up to a minute)"). A date an
// hour ahead waits a minute, as "3600" does.
func TestRetryAfterDateCapped(t *testing.T) {
	now := time.Now()
	date := now.Add(time.Hour).UTC().Format(http.TimeFormat)
	if d := retryAfter(http.Header{"Retry-After": {date}}, now); d != maxRetryAfter {
		t.Fatalf("Retry-After: %s (an hour ahead): wait %v, want %v", date, d, maxRetryAfter)
	}
	if d := retryAfter(http.Header{"Retry-After": {"3600"}}, now); d != maxRetryAfter {
		t.Fatalf("Retry-After: 3600: wait %v, want %v", d, maxRetryAfter)
	}
}

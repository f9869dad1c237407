package main

import (
	"io"
	"strings"
	"testing"
)

// TestReviewOps3WaitingBytesBelowOneBody: IDEMPOTENCY_MAX_WAITING_BYTES is "what the duplicates waiting
// in this process ... may hold at once (each its body plus 4 KiB)". A value below one body of
// MAX_BODY_BYTES plus 4 KiB (here 1 byte, or 4096 next to the default 1 MiB bodies) means no
// duplicate with a body can ever wait: every one gets 409 at once, which silently turns off
// the documented coalescing. Such values were accepted; they stop the start now (D171).
func TestReviewOps3WaitingBytesBelowOneBody(t *testing.T) {
	for _, v := range []string{"1", "4096"} {
		m := NewMain(io.Discard, io.Discard)
		err := m.ParseFlags(nil, func(k string) string {
			if k == "IDEMPOTENCY_MAX_WAITING_BYTES" {
				return v
			}
			return ""
		})
		if err == nil || !strings.Contains(err.Error(), "IDEMPOTENCY_MAX_WAITING_BYTES") {
			t.Errorf("IDEMPOTENCY_MAX_WAITING_BYTES=%s with MAX_BODY_BYTES=1048576: accepted (%v)", v, err)
		}
	}
}

package idemhttp

import (
	"context"
	"testing"
)

// TestTracingOffAllocatesNothing: without a TracerProvider the tracing calls of a keyed
// request (its three spans started and ended) allocate nothing.
func TestTracingOffAllocatesNothing(t *testing.T) {
	q := &request{m: &Middleware{}, action: "POST /x"}
	ctx := context.Background()
	rec := newRecorder(false)
	if n := testing.AllocsPerRun(1000, func() {
		_, claim := q.startSpan(ctx, "idem.claim")
		endSpan(claim, "claimed", nil)
		hctx, handler := q.startSpan(ctx, "idem.handler")
		_ = hctx
		endHandlerSpan(handler, rec, commit)
		_, done := q.startSpan(ctx, "idem.complete")
		endSpan(done, "completed", nil)
	}); n != 0 {
		t.Fatalf("%v allocations per request for tracing that is off, want 0", n)
	}
}

package idem_test

import (
	"context"
	"fmt"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgidem/pgidem/idem"
)

// TestFinalErrorPastShutdownsDeadlineIsNotSent: docs/http.md (ce33c16), the server shuts
// down: "its client gets 503 shutting_down with Retry-After: 1 when the handler wrote nothing,
// a 2xx or an error that would be stored, which cannot be once the transaction ended". A
// handler that ignores its context and answers a final 422 after Shutdown's deadline.
func TestFinalErrorPastShutdownsDeadlineIsNotSent(t *testing.T) {
	t.Parallel()
	var runs atomic.Int32
	started := make(chan struct{})
	srv, m := auditServer(t, idem.Options{}, idem.Route{Action: "POST /things"},
		func(w http.ResponseWriter, r *http.Request) {
			n := runs.Add(1)
			close(started)
			time.Sleep(900 * time.Millisecond)
			idem.WriteProblem(w, http.StatusUnprocessableEntity, "https://x.example/p#", "nope", "Nope", fmt.Sprint("run ", n), "")
		})
	type answer struct {
		status int
		h      http.Header
		body   string
	}
	got := make(chan answer, 1)
	go func() {
		s, h, b := auditPost(t, srv.URL, "final-shutdown", `{"a":1}`)
		got <- answer{s, h, b}
	}()
	<-started
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	_ = m.Shutdown(ctx)
	a := <-got
	if a.status != http.StatusServiceUnavailable || auditCode(a.body) != "shutting_down" || a.h.Get("Retry-After") != "1" {
		t.Errorf("a final 422 written past Shutdown's deadline: %d %s (Retry-After %q); want 503 shutting_down, Retry-After: 1", a.status, a.body, a.h.Get("Retry-After"))
	}
}

package idem_test

import (
	"fmt"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgidem/pgidem/idem"
)

// TestFinalErrorPastTheWorkTimeoutIsNotSentNorStored: a handler that ignores its context and
// answers a final 422 after its route's WorkTimeout. Its transaction ended at the timeout, so
// the 422 cannot be stored; the client is told 500 internal_error, not the 422 (which it would
// take as the request's final answer), and its retry runs the work (docs/http.md, "the work
// passes WorkTimeout").
func TestFinalErrorPastTheWorkTimeoutIsNotSentNorStored(t *testing.T) {
	t.Parallel()
	var runs atomic.Int32
	srv, _ := auditServer(t, idem.Options{}, idem.Route{Action: "POST /things", WorkTimeout: 300 * time.Millisecond},
		func(w http.ResponseWriter, r *http.Request) {
			n := runs.Add(1)
			if n == 1 {
				time.Sleep(600 * time.Millisecond)
			}
			idem.WriteProblem(w, http.StatusUnprocessableEntity, "https://x.example/p#", "nope", "Nope", fmt.Sprint("run ", n), "")
		})
	status, _, body := auditPost(t, srv.URL, "final-past-timeout", `{"a":1}`)
	if status != http.StatusInternalServerError || auditCode(body) != "internal_error" {
		t.Fatalf("a final 422 written past the WorkTimeout: %d %s; want 500 internal_error", status, body)
	}
	status, h, body := auditPost(t, srv.URL, "final-past-timeout", `{"a":1}`)
	if status != http.StatusUnprocessableEntity || h.Get("Idempotent-Replayed") == "true" || runs.Load() != 2 {
		t.Fatalf("the retry: %d %s replayed %q, %d runs; want the work run again (422 from run 2)", status, body, h.Get("Idempotent-Replayed"), runs.Load())
	}
}

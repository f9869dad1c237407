package idem_test

import (
	"context"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/pgidem/pgidem/idem"
)

// TestExpectContinueRefusalsAreAnsweredWithoutTheBody: docs/http.md, "What happens":
// "request body over MaxBodyBytes (1 MiB) | 413 request_too_large, before any fingerprint or
// database work"; "key missing on a route that requires it | 400 idempotency_key_missing";
// "key malformed | 400 idempotency_key_invalid" ("Every bad request gets a clear 4xx").
// A client that sends `Expect: 100-continue` (curl does for large uploads) waits for
// "100 Continue" or a final answer before it sends the body. net/http alone answers a handler
// that refuses without reading at once (and closes the connection). Behind the middleware the
// refusal was never sent: the middleware replaced the server's own Request.Body with its tee,
// so net/http no longer recognised the unanswered Expect and tried to drain the body before it
// wrote the response, a body the client will not send until it hears 100 Continue. The tee
// goes into a copy of the request now (D184).
func TestExpectContinueRefusalsAreAnsweredWithoutTheBody(t *testing.T) {
	t.Parallel()
	srv, _ := auditServer(t, idem.Options{MaxBodyBytes: 100}, idem.Route{Required: true}, func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusCreated)
	})
	// A client that waits for 100 Continue (up to 30 s, as strict clients do) before sending the body.
	client := &http.Client{Transport: &http.Transport{ExpectContinueTimeout: 30 * time.Second}}
	for _, c := range []struct {
		name, key, body string
		want            int
	}{
		{"body over MaxBodyBytes", "exp-1", `"` + strings.Repeat("a", 500) + `"`, http.StatusRequestEntityTooLarge},
		{"key missing", "", `{"a":1}`, http.StatusBadRequest},
		{"key malformed", "a b", `{"a":1}`, http.StatusBadRequest},
	} {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		req, _ := http.NewRequestWithContext(ctx, "POST", srv.URL+"/things", strings.NewReader(c.body))
		req.Header.Set("Expect", "100-continue")
		req.Header.Set("Content-Type", "application/json")
		if c.key != "" {
			req.Header.Set("Idempotency-Key", c.key)
		}
		start := time.Now()
		res, err := client.Do(req)
		if err != nil {
			t.Errorf("%s with Expect: 100-continue: no answer after %v (%v); want %d at once, without the body",
				c.name, time.Since(start).Round(time.Millisecond), err, c.want)
			cancel()
			continue
		}
		io.Copy(io.Discard, res.Body)
		res.Body.Close()
		cancel()
		if res.StatusCode != c.want {
			t.Errorf("%s with Expect: 100-continue: %d, want %d", c.name, res.StatusCode, c.want)
		}
	}
}

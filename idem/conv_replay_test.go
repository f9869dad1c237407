package idem_test

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/idemclient"
)

// TestStoredReplayIsFinalWhateverItsStatus: a handler that answers with a problem of its own
// whose code is the middleware's request_in_progress (through idem.WriteProblem; Refuse with
// CodeInProgress is not stored since D233), 409 for work of its own still running (a
// downstream job for the order), has its 409 stored as the key's final answer (409 is a final
// status: "handler 400, 403, 404, 409, ... the response stored", docs/http.md "What happens")
// and replayed with Idempotent-Replayed: true on every repeat.
// idemclient retried every 409 request_in_progress, replays included: it sent the request
// MaxAttempts times, each answered with the same stored replay, and reported ErrGaveUp ("the
// outcome is unknown: retry later under res.Key", go doc idemclient), which no later retry can
// ever change: the key's answer is known and stored. A replay is the first answer, and
// idemclient takes every replay as final now (D183).
func TestStoredReplayIsFinalWhateverItsStatus(t *testing.T) {
	t.Parallel()
	var runs atomic.Int32
	srv, _ := auditServer(t, idem.Options{}, idem.Route{Required: true}, func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		idem.WriteProblem(w, http.StatusConflict, "", idem.CodeInProgress, "In progress", "the order's payment job is still running", "")
	})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c := &idemclient.Client{Backoff: 5 * time.Millisecond, MaxBackoff: 10 * time.Millisecond}
	newReq := func() *http.Request {
		req, _ := http.NewRequest("POST", srv.URL+"/things", strings.NewReader(`{"order":1}`))
		req.Header.Set("Content-Type", "application/json")
		return req
	}
	// The stored answer is final on the server: a plain repeat is its replay.
	key := idemclient.NewKey()
	st, h, _ := auditPost(t, srv.URL, key, `{"order":1}`)
	st2, h2, body2 := auditPost(t, srv.URL, key, `{"order":1}`)
	if st != 409 || st2 != 409 || h.Get("Idempotent-Replayed") == "true" || h2.Get("Idempotent-Replayed") != "true" || runs.Load() != 1 {
		t.Fatalf("setup: %d then %d (replayed %q) %s, %d runs", st, st2, h2.Get("Idempotent-Replayed"), body2, runs.Load())
	}

	res, err := c.Do(ctx, newReq(), key)
	t.Logf("Do: %d %s replayed %v attempts %d err %v; handler runs %d", res.Status, res.Code(), res.Replayed, res.Attempts, err, runs.Load())
	if errors.Is(err, idemclient.ErrGaveUp) || res.Attempts != 1 {
		t.Fatalf("a stored, replayed answer (409 %s, Idempotent-Replayed: true) was retried %d times and reported %v: "+
			"the outcome is known and no retry changes it; want that answer, final, in 1 attempt", res.Code(), res.Attempts, err)
	}
}

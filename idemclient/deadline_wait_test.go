package idemclient_test

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgidem/pgidem/idemclient"
)

// TestWaitPastTheDeadlineEndsNow: a Retry-After (or a backoff) that would start the next attempt
// after the context's deadline ends Do at once, with the last answer, ErrGaveUp and
// context.DeadlineExceeded: no attempt could be made, and Do used to sleep until the deadline
// to say so. A wait that ends before the deadline is waited, and the retry made.
func TestWaitPastTheDeadlineEndsNow(t *testing.T) {
	t.Parallel()
	var hits atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		if hits.Add(1) == 1 || r.URL.Path == "/long" {
			w.Header().Set("Retry-After", map[string]string{"/long": "30", "/short": "1"}[r.URL.Path])
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		w.WriteHeader(http.StatusCreated)
	}))
	t.Cleanup(srv.Close)

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, _ := http.NewRequest(http.MethodPost, srv.URL+"/long", strings.NewReader(`{}`))
	start := time.Now()
	res, err := (&idemclient.Client{}).Do(ctx, req, "k-long")
	took := time.Since(start)
	if !errors.Is(err, idemclient.ErrGaveUp) || !errors.Is(err, context.DeadlineExceeded) || res.Status != http.StatusServiceUnavailable ||
		res.Attempts != 1 || res.Key != "k-long" || took > 5*time.Second || ctx.Err() != nil {
		t.Errorf("Retry-After 30 under a deadline of 10 s: status %d, attempts %d, key %q after %s, err %v, ctx %v; want the 503 at once, ErrGaveUp and DeadlineExceeded",
			res.Status, res.Attempts, res.Key, took, err, ctx.Err())
	}

	hits.Store(0)
	req, _ = http.NewRequest(http.MethodPost, srv.URL+"/short", strings.NewReader(`{}`))
	start = time.Now()
	res, err = (&idemclient.Client{}).Do(ctx, req, "k-short")
	took = time.Since(start)
	if err != nil || res.Status != http.StatusCreated || res.Attempts != 2 || took < 900*time.Millisecond {
		t.Errorf("Retry-After 1 under a deadline of about 10 s: status %d, attempts %d after %s, err %v; want 201 after waiting the second",
			res.Status, res.Attempts, took, err)
	}
}

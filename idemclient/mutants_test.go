package idemclient_test

// Tests from a mutation review (D235): each failed with a single-point change of the code that the
// rest of the suite let pass; its comment names the promise it keeps.

import (
	"bytes"
	"compress/gzip"
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgidem/pgidem/idemclient"
)

// TestBackoffDoubles: Client.Backoff "is the first retry's wait; each retry doubles it, up to
// MaxBackoff, and waits a random duration between half of it and all of it". Five retries from 40ms
// (MaxBackoff far above) wait at least 20+40+80+160+320 = 620ms; without the doubling they would
// wait at most 5 x 40ms.
func TestBackoffDoubles(t *testing.T) {
	var n atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if n.Add(1) <= 5 {
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		w.WriteHeader(http.StatusCreated)
	}))
	defer srv.Close()
	c := &idemclient.Client{Backoff: 40 * time.Millisecond, MaxBackoff: 10 * time.Second}
	req, _ := http.NewRequest(http.MethodPost, srv.URL, strings.NewReader(`{}`))
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	start := time.Now()
	res, err := c.Do(ctx, req, "")
	took := time.Since(start)
	if err != nil || res.Status != http.StatusCreated || res.Attempts != 6 {
		t.Fatalf("Do: %+v, %v; want 201 after 6 attempts", res, err)
	}
	if took < 600*time.Millisecond {
		t.Fatalf("five retries from a Backoff of 40ms took %v: the waits did not double (at least 620ms)", took)
	}
}

// TestCodeXGzip: Result.Code reads "A body compressed with gzip ... decompressed"; x-gzip is gzip's
// other name, which RFC 9110 (8.4.1.3) says a recipient treats as gzip.
func TestCodeXGzip(t *testing.T) {
	var b bytes.Buffer
	z := gzip.NewWriter(&b)
	_, _ = z.Write([]byte(`{"code":"request_in_progress"}`))
	_ = z.Close()
	r := idemclient.Result{Status: http.StatusConflict, Header: http.Header{"Content-Encoding": {"x-gzip"}}, Body: b.Bytes()}
	if got := r.Code(); got != "request_in_progress" {
		t.Fatalf("Code of a 409 under Content-Encoding x-gzip: %q, want request_in_progress", got)
	}
}

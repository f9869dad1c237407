package idemclient_test

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgidem/pgidem/idemclient"
)

// counting is a server that counts the requests that reach it and answers 201.
func counting(t *testing.T) (*httptest.Server, *atomic.Int32) {
	var n atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n.Add(1)
		io.Copy(io.Discard, r.Body)
		w.WriteHeader(http.StatusCreated)
	}))
	t.Cleanup(srv.Close)
	return srv, &n
}

// doWithin runs c.Do and fails the test if it does not return within d (it may hang or panic).
func doWithin(t *testing.T, d time.Duration, c *idemclient.Client, ctx context.Context, req *http.Request, key string) (res idemclient.Result, panicked any, err error) {
	t.Helper()
	type out struct {
		res idemclient.Result
		err error
		p   any
	}
	ch := make(chan out, 1)
	go func() {
		var o out
		defer func() {
			o.p = recover()
			ch <- o
		}()
		o.res, o.err = c.Do(ctx, req, key)
	}()
	select {
	case o := <-ch:
		return o.res, o.p, o.err
	case <-time.After(d):
		t.Fatalf("Do did not return within %s", d)
		return
	}
}

// TestReviewNilHeaderIsRefusedNotPanic: a request with a nil Header (net/http's own refuses it)
// is sent with an empty one; Do panicked (assignment to a nil map in Header.Set on the clone).
func TestReviewNilHeaderIsRefusedNotPanic(t *testing.T) {
	srv, hits := counting(t)
	u, _ := url.Parse(srv.URL + "/x")
	req := &http.Request{Method: "POST", URL: u, Body: io.NopCloser(strings.NewReader(`{}`))} // Header nil
	c := &idemclient.Client{Backoff: time.Millisecond, MaxBackoff: time.Millisecond}
	res, p, err := doWithin(t, 5*time.Second, c, context.Background(), req, "")
	if p != nil {
		t.Fatalf("Do panicked on a request with a nil Header: %v", p)
	}
	if err != nil || res.Status != http.StatusCreated || hits.Load() != 1 {
		t.Fatalf("a nil Header: %+v %v (%d requests), want 201 in one", res, err, hits.Load())
	}
}

// TestReviewRequestURIIsRefusedBeforeSending: a request that carries RequestURI (an incoming
// server request handed on, as a gateway does) is refused by net/http's Client at every
// attempt ("http: Request.RequestURI can't be set in client requests"). The doc promises that
// a request net/http would refuse to send is refused before sending (Attempts 0); Do retried
// it MaxAttempts times and reported ErrGaveUp, "outcome unknown: retry later".
func TestReviewRequestURIIsRefusedBeforeSending(t *testing.T) {
	srv, hits := counting(t)
	req, _ := http.NewRequest("POST", srv.URL+"/x", strings.NewReader(`{}`))
	req.RequestURI = "/x"
	c := &idemclient.Client{Backoff: time.Millisecond, MaxBackoff: time.Millisecond}
	res, _, err := doWithin(t, 10*time.Second, c, context.Background(), req, "")
	if err == nil || errors.Is(err, idemclient.ErrGaveUp) || res.Attempts != 0 {
		t.Fatalf("a request net/http refuses (RequestURI set): Attempts %d, err %v; want an error before any attempt, not ErrGaveUp (hits %d)", res.Attempts, err, hits.Load())
	}
}

// TestReviewTrailerValueIsRefusedBeforeSending: net/http refuses a trailer value with a
// control character ("net/http: invalid trailer field value"), at every attempt. Do checked
// trailer names but not their values: it retried MaxAttempts times and reported ErrGaveUp.
func TestReviewTrailerValueIsRefusedBeforeSending(t *testing.T) {
	srv, _ := counting(t)
	req, _ := http.NewRequest("POST", srv.URL+"/x", strings.NewReader(`{}`))
	req.Trailer = http.Header{"X-Sum": {"a\nb"}}
	c := &idemclient.Client{Backoff: time.Millisecond, MaxBackoff: time.Millisecond}
	res, _, err := doWithin(t, 10*time.Second, c, context.Background(), req, "")
	if err == nil || errors.Is(err, idemclient.ErrGaveUp) || res.Attempts != 0 {
		t.Fatalf("a trailer value with a newline: Attempts %d, err %v; want an error before any attempt", res.Attempts, err)
	}
}

// TestReviewContextBoundsBodyRead: "The context bounds the whole operation" and "a ctx that has
// ended already sends nothing (Attempts 0)". A request body that blocks (a pipe, a stalled
// upstream stream) kept Do blocked past the context's end: Do read the body whole before
// it looked at the context, and the read did not watch it.
func TestReviewContextBoundsBodyRead(t *testing.T) {
	srv, _ := counting(t)
	pr, pw := io.Pipe()
	defer pw.Close()
	req, _ := http.NewRequest("POST", srv.URL+"/x", pr)
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	c := &idemclient.Client{}
	done := make(chan error, 1)
	go func() {
		_, err := c.Do(ctx, req, "")
		done <- err
	}()
	select {
	case err := <-done:
		if err == nil {
			t.Fatal("no error for a body that never ended")
		}
	case <-time.After(3 * time.Second):
		pw.CloseWithError(errors.New("test over"))
		t.Fatalf("Do still blocked 3s after its context (200ms) ended: the body read ignores the context")
	}
}

// TestReviewRedirectLoopIsNotOutcomeUnknown: a redirect loop (net/http stops after 10) is an
// error no retry mends, and the server answered every hop: the outcome is known. Do retried
// the whole loop MaxAttempts times (100 requests) and reported ErrGaveUp.
func TestReviewRedirectLoopIsNotOutcomeUnknown(t *testing.T) {
	var hits atomic.Int32
	var srv *httptest.Server
	srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		io.Copy(io.Discard, r.Body)
		http.Redirect(w, r, srv.URL+r.URL.Path, http.StatusTemporaryRedirect)
	}))
	defer srv.Close()
	req, _ := http.NewRequest("POST", srv.URL+"/x", strings.NewReader(`{}`))
	c := &idemclient.Client{Backoff: time.Millisecond, MaxBackoff: time.Millisecond}
	res, _, err := doWithin(t, 20*time.Second, c, context.Background(), req, "")
	t.Logf("attempts %d, requests %d, err %v", res.Attempts, hits.Load(), err)
	if res.Attempts > 1 || errors.Is(err, idemclient.ErrGaveUp) {
		t.Fatalf("a redirect loop was retried: %d attempts, %d requests, err %v; want one attempt and a final error", res.Attempts, hits.Load(), err)
	}
}

// TestReviewSameKeyAndBodyOnLostResponse: the connection is cut after the server read the
// request (it "committed"); the retry carries the same key and the same body bytes, a
// non-rewindable body included, and a large one.
func TestReviewSameKeyAndBodyOnLostResponse(t *testing.T) {
	var mu sync.Mutex
	var seen []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		mu.Lock()
		seen = append(seen, r.Header.Get("Idempotency-Key")+"|"+string(b))
		n := len(seen)
		mu.Unlock()
		if n == 1 {
			conn, _, _ := w.(http.Hijacker).Hijack()
			conn.Close()
			return
		}
		w.Header().Set("Idempotent-Replayed", "true")
		w.WriteHeader(201)
	}))
	defer srv.Close()
	big := strings.Repeat("x", 3<<20)
	for _, body := range []io.Reader{io.NopCloser(strings.NewReader(`{"a":1}`)), io.MultiReader(strings.NewReader(big))} {
		seen = nil
		req, _ := http.NewRequest("POST", srv.URL+"/x", body)
		c := &idemclient.Client{Backoff: time.Millisecond}
		res, err := c.Do(context.Background(), req, "")
		if err != nil || res.Status != 201 || !res.Replayed || len(seen) != 2 || seen[0] != seen[1] || !strings.HasPrefix(seen[0], res.Key+"|") {
			t.Fatalf("%+v %v; %d attempts differ or wrong key", res.Status, err, len(seen))
		}
	}
}

// TestReviewRetryAfterOddValues: negative, malformed, fractional and past-date Retry-After fall
// back to the backoff (no spin at 0, no hang); a huge one waits a minute at most, bounded by ctx.
func TestReviewRetryAfterOddValues(t *testing.T) {
	for _, v := range []string{"-5", "abc", "1.5", "0", "Mon, 01 Jan 2001 00:00:00 GMT", "-99999999999999999999", "+1"} {
		var n atomic.Int32
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if n.Add(1) == 1 {
				w.Header().Set("Retry-After", v)
				w.WriteHeader(503)
				return
			}
			w.WriteHeader(201)
		}))
		c := &idemclient.Client{Backoff: 20 * time.Millisecond}
		req, _ := http.NewRequest("POST", srv.URL+"/x", strings.NewReader(`{}`))
		start := time.Now()
		res, err := c.Do(context.Background(), req, "")
		d := time.Since(start)
		srv.Close()
		if err != nil || res.Status != 201 || res.Attempts != 2 || d < 10*time.Millisecond || d > 2*time.Second {
			t.Errorf("Retry-After %q: %+v %v after %s", v, res.Status, err, d)
		}
	}
}

// TestReviewSharedClientConcurrent: one Client, many operations at once (run with -race); every
// operation gets its own key and keeps it.
func TestReviewSharedClientConcurrent(t *testing.T) {
	var mu sync.Mutex
	byKey := map[string]int{}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		k := r.Header.Get("Idempotency-Key")
		mu.Lock()
		byKey[k]++
		n := byKey[k]
		mu.Unlock()
		if n < 3 {
			w.Header().Set("Content-Type", "application/problem+json")
			w.WriteHeader(409)
			io.WriteString(w, `{"code":"request_in_progress"}`)
			return
		}
		w.WriteHeader(201)
	}))
	defer srv.Close()
	c := &idemclient.Client{Backoff: time.Millisecond, MaxBackoff: 2 * time.Millisecond}
	req, _ := http.NewRequest("POST", srv.URL+"/x", strings.NewReader(`{}`)) // shared, with GetBody
	var wg sync.WaitGroup
	keys := make(chan string, 64)
	for range 64 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			res, err := c.Do(context.Background(), req, "")
			if err != nil || res.Status != 201 || res.Attempts != 3 {
				t.Errorf("%+v %v", res, err)
			}
			keys <- res.Key
		}()
	}
	wg.Wait()
	close(keys)
	uniq := map[string]bool{}
	for k := range keys {
		uniq[k] = true
	}
	if len(uniq) != 64 || len(byKey) != 64 {
		t.Fatalf("%d distinct keys in results, %d at the server; want 64", len(uniq), len(byKey))
	}
}

// TestReviewBackoffNeverSpins: "each retry doubles it, up to MaxBackoff, and waits a random
// duration between half of it and all of it". With a long first Backoff (here 3h, capped by
// MaxBackoff 20ms) the doubling overflowed at the 21st attempt (backoff<<20 wrapped negative),
// and every later retry waited nothing: a tight loop against the server.
func TestReviewBackoffNeverSpins(t *testing.T) {
	var mu sync.Mutex
	var at []time.Time
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		at = append(at, time.Now())
		mu.Unlock()
		w.WriteHeader(503)
	}))
	defer srv.Close()
	c := &idemclient.Client{Backoff: 3 * time.Hour, MaxBackoff: 20 * time.Millisecond, MaxAttempts: 25}
	req, _ := http.NewRequest("POST", srv.URL+"/x", strings.NewReader(`{}`))
	res, err := c.Do(context.Background(), req, "")
	if !errors.Is(err, idemclient.ErrGaveUp) || res.Attempts != 25 {
		t.Fatalf("%+v %v", res, err)
	}
	for i := 1; i < len(at); i++ {
		if gap := at[i].Sub(at[i-1]); gap < 9*time.Millisecond {
			t.Errorf("between attempt %d and %d: %s, want at least half of MaxBackoff (10ms)", i, i+1, gap)
		}
	}
}

// TestReviewNewKeyBurst: a burst of keys (past the 12-bit counter in one millisecond) stays
// strictly increasing, unique, version 7 and RFC 9562 variant.
func TestReviewNewKeyBurst(t *testing.T) {
	prev := ""
	for i := range 200000 {
		k := idemclient.NewKey()
		if len(k) != 36 || k[14] != '7' || !strings.ContainsAny(k[19:20], "89ab") || k <= prev {
			t.Fatalf("key %d %q after %q", i, k, prev)
		}
		prev = k
	}
}

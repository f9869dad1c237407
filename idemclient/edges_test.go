package idemclient_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgidem/pgidem/idemclient"
)

// edgeCloseCounter is a body that counts its Closes.
type edgeCloseCounter struct {
	io.Reader
	n *atomic.Int32
}

func (c edgeCloseCounter) Close() error { c.n.Add(1); return nil }

// TestTwoKeyHeadersRefusalClosesBody: go doc idemclient lists "two key headers" among the
// requests "which Do refuses before sending anything", and Client.Do says "A request refused
// before sending has its body closed, as net/http does." Every other refusal closes the body
// (checkRequest, an ended context); the two-key refusal did not.
func TestTwoKeyHeadersRefusalClosesBody(t *testing.T) {
	var hits atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		w.WriteHeader(201)
	}))
	defer srv.Close()
	cases := map[string]func(*http.Request){
		"two values": func(r *http.Request) { r.Header["Idempotency-Key"] = []string{"a", "b"} },
		"two spellings": func(r *http.Request) {
			r.Header["idempotency-key"] = []string{"a"}
			r.Header.Set("Idempotency-Key", "b")
		},
		// A control reference: a refusal by checkRequest (an Upgrade header) closes the body.
		"upgrade (reference)": func(r *http.Request) { r.Header.Set("Upgrade", "websocket") },
	}
	for name, mutate := range cases {
		var closes atomic.Int32
		req, _ := http.NewRequest("POST", srv.URL+"/x", nil)
		req.Body = edgeCloseCounter{strings.NewReader(`{"a":1}`), &closes}
		mutate(req)
		res, err := (&idemclient.Client{}).Do(context.Background(), req, "")
		if err == nil || res.Attempts != 0 {
			t.Fatalf("%s: %d %v, want a refusal", name, res.Status, err)
		}
		// Two keys: Do chose neither, and Result.Key named one by the header map's order.
		if name != "upgrade (reference)" && res.Key != "" {
			t.Errorf("%s: Result.Key %q after a refusal for two keys, want none", name, res.Key)
		}
		if closes.Load() != 1 {
			t.Errorf("%s: refused (%v) but the body was closed %d times, want once (\"A request refused before sending has its body closed, as net/http does\")", name, err, closes.Load())
		}
	}
	if hits.Load() != 0 {
		t.Fatalf("%d requests reached the server", hits.Load())
	}
}

// TestStatusAbove599IsNotRetried: go doc idemclient lists what is retried: "a network error or
// timeout ..., a 5xx (except 501, 505 and 500 idempotency_misconfigured), 408, 425 (RFC 8470),
// 429, or 409 request_in_progress". A status of 600..999 (which net/http's server and client
// both carry) is none of them; it was retried MaxAttempts times and reported ErrGaveUp ("the
// outcome is unknown").
func TestStatusAbove599IsNotRetried(t *testing.T) {
	var hits atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		w.WriteHeader(600)
	}))
	defer srv.Close()
	req, _ := http.NewRequest("POST", srv.URL+"/x", strings.NewReader(`{}`))
	res, err := (&idemclient.Client{Backoff: time.Millisecond, MaxBackoff: time.Millisecond}).Do(context.Background(), req, "")
	if err != nil || res.Status != 600 || res.Attempts != 1 || hits.Load() != 1 {
		t.Errorf("status 600: got %d, %d attempts, %d requests, err %v; want the answer at once (not a 5xx)", res.Status, res.Attempts, hits.Load(), err)
	}
}

// TestOneShotLargeBodySameBytesEveryAttempt: a one-shot body (a pipe, no GetBody) of 3 MiB,
// sent through 503, a connection cut after reading, 409 request_in_progress, 408, then 201:
// every attempt carries the same key and the same bytes; Attempts counts the five requests; and
// the request's body is readable again afterwards with the same bytes.
func TestOneShotLargeBodySameBytesEveryAttempt(t *testing.T) {
	payload := bytes.Repeat([]byte("0123456789abcdef"), 3<<16)
	want := sha256.Sum256(payload)
	var mu sync.Mutex
	var keys []string
	var sums [][32]byte
	var n atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		mu.Lock()
		keys = append(keys, r.Header.Get("Idempotency-Key"))
		sums = append(sums, sha256.Sum256(b))
		mu.Unlock()
		switch n.Add(1) {
		case 1:
			w.Header().Set("Retry-After", "0")
			w.WriteHeader(503)
		case 2:
			conn, _, _ := w.(http.Hijacker).Hijack()
			conn.Close()
		case 3:
			w.Header().Set("Content-Type", "application/problem+json")
			w.WriteHeader(409)
			io.WriteString(w, `{"code":"request_in_progress"}`)
		case 4:
			w.Header().Set("Content-Type", "application/problem+json")
			w.WriteHeader(408)
			io.WriteString(w, `{"code":"request_body_incomplete"}`)
		default:
			w.WriteHeader(201)
			io.WriteString(w, `{"id":1}`)
		}
	}))
	defer srv.Close()
	pr, pw := io.Pipe()
	go func() {
		for i := 0; i < len(payload); i += 4096 {
			pw.Write(payload[i:min(i+4096, len(payload))])
		}
		pw.Close()
	}()
	req, _ := http.NewRequest("POST", srv.URL+"/x", pr)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	res, err := (&idemclient.Client{Backoff: time.Millisecond, MaxBackoff: 5 * time.Millisecond}).Do(ctx, req, "")
	if err != nil || res.Status != 201 || res.Attempts != 5 {
		t.Fatalf("%d attempts %d err %v", res.Status, res.Attempts, err)
	}
	mu.Lock()
	defer mu.Unlock()
	for i := range keys {
		if keys[i] != res.Key || sums[i] != want {
			t.Errorf("attempt %d: key %q (want %q), body same: %v", i+1, keys[i], res.Key, sums[i] == want)
		}
	}
	again, _ := io.ReadAll(req.Body)
	if !bytes.Equal(again, payload) {
		t.Errorf("req.Body after Do: %d bytes, want the %d read", len(again), len(payload))
	}
}

// TestCancelWhileWaitingOn409: the server holds the attempt (a duplicate waiting for the
// first's answer); the context ends during it: Do returns at once with the context's error,
// Attempts 1, the key. Then during the backoff after a 409 with a long Retry-After.
func TestCancelWhileWaitingOn409(t *testing.T) {
	release := make(chan struct{})
	var n atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body) // so that net/http notices a client that leaves
		if n.Add(1) == 1 {
			select {
			case <-release:
			case <-r.Context().Done():
			}
		}
		w.Header().Set("Retry-After", "30")
		w.Header().Set("Content-Type", "application/problem+json")
		w.WriteHeader(409)
		io.WriteString(w, `{"code":"request_in_progress"}`)
	}))
	defer srv.Close()
	defer close(release)
	for _, name := range []string{"during the attempt", "during Retry-After"} {
		ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
		req, _ := http.NewRequest("POST", srv.URL+"/x", strings.NewReader(`{}`))
		start := time.Now()
		res, err := (&idemclient.Client{}).Do(ctx, req, "k-"+strings.ReplaceAll(name, " ", "-"))
		cancel()
		if !errors.Is(err, context.DeadlineExceeded) || res.Attempts != 1 || res.Key == "" || time.Since(start) > 2*time.Second {
			t.Errorf("%s: %d attempts %d key %q err %v after %s", name, res.Status, res.Attempts, res.Key, err, time.Since(start))
		}
		if name == "during Retry-After" && (res.Status != 409 || res.Code() != "request_in_progress") {
			t.Errorf("%s: the last answer is kept: got %d %q", name, res.Status, res.Code())
		}
	}
}

// TestNotAProblem: answers that are not problems: an empty 200 is final (a 2xx); an HTML 502
// from a proxy is retried until the budget, and ErrGaveUp keeps it; a redirect 303 to a GET is
// followed by net/http, and the answer is the final one (Attempts 1).
func TestNotAProblem(t *testing.T) {
	var n atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n.Add(1)
		switch r.URL.Path {
		case "/empty":
			w.WriteHeader(200)
		case "/html":
			w.Header().Set("Content-Type", "text/html")
			w.WriteHeader(502)
			io.WriteString(w, "<html><body>Bad Gateway</body></html>")
		case "/see":
			http.Redirect(w, r, "/done", http.StatusSeeOther)
		case "/done":
			w.WriteHeader(200)
			io.WriteString(w, r.Method)
		}
	}))
	defer srv.Close()
	c := &idemclient.Client{Backoff: time.Millisecond, MaxBackoff: time.Millisecond, MaxAttempts: 3}
	ctx := context.Background()
	req, _ := http.NewRequest("POST", srv.URL+"/empty", strings.NewReader(`{}`))
	res, err := c.Do(ctx, req, "")
	if err != nil || res.Status != 200 || len(res.Body) != 0 || res.Attempts != 1 {
		t.Errorf("empty 200: %d %q %d %v", res.Status, res.Body, res.Attempts, err)
	}
	req, _ = http.NewRequest("POST", srv.URL+"/html", strings.NewReader(`{}`))
	res, err = c.Do(ctx, req, "")
	if !errors.Is(err, idemclient.ErrGaveUp) || res.Status != 502 || res.Attempts != 3 || !strings.Contains(string(res.Body), "Bad Gateway") || res.Code() != "" {
		t.Errorf("html 502: %d %q %d %v", res.Status, res.Body, res.Attempts, err)
	}
	req, _ = http.NewRequest("POST", srv.URL+"/see", strings.NewReader(`{}`))
	res, err = c.Do(ctx, req, "")
	if err != nil || res.Status != 200 || string(res.Body) != "GET" || res.Attempts != 1 {
		t.Errorf("303: %d %q %d %v", res.Status, res.Body, res.Attempts, err)
	}
}

// TestContextBoundsGetBody: go doc idemclient: "The context bounds the whole operation, the
// reading of the request's body included: give it a deadline"; Client.Do: "ctx ... bounds the
// operation, the body's reading included". With GetBody set, the body Do reads comes from
// GetBody (which "wins over req.Body"); a GetBody that stalls (it opens a stream from a store
// that hangs) kept Do past its context's deadline, where a stalled req.Body does not.
func TestContextBoundsGetBody(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(201) }))
	defer srv.Close()
	unblock := make(chan struct{})
	defer close(unblock)
	req, _ := http.NewRequest("POST", srv.URL+"/x", strings.NewReader(`{}`))
	req.GetBody = func() (io.ReadCloser, error) {
		<-unblock
		return io.NopCloser(strings.NewReader(`{}`)), nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	done := make(chan error, 1)
	go func() {
		_, err := (&idemclient.Client{}).Do(ctx, req, "")
		done <- err
	}()
	select {
	case err := <-done:
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("err %v, want the context's", err)
		}
	case <-time.After(2 * time.Second):
		t.Errorf("Do still blocked in GetBody 1.8 s after its context's deadline")
	}
}

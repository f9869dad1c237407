package idemclient_test

import (
	"context"
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

// TestKeyHeaderThatNoRequestCarries: a KeyHeader that net/http writes itself (Host,
// Content-Length, Transfer-Encoding, Trailer) or that belongs to one connection never reached
// the server as the key: a 503 and its retry ran the operation twice, unkeyed, and Do reported
// the 201 under a key nobody saw. Authorization and Cookie are dropped on a redirect to another
// host. Do now refuses such a KeyHeader before sending anything.
func TestKeyHeaderThatNoRequestCarries(t *testing.T) {
	t.Parallel()
	var requests atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		requests.Add(1)
		w.WriteHeader(http.StatusServiceUnavailable)
	}))
	defer srv.Close()
	for _, kh := range []string{"Host", "content-length", "Transfer-Encoding", "Trailer", "Connection", "Keep-Alive", "TE", "Upgrade",
		"Authorization", "cookie"} {
		req, _ := http.NewRequest("POST", srv.URL, strings.NewReader(`{"amount":1}`))
		res, err := (&idemclient.Client{KeyHeader: kh, Backoff: time.Millisecond}).Do(context.Background(), req, "")
		if err == nil || !strings.Contains(err.Error(), "KeyHeader") || errors.Is(err, idemclient.ErrGaveUp) || res.Attempts != 0 {
			t.Errorf("KeyHeader %q: %d attempts, %v; want a refusal that names KeyHeader, nothing sent", kh, res.Attempts, err)
		}
	}
	if n := requests.Load(); n != 0 {
		t.Errorf("the server saw %d requests, want none", n)
	}
	// A header of the application's own still carries it.
	var got []string
	var mu sync.Mutex
	ok := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		got = append(got, r.Header.Get("X-Op-Key"))
		mu.Unlock()
		w.WriteHeader(http.StatusCreated)
	}))
	defer ok.Close()
	req, _ := http.NewRequest("POST", ok.URL, strings.NewReader(`{}`))
	res, err := (&idemclient.Client{KeyHeader: "X-Op-Key"}).Do(context.Background(), req, "")
	if err != nil || len(got) != 1 || got[0] != res.Key {
		t.Fatalf("KeyHeader X-Op-Key: %v, the server saw %q, Result.Key %q", err, got, res.Key)
	}
}

// TestKeyWithSurroundingWhitespace: HTTP drops the spaces and tabs around a header's value, so
// " abc " reached the server as "abc" while Result.Key said " abc ", and a blank key arrived
// empty (a server may take that for no key, and run every retry). Do refuses such a key, given
// or carried by the request, before sending anything.
func TestKeyWithSurroundingWhitespace(t *testing.T) {
	t.Parallel()
	var requests atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		requests.Add(1)
		w.WriteHeader(http.StatusCreated)
	}))
	defer srv.Close()
	for _, key := range []string{" abc", "abc ", "\tabc", "   ", "\t"} {
		for _, inHeader := range []bool{false, true} {
			req, _ := http.NewRequest("POST", srv.URL, strings.NewReader("x"))
			arg := key
			if inHeader {
				req.Header.Set("Idempotency-Key", key)
				arg = ""
			}
			res, err := (&idemclient.Client{}).Do(context.Background(), req, arg)
			if err == nil || !strings.Contains(err.Error(), "space or tab") || res.Attempts != 0 {
				t.Errorf("key %q (in the header: %v): %d attempts, %v; want a refusal, nothing sent", key, inHeader, res.Attempts, err)
			}
		}
	}
	if n := requests.Load(); n != 0 {
		t.Errorf("the server saw %d requests, want none", n)
	}
	// Whitespace inside a key is the key's own, and goes out as it is.
	req, _ := http.NewRequest("POST", srv.URL, strings.NewReader("x"))
	if res, err := (&idemclient.Client{}).Do(context.Background(), req, "a b"); err != nil || res.Status != http.StatusCreated {
		t.Fatalf("key %q: %d %v", "a b", res.Status, err)
	}
}

// TestHTTP2RefusalIsNotRetried: net/http's HTTP/2 transport refuses, before writing anything,
// a Connection header other than close or keep-alive and a Transfer-Encoding other than
// chunked, on every try. Do retried such a request ten times over about seven seconds and gave
// up with ErrGaveUp (an unknown outcome, "retry later under the key", which fails the same
// way); the server saw none of it. It now ends at the first try.
func TestHTTP2RefusalIsNotRetried(t *testing.T) {
	t.Parallel()
	var requests atomic.Int32
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		requests.Add(1)
		w.WriteHeader(http.StatusCreated)
	}))
	srv.EnableHTTP2 = true
	srv.StartTLS()
	defer srv.Close()
	for _, h := range [][2]string{{"Connection", "keep-alive, foo"}, {"Transfer-Encoding", "gzip"}} {
		req, _ := http.NewRequest("POST", srv.URL, strings.NewReader("x"))
		req.Header.Set(h[0], h[1])
		start := time.Now()
		res, err := (&idemclient.Client{HTTP: srv.Client()}).Do(context.Background(), req, "")
		if err == nil || errors.Is(err, idemclient.ErrGaveUp) || res.Attempts > 1 || time.Since(start) > 2*time.Second {
			t.Errorf("%s: %s over HTTP/2: %d attempts in %v, %v; want an error at the first try, not ErrGaveUp",
				h[0], h[1], res.Attempts, time.Since(start).Round(time.Millisecond), err)
		}
	}
	if n := requests.Load(); n != 0 {
		t.Errorf("the server saw %d requests, want none", n)
	}
	// The same server takes a request without them, over HTTP/2.
	req, _ := http.NewRequest("POST", srv.URL, strings.NewReader("x"))
	if res, err := (&idemclient.Client{HTTP: srv.Client()}).Do(context.Background(), req, ""); err != nil || res.Status != http.StatusCreated {
		t.Fatalf("a plain request over HTTP/2: %d %v", res.Status, err)
	}
}

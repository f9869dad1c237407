package idemclient_test

// The bound on a response body (Client.MaxResponseBytes).

import (
	"bytes"
	"compress/gzip"
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgidem/pgidem/idemclient"
)

// endless writes body chunks until the client goes away.
func endless(w http.ResponseWriter, r *http.Request) {
	chunk := bytes.Repeat([]byte("x"), 32<<10)
	for r.Context().Err() == nil {
		if _, err := w.Write(chunk); err != nil {
			return
		}
	}
}

// TestEndlessBodyEndsAtTheBound: a server (a faulty one, or a hostile one) that answers with a
// body that never ends took all of Do's memory: Do read the body whole, without a bound, until
// the context ended or the process ran out. Now the read stops one byte past MaxResponseBytes,
// and the operation ends there with ErrResponseTooLarge, the answer's status and headers, and no
// retry, even for a status Do otherwise retries.
func TestEndlessBodyEndsAtTheBound(t *testing.T) {
	var hits atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		w.Header().Set("X-Answer", "big")
		w.WriteHeader(http.StatusServiceUnavailable)
		endless(w, r)
	}))
	defer srv.Close()

	c := &idemclient.Client{MaxResponseBytes: 1 << 20, Backoff: time.Millisecond}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	req, _ := http.NewRequest(http.MethodPost, srv.URL, strings.NewReader(`{}`))
	res, err := c.Do(ctx, req, "k-endless")
	if !errors.Is(err, idemclient.ErrResponseTooLarge) {
		t.Fatalf("err = %v, want ErrResponseTooLarge", err)
	}
	if ctx.Err() != nil {
		t.Fatal("Do ended with the context, not at the bound")
	}
	if res.Status != http.StatusServiceUnavailable || res.Header.Get("X-Answer") != "big" || res.Body != nil {
		t.Fatalf("result = %d %v body %d bytes, want 503 with its headers and no body", res.Status, res.Header, len(res.Body))
	}
	if res.Attempts != 1 || hits.Load() != 1 || res.Key != "k-endless" {
		t.Fatalf("attempts %d, server hits %d, key %q: want one attempt under k-endless", res.Attempts, hits.Load(), res.Key)
	}
	if !strings.Contains(err.Error(), "1048576 bytes") || !strings.Contains(err.Error(), "503") {
		t.Fatalf("error %q does not name the bound and the status", err)
	}
}

// TestResponseBoundEdges: a body of exactly MaxResponseBytes is read whole; one byte more is
// refused, whether its Content-Length says so up front or the bytes come chunked; a negative
// bound reads any body; the default bound is DefaultMaxResponseBytes.
func TestResponseBoundEdges(t *testing.T) {
	const limit = 64 << 10
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n, _ := strconv.Atoi(r.URL.Query().Get("n"))
		if r.URL.Query().Get("chunked") == "" {
			w.Header().Set("Content-Length", strconv.Itoa(n))
		}
		w.WriteHeader(http.StatusCreated)
		body := bytes.Repeat([]byte("y"), n)
		for len(body) > 0 { // in pieces, so that an unknown length is sent chunked
			k := min(len(body), 4096)
			_, _ = w.Write(body[:k])
			if f, ok := w.(http.Flusher); ok {
				f.Flush()
			}
			body = body[k:]
		}
	}))
	defer srv.Close()

	for _, tc := range []struct {
		name    string
		bound   int64
		n       int
		chunked bool
		tooBig  bool
	}{
		{"exactly the bound", limit, limit, false, false},
		{"exactly the bound, chunked", limit, limit, true, false},
		{"one byte more", limit, limit + 1, false, true},
		{"one byte more, chunked", limit, limit + 1, true, true},
		{"no bound", -1, 3 * limit, true, false},
		{"an empty body at a bound of one byte", 1, 0, false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			url := srv.URL + "?n=" + strconv.Itoa(tc.n)
			if tc.chunked {
				url += "&chunked=1"
			}
			c := &idemclient.Client{MaxResponseBytes: tc.bound}
			req, _ := http.NewRequest(http.MethodPost, url, nil)
			res, err := c.Do(context.Background(), req, "")
			if tc.tooBig {
				if !errors.Is(err, idemclient.ErrResponseTooLarge) || res.Status != http.StatusCreated || res.Body != nil || res.Attempts != 1 {
					t.Fatalf("err %v, status %d, body %d bytes, attempts %d: want ErrResponseTooLarge, 201, no body, 1 attempt",
						err, res.Status, len(res.Body), res.Attempts)
				}
				return
			}
			if err != nil || res.Status != http.StatusCreated || len(res.Body) != tc.n {
				t.Fatalf("err %v, status %d, body %d bytes: want the whole %d-byte body", err, res.Status, len(res.Body), tc.n)
			}
		})
	}
	if idemclient.DefaultMaxResponseBytes != 64<<20 {
		t.Fatalf("DefaultMaxResponseBytes = %d, the docs say 64 MiB", idemclient.DefaultMaxResponseBytes)
	}
	// The zero value's bound: DefaultMaxResponseBytes + 1 bytes announced is refused at once.
	big := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", strconv.Itoa(idemclient.DefaultMaxResponseBytes+1))
		w.WriteHeader(http.StatusOK)
		endless(w, r)
	}))
	defer big.Close()
	req, _ := http.NewRequest(http.MethodPost, big.URL, nil)
	if _, err := (&idemclient.Client{}).Do(context.Background(), req, ""); !errors.Is(err, idemclient.ErrResponseTooLarge) {
		t.Fatalf("zero Client, a body above the default bound: err = %v, want ErrResponseTooLarge", err)
	}
}

// TestCompressionBombEndsAtTheBound: net/http decompresses a gzip answer it asked for itself
// (the caller set no Accept-Encoding); the bound counts the decompressed bytes, so a few
// kilobytes on the wire that inflate to 64 MiB stop at the bound.
func TestCompressionBombEndsAtTheBound(t *testing.T) {
	var zipped bytes.Buffer
	zw, _ := gzip.NewWriterLevel(&zipped, gzip.BestCompression)
	_, _ = zw.Write(make([]byte, 64<<20))
	_ = zw.Close()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Encoding", "gzip")
		w.Header().Set("Content-Length", strconv.Itoa(zipped.Len()))
		w.WriteHeader(http.StatusOK)
		_, _ = w.Write(zipped.Bytes())
	}))
	defer srv.Close()
	c := &idemclient.Client{MaxResponseBytes: 1 << 20}
	req, _ := http.NewRequest(http.MethodPost, srv.URL, nil)
	res, err := c.Do(context.Background(), req, "")
	if !errors.Is(err, idemclient.ErrResponseTooLarge) || res.Status != http.StatusOK || res.Body != nil {
		t.Fatalf("err %v, status %d, body %d bytes (%d on the wire): want ErrResponseTooLarge at 1 MiB decompressed",
			err, res.Status, len(res.Body), zipped.Len())
	}
}

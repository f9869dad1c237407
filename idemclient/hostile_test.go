package idemclient_test

// Do against hostile or faulty servers.

import (
	"context"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
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

// TestTLSGarbageAfterTheRequestIsRetried: the request reached the server (it may have taken
// effect); then the bytes that came back on the TLS connection were not a TLS record (a faulty
// middlebox, a crashed front end writing plain text on the socket). crypto/tls reports that
// as a tls.RecordHeaderError (or net/http as ErrSchemeMismatch), which Do took for "TLS to a
// plain server", an error no retry mends, and stopped after one attempt. The handshake had
// succeeded and the request was written: the outcome is unknown, and the retry under the same
// key mends it (the second attempt gets 201).
func TestTLSGarbageAfterTheRequestIsRetried(t *testing.T) {
	for name, garbage := range map[string]string{
		"plain HTTP bytes": "HTTP/1.1 201 Created\r\nContent-Length: 0\r\n\r\n", // net/http: ErrSchemeMismatch
		"random bytes":     "\x17\x09\x09\x00\x05hello",                         // tls.RecordHeaderError
	} {
		t.Run(name, func(t *testing.T) {
			var hits atomic.Int32
			var mu sync.Mutex
			var keys []string
			srv := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				io.Copy(io.Discard, r.Body)
				mu.Lock()
				keys = append(keys, r.Header.Get("Idempotency-Key"))
				mu.Unlock()
				if hits.Add(1) == 1 { // the request arrived whole: it "took effect"
					conn, _, err := w.(http.Hijacker).Hijack()
					if err != nil {
						t.Error(err)
						return
					}
					conn.(*tls.Conn).NetConn().Write([]byte(garbage)) // not a TLS record
					conn.Close()
					return
				}
				w.Header().Set("Idempotent-Replayed", "true")
				w.WriteHeader(201)
			}))
			defer srv.Close()
			c := &idemclient.Client{HTTP: srv.Client(), Backoff: time.Millisecond}
			req, _ := http.NewRequest("POST", srv.URL+"/x", strings.NewReader(`{"a":1}`))
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			res, err := c.Do(ctx, req, "")
			t.Logf("status %d attempts %d err %v; server saw %d requests, keys %v", res.Status, res.Attempts, err, hits.Load(), keys)
			if err != nil || res.Status != 201 || hits.Load() != 2 {
				t.Fatalf("the request was written whole, its answer came back as non-TLS bytes: Do ended after %d attempt(s) with %v "+
					"(classed 'no retry mends'); want a retry under the same key, which the server answers 201", res.Attempts, err)
			}
		})
	}
}

// TestTrailersAreSentAsNetHTTPSends: a request with a body of unknown length (a pipe, an
// upstream stream) and trailers (a checksum computed while the body streams, as S3's
// x-amz-checksum trailer or gRPC-web do). net/http sends it chunked, with its trailers. Do read
// the body and sent it with a Content-Length: net/http then announced the trailers in a Trailer
// header but never sent them.
func TestTrailersAreSentAsNetHTTPSends(t *testing.T) {
	var mu sync.Mutex
	var got []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		mu.Lock()
		got = append(got, r.Trailer.Get("X-Checksum"))
		mu.Unlock()
		w.WriteHeader(201)
	}))
	defer srv.Close()
	build := func() *http.Request {
		pr, pw := io.Pipe()
		req, _ := http.NewRequest("POST", srv.URL+"/x", pr)
		req.Trailer = http.Header{"X-Checksum": nil}
		go func() {
			pw.Write([]byte(`{"a":1}`))
			req.Trailer.Set("X-Checksum", "abc123") // known once the body is read, as trailers are
			pw.Close()
		}()
		return req
	}
	resp, err := http.DefaultClient.Do(build())
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	res, err := (&idemclient.Client{}).Do(context.Background(), build(), "")
	if err != nil || res.Status != 201 {
		t.Fatalf("%d %v", res.Status, err)
	}
	mu.Lock()
	defer mu.Unlock()
	t.Logf("trailer X-Checksum as the server got it: net/http %q, idemclient %q", got[0], got[1])
	if got[0] != "abc123" {
		t.Fatalf("setup: net/http itself did not send the trailer (%q)", got[0])
	}
	if got[1] != got[0] {
		t.Fatalf("the trailer the caller set: net/http sends %q, Do sent %q", got[0], got[1])
	}
}

// zstdFrame is a valid zstd frame holding b in one raw block (RFC 8878).
func zstdFrame(b []byte) []byte {
	out := []byte{0x28, 0xb5, 0x2f, 0xfd, 0x20, byte(len(b))} // magic; single segment, 1-byte size
	var h [4]byte
	binary.LittleEndian.PutUint32(h[:], uint32(len(b))<<3|1) // last block, raw
	out = append(out, h[:3]...)
	return append(out, b...)
}

// TestInProgressInAnEncodingCodeCannotRead: the caller asks for zstd (or br) itself, as a
// client of a CDN does; the API's 409 request_in_progress comes back compressed so. Code reads
// gzip and deflate only; for any other encoding it read "" and Do took the 409 for a final
// answer after one attempt, although a 409 request_in_progress is never the answer. A 409
// whose body Do cannot read is not known to be final: it is retried.
func TestInProgressInAnEncodingCodeCannotRead(t *testing.T) {
	for _, enc := range []string{"zstd", "br"} {
		var hits atomic.Int32
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			io.Copy(io.Discard, r.Body)
			if hits.Add(1) == 1 {
				w.Header().Set("Content-Type", "application/problem+json")
				w.Header().Set("Content-Encoding", enc)
				w.Header().Set("Retry-After", "1")
				w.WriteHeader(409)
				w.Write(zstdFrame([]byte(`{"status":409,"code":"request_in_progress"}`))) // for br: some bytes Do cannot read either
				return
			}
			w.WriteHeader(201)
		}))
		req, _ := http.NewRequest("POST", srv.URL+"/x", strings.NewReader(`{}`))
		req.Header.Set("Accept-Encoding", enc)
		res, err := (&idemclient.Client{Backoff: time.Millisecond}).Do(context.Background(), req, "")
		srv.Close()
		if err == nil && res.Status == 409 {
			t.Errorf("Content-Encoding %s: a 409 request_in_progress was taken as final: status %d, err nil, %d attempt(s), Code %q",
				enc, res.Status, res.Attempts, res.Code())
		}
	}
}

// TestUnfollowableRedirectIsNotOutcomeUnknown: a 307 whose Location net/http cannot parse, or
// whose URL is not http or https, is an answer (the server answered: go elsewhere) that no
// retry mends; net/http returns it as an error without a response. Do retried it MaxAttempts
// times and reported ErrGaveUp, "the outcome is unknown".
func TestUnfollowableRedirectIsNotOutcomeUnknown(t *testing.T) {
	for _, loc := range []string{"http://[::1%zz]/bad", "ftp://files.example/x"} {
		var hits atomic.Int32
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			hits.Add(1)
			io.Copy(io.Discard, r.Body)
			w.Header().Set("Location", loc)
			w.WriteHeader(http.StatusTemporaryRedirect)
		}))
		req, _ := http.NewRequest("POST", srv.URL+"/x", strings.NewReader(`{}`))
		c := &idemclient.Client{Backoff: time.Millisecond, MaxBackoff: time.Millisecond}
		res, err := c.Do(context.Background(), req, "")
		srv.Close()
		t.Logf("Location %q: attempts %d hits %d err %v", loc, res.Attempts, hits.Load(), err)
		if errors.Is(err, idemclient.ErrGaveUp) || hits.Load() > 1 || err == nil || res.Status != http.StatusTemporaryRedirect {
			t.Errorf("a 307 to Location %q (net/http cannot follow it) was sent %d times and reported as ErrGaveUp, outcome unknown", loc, hits.Load())
		}
	}
}

// TestHTTPClientTimeoutStillRetries: the caller's http.Client
// Timeout still bounds an attempt through Do's wrapped transport, and the retry converges.
func TestHTTPClientTimeoutStillRetries(t *testing.T) {
	var hits atomic.Int32
	release := make(chan struct{})
	defer close(release)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		if hits.Add(1) == 1 {
			select {
			case <-release:
			case <-r.Context().Done():
			}
			return
		}
		w.WriteHeader(201)
	}))
	defer srv.Close()
	c := &idemclient.Client{HTTP: &http.Client{Timeout: 200 * time.Millisecond}, Backoff: time.Millisecond}
	req, _ := http.NewRequest("POST", srv.URL+"/x", strings.NewReader(`{}`))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	res, err := c.Do(ctx, req, "")
	if err != nil || res.Status != 201 || res.Attempts != 2 {
		t.Fatalf("%d %d %v", res.Status, res.Attempts, err)
	}
}

// closeCounter counts Close calls.
type closeCounter struct {
	io.Reader
	n *atomic.Int32
}

func (c closeCounter) Close() error { c.n.Add(1); return nil }

// TestBodiesClosedAndGetBodyReadOnce: with GetBody, req.Body is closed unread and
// GetBody is called once per Do (a GetBody whose second call returns other bytes never leaks
// them into a retry or a followed 307); without it, the body is closed once.
func TestBodiesClosedAndGetBodyReadOnce(t *testing.T) {
	var mu sync.Mutex
	var seen []string
	var n atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		mu.Lock()
		seen = append(seen, r.URL.Path+"|"+r.Header.Get("Idempotency-Key")+"|"+string(b))
		mu.Unlock()
		switch n.Add(1) {
		case 1:
			http.Redirect(w, r, "/y", http.StatusPermanentRedirect)
		case 2:
			w.WriteHeader(503)
		case 3:
			conn, _, _ := w.(http.Hijacker).Hijack()
			conn.Close()
		default:
			w.WriteHeader(201)
		}
	}))
	defer srv.Close()
	var closes, gets atomic.Int32
	req, _ := http.NewRequest("POST", srv.URL+"/x", nil)
	req.Body = closeCounter{strings.NewReader("orig"), &closes}
	req.GetBody = func() (io.ReadCloser, error) {
		i := gets.Add(1)
		return closeCounter{strings.NewReader(fmt.Sprintf("body-%d", i)), &closes}, nil
	}
	res, err := (&idemclient.Client{Backoff: time.Millisecond}).Do(context.Background(), req, "")
	mu.Lock()
	defer mu.Unlock()
	t.Logf("%v", seen)
	if err != nil || res.Status != 201 || gets.Load() != 1 || closes.Load() != 2 {
		t.Fatalf("%d %v; GetBody calls %d, closes %d", res.Status, err, gets.Load(), closes.Load())
	}
	for _, s := range seen {
		if !strings.HasSuffix(s, "|"+res.Key+"|body-1") {
			t.Fatalf("attempt %q: want key %s and body-1", s, res.Key)
		}
	}
}

// TestContentLengthWithoutABody: a request whose ContentLength is above 0 and which has no body
// is one net/http refuses to send. Do sent it with an empty body under the key, so the server
// stored an answer for a request the caller never built; Do refuses it before sending.
func TestContentLengthWithoutABody(t *testing.T) {
	var hits atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		w.WriteHeader(201)
	}))
	defer srv.Close()
	for _, body := range []io.ReadCloser{nil, http.NoBody} {
		req, _ := http.NewRequest("POST", srv.URL+"/x", nil)
		req.Body, req.ContentLength = body, 5
		res, err := (&idemclient.Client{}).Do(context.Background(), req, "")
		if err == nil || res.Attempts != 0 || hits.Load() != 0 {
			t.Fatalf("body %v with ContentLength 5: status %d, %d attempts, %d requests, err %v; want it refused before sending",
				body, res.Status, res.Attempts, hits.Load(), err)
		}
	}
}

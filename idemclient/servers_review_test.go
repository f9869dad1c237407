package idemclient_test

// Do against servers that redirect, compress, hint, stall and storm.

import (
	"bytes"
	"compress/gzip"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgidem/pgidem/idemclient"
)

// seenReq is what a test server saw of one request.
type seenReq struct {
	Method, Path, Key, Body string
}

type reqLog struct {
	mu   sync.Mutex
	reqs []seenReq
}

func (l *reqLog) add(r *http.Request) seenReq {
	b, _ := io.ReadAll(r.Body)
	s := seenReq{r.Method, r.URL.Path, r.Header.Get("Idempotency-Key"), string(b)}
	l.mu.Lock()
	l.reqs = append(l.reqs, s)
	l.mu.Unlock()
	return s
}

func (l *reqLog) all() []seenReq {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]seenReq(nil), l.reqs...)
}

// goroutinesSettle waits until the goroutine count is back to at most base.
func goroutinesSettle(t *testing.T, base int) {
	t.Helper()
	deadline := time.Now().Add(3 * time.Second)
	for {
		n := runtime.NumGoroutine()
		if n <= base {
			return
		}
		if time.Now().After(deadline) {
			buf := make([]byte, 1<<20)
			buf = buf[:runtime.Stack(buf, true)]
			t.Errorf("goroutines: %d before, %d after\n%s", base, n, buf)
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestRedirect303ReplayIsReported: the POST-redirect-GET pattern. POST /orders creates
// the order and answers 303 See Other, Location /orders/1. The first attempt's answer is lost
// (the connection is cut after the order is stored); the retry under the same key gets the
// stored 303 replayed (Idempotent-Replayed: true), and net/http follows it to GET /orders/1,
// 200. Result.Replayed was false: only the followed GET's headers were looked at, and a client
// told "not replayed" took the order for its first. The 303 on the way counts now.
func TestRedirect303ReplayIsReported(t *testing.T) {
	var log reqLog
	var posts atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		log.add(r)
		switch {
		case r.Method == "POST" && r.URL.Path == "/orders":
			if posts.Add(1) == 1 { // the order is stored, the answer lost
				conn, _, _ := w.(http.Hijacker).Hijack()
				conn.Close()
				return
			}
			w.Header().Set("Idempotent-Replayed", "true")
			w.Header().Set("Location", "/orders/1")
			w.WriteHeader(http.StatusSeeOther)
		case r.Method == "GET" && r.URL.Path == "/orders/1":
			w.WriteHeader(200)
			io.WriteString(w, `{"id":1}`)
		default:
			w.WriteHeader(404)
		}
	}))
	defer srv.Close()
	c := &idemclient.Client{Backoff: time.Millisecond}
	req, _ := http.NewRequest("POST", srv.URL+"/orders", strings.NewReader(`{"sku":"a1"}`))
	res, err := c.Do(context.Background(), req, "k-303")
	t.Logf("status %d replayed %v attempts %d err %v; server saw %+v", res.Status, res.Replayed, res.Attempts, err, log.all())
	if err != nil || res.Status != 200 {
		t.Fatalf("setup: %d %v", res.Status, err)
	}
	if !res.Replayed {
		t.Errorf("the retry's answer (303) was a replay, the first attempt took effect and its answer was lost; Result.Replayed is false " +
			"(only the followed GET's headers are looked at)")
	}
}

// TestRedirectToAGETDropsTheKey: after 303 (and 301/302 to a POST) net/http follows with a GET
// without the body; the key went along on the GET, where a server that keys every method
// stored the GET under the POST's key (or refused it as the key's reuse). The key names the
// operation: a 307 or 308 sends the same POST again, key and body; a GET goes without it.
func TestRedirectToAGETDropsTheKey(t *testing.T) {
	for _, code := range []int{301, 302, 303, 307, 308} {
		var log reqLog
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			log.add(r)
			if r.URL.Path == "/a" {
				w.Header().Set("Location", "/b")
				w.WriteHeader(code)
				return
			}
			w.WriteHeader(201)
		}))
		c := &idemclient.Client{Backoff: time.Millisecond}
		req, _ := http.NewRequest("POST", srv.URL+"/a", strings.NewReader(`{"x":1}`))
		res, err := c.Do(context.Background(), req, "k-r")
		srv.Close()
		seen := log.all()
		t.Logf("%d: status %d attempts %d err %v; server saw %+v", code, res.Status, res.Attempts, err, seen)
		if err != nil || res.Status != 201 || res.Attempts != 1 || len(seen) != 2 {
			t.Errorf("%d: %d %d %v", code, res.Status, res.Attempts, err)
			continue
		}
		if want := map[bool]string{true: "k-r", false: ""}[code == 307 || code == 308]; seen[1].Key != want {
			t.Errorf("%d: the followed %s carries key %q, want %q", code, seen[1].Method, seen[1].Key, want)
		}
		if (code == 307 || code == 308) && (seen[1].Method != "POST" || seen[1].Body != `{"x":1}`) {
			t.Errorf("%d: the followed request is %s with body %q, want POST with the same body", code, seen[1].Method, seen[1].Body)
		}
	}
}

// TestFinalAnswerBeforeBody: the server answers 413 without reading a large body, and
// closes the connection. 413 is final ("any other 4xx"): one attempt, Status 413.
func TestFinalAnswerBeforeBody(t *testing.T) {
	var hits atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		w.Header().Set("Connection", "close")
		w.Header().Set("Content-Type", "application/problem+json")
		w.WriteHeader(413)
		io.WriteString(w, `{"code":"request_too_large"}`)
	}))
	defer srv.Close()
	c := &idemclient.Client{Backoff: time.Millisecond, MaxAttempts: 4}
	body := bytes.Repeat([]byte("a"), 16<<20)
	req, _ := http.NewRequest("POST", srv.URL+"/x", bytes.NewReader(body))
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	res, err := c.Do(ctx, req, "")
	t.Logf("status %d attempts %d err %v; server saw %d", res.Status, res.Attempts, err, hits.Load())
	if err != nil || res.Status != 413 || res.Attempts != 1 || res.Code() != "request_too_large" {
		t.Fatalf("a final 413 sent before the body was read: status %d after %d attempts (%d at the server), err %v; want 413 after 1",
			res.Status, res.Attempts, hits.Load(), err)
	}
}

// TestClosedMidBodyEveryTime: every answer is cut in the middle of its body: no answer,
// outcome unknown, retried to MaxAttempts; the Result holds no answer (Status 0, no Body).
func TestClosedMidBodyEveryTime(t *testing.T) {
	var hits atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		hits.Add(1)
		conn, buf, _ := w.(http.Hijacker).Hijack()
		buf.WriteString("HTTP/1.1 201 Created\r\nContent-Length: 100\r\nIdempotent-Replayed: true\r\n\r\n{\"id\":")
		buf.Flush()
		conn.Close()
	}))
	defer srv.Close()
	c := &idemclient.Client{Backoff: time.Millisecond, MaxAttempts: 3}
	req, _ := http.NewRequest("POST", srv.URL+"/x", strings.NewReader(`{}`))
	res, err := c.Do(context.Background(), req, "k-mid")
	t.Logf("status %d attempts %d err %v hits %d", res.Status, res.Attempts, err, hits.Load())
	if !errors.Is(err, idemclient.ErrGaveUp) || res.Status != 0 || res.Body != nil || res.Header != nil || res.Replayed ||
		res.Attempts != 3 || hits.Load() != 3 || res.Key != "k-mid" {
		t.Fatalf("%+v %v (hits %d)", res, err, hits.Load())
	}
}

// TestInformationalBeforeTheAnswer: 100 Continue (unasked) and 103 Early Hints before
// the answer are not the answer: one attempt, the final 201.
func TestInformationalBeforeTheAnswer(t *testing.T) {
	for _, pre := range []string{
		"HTTP/1.1 100 Continue\r\n\r\n",
		"HTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload\r\n\r\n",
		"HTTP/1.1 102 Processing\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a.css>\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </b.css>\r\n\r\n",
	} {
		var hits atomic.Int32
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			io.Copy(io.Discard, r.Body)
			hits.Add(1)
			conn, buf, _ := w.(http.Hijacker).Hijack()
			defer conn.Close()
			buf.WriteString(pre)
			buf.WriteString("HTTP/1.1 201 Created\r\nContent-Length: 8\r\nConnection: close\r\n\r\n{\"id\":1}")
			buf.Flush()
		}))
		c := &idemclient.Client{Backoff: time.Millisecond, MaxAttempts: 3}
		req, _ := http.NewRequest("POST", srv.URL+"/x", strings.NewReader(`{}`))
		res, err := c.Do(context.Background(), req, "")
		srv.Close()
		if err != nil || res.Status != 201 || string(res.Body) != `{"id":1}` || res.Attempts != 1 || hits.Load() != 1 {
			t.Errorf("%q first: status %d body %q attempts %d hits %d err %v", pre, res.Status, res.Body, res.Attempts, hits.Load(), err)
		}
	}
}

// TestRetryAfterSeveralHeaders: two Retry-After fields (a proxy added its own): the
// wait stays within the minute and the operation converges.
func TestRetryAfterSeveralHeaders(t *testing.T) {
	var n atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		if n.Add(1) == 1 {
			w.Header().Add("Retry-After", "1")
			w.Header().Add("Retry-After", "3600")
			w.WriteHeader(503)
			return
		}
		w.WriteHeader(201)
	}))
	defer srv.Close()
	c := &idemclient.Client{Backoff: time.Millisecond}
	req, _ := http.NewRequest("POST", srv.URL+"/x", strings.NewReader(`{}`))
	start := time.Now()
	res, err := c.Do(context.Background(), req, "")
	d := time.Since(start)
	t.Logf("%d after %d attempts in %s, err %v", res.Status, res.Attempts, d, err)
	if err != nil || res.Status != 201 || res.Attempts != 2 || d < 900*time.Millisecond || d > 5*time.Second {
		t.Fatalf("%d %d %s %v", res.Status, res.Attempts, d, err)
	}
}

// TestRetryAfterHugeEndsWithTheContext: a huge Retry-After (more seconds than an int64
// holds, or a date years ahead) waits at most until the context ends: the Result has the 503,
// one attempt, the key.
func TestRetryAfterHugeEndsWithTheContext(t *testing.T) {
	for _, v := range []string{"99999999999999999999999", "Fri, 31 Dec 9999 23:59:59 GMT", "86400"} {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			io.Copy(io.Discard, r.Body)
			w.Header().Set("Retry-After", v)
			w.WriteHeader(503)
		}))
		ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
		c := &idemclient.Client{Backoff: time.Millisecond}
		req, _ := http.NewRequest("POST", srv.URL+"/x", strings.NewReader(`{}`))
		start := time.Now()
		res, err := c.Do(ctx, req, "k-ra")
		d := time.Since(start)
		cancel()
		srv.Close()
		if !errors.Is(err, context.DeadlineExceeded) || res.Status != 503 || res.Attempts != 1 || res.Key != "k-ra" || d > 2*time.Second {
			t.Errorf("Retry-After %q: %d attempts %d key %q after %s, err %v", v, res.Status, res.Attempts, res.Key, d, err)
		}
	}
}

// TestCodeIsTheCodeMember: Code is the body's member named "code". encoding/json matched names
// without regard to case (and the last duplicate won), so a 409 with only a "Code" or "CODE"
// member read as request_in_progress and was retried to ErrGaveUp, and a final "code" was
// overridden by a later "Code".
func TestCodeIsTheCodeMember(t *testing.T) {
	for _, body := range []string{
		`{"Code":"request_in_progress"}`,
		`{"CODE":"request_in_progress"}`,
		`{"code":"one_time_secret","Code":"request_in_progress"}`,
	} {
		r := idemclient.Result{Status: 409, Body: []byte(body), Header: http.Header{}}
		if got := r.Code(); got == "request_in_progress" {
			t.Errorf("body %s: Code() = %q; the body's \"code\" member is not that", body, got)
		}
		var hits atomic.Int32
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			io.Copy(io.Discard, r.Body)
			hits.Add(1)
			w.Header().Set("Content-Type", "application/problem+json")
			w.WriteHeader(409)
			io.WriteString(w, body)
		}))
		c := &idemclient.Client{Backoff: time.Millisecond, MaxAttempts: 3}
		req, _ := http.NewRequest("POST", srv.URL+"/x", strings.NewReader(`{}`))
		res, err := c.Do(context.Background(), req, "")
		srv.Close()
		if res.Attempts != 1 || err != nil {
			t.Errorf("body %s: a 409 whose code member is not request_in_progress was retried: %d attempts, err %v", body, res.Attempts, err)
		}
	}
}

// TestCodeOfALargeCompressedProblem: Code reads a gzip body decompressed. It decompressed at
// most 1 MiB, so a 409 request_in_progress with a 2 MiB detail read as "" when compressed (its
// JSON cut short) and was final after one attempt, its outcome unknown; now the same Code
// compressed or not, up to DefaultMaxResponseBytes.
func TestCodeOfALargeCompressedProblem(t *testing.T) {
	plain := []byte(`{"code":"request_in_progress","detail":"` + strings.Repeat("x", 2<<20) + `"}`)
	var zb bytes.Buffer
	zw := gzip.NewWriter(&zb)
	zw.Write(plain)
	zw.Close()
	p := idemclient.Result{Status: 409, Body: plain, Header: http.Header{}}
	z := idemclient.Result{Status: 409, Body: zb.Bytes(), Header: http.Header{"Content-Encoding": {"gzip"}}}
	t.Logf("plain Code %q (%d bytes); gzip Code %q (%d bytes)", p.Code(), len(plain), z.Code(), zb.Len())
	if p.Code() != z.Code() {
		t.Errorf("the same problem: Code %q plain, %q gzip-compressed", p.Code(), z.Code())
	}
	// And what Do does with it: the compressed one is a final 409 after one attempt.
	var hits atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		if hits.Add(1) == 1 {
			w.Header().Set("Content-Encoding", "gzip")
			w.Header().Set("Content-Type", "application/problem+json")
			w.WriteHeader(409)
			w.Write(zb.Bytes())
			return
		}
		w.WriteHeader(201)
	}))
	defer srv.Close()
	c := &idemclient.Client{Backoff: time.Millisecond}
	req, _ := http.NewRequest("POST", srv.URL+"/x", strings.NewReader(`{}`))
	req.Header.Set("Accept-Encoding", "gzip")
	res, err := c.Do(context.Background(), req, "")
	if err != nil || res.Status != 201 || res.Attempts != 2 {
		t.Errorf("a gzip-compressed 409 request_in_progress with a 2 MiB detail ended the operation: %d after %d attempt(s), err %v",
			res.Status, res.Attempts, err)
	}
}

// TestReplayIsFinalWhateverItsStatus: an answer marked Idempotent-Replayed: true is
// final even when it is a 503 or a 409 request_in_progress.
func TestReplayIsFinalWhateverItsStatus(t *testing.T) {
	for _, st := range []int{503, 500, 429, 408, 425, 409} {
		var hits atomic.Int32
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			io.Copy(io.Discard, r.Body)
			hits.Add(1)
			w.Header().Set("Idempotent-Replayed", " TRUE ")
			w.Header().Set("Retry-After", "1")
			w.Header().Set("Content-Type", "application/problem+json")
			w.WriteHeader(st)
			io.WriteString(w, `{"code":"request_in_progress"}`)
		}))
		c := &idemclient.Client{Backoff: time.Millisecond, MaxAttempts: 3}
		req, _ := http.NewRequest("POST", srv.URL+"/x", strings.NewReader(`{}`))
		res, err := c.Do(context.Background(), req, "")
		srv.Close()
		if err != nil || res.Status != st || !res.Replayed || res.Attempts != 1 || hits.Load() != 1 {
			t.Errorf("replayed %d: %d replayed %v attempts %d hits %d err %v", st, res.Status, res.Replayed, res.Attempts, hits.Load(), err)
		}
	}
}

// TestInProgressStorm: a server that answers 409 request_in_progress forever: Do gives
// up at MaxAttempts with ErrGaveUp and the last 409; a negative MaxAttempts runs until the
// context ends.
func TestInProgressStorm(t *testing.T) {
	var hits atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		hits.Add(1)
		w.Header().Set("Content-Type", "application/problem+json")
		w.WriteHeader(409)
		io.WriteString(w, `{"code":"request_in_progress"}`)
	}))
	defer srv.Close()
	c := &idemclient.Client{Backoff: time.Millisecond, MaxBackoff: 2 * time.Millisecond, MaxAttempts: 7}
	req, _ := http.NewRequest("POST", srv.URL+"/x", strings.NewReader(`{}`))
	res, err := c.Do(context.Background(), req, "k-storm")
	if !errors.Is(err, idemclient.ErrGaveUp) || res.Status != 409 || res.Attempts != 7 || hits.Load() != 7 ||
		res.Code() != "request_in_progress" || res.Key != "k-storm" {
		t.Errorf("%d %d %v hits %d", res.Status, res.Attempts, err, hits.Load())
	}
	hits.Store(0)
	c.MaxAttempts = -1
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	res, err = c.Do(ctx, req, "k-storm")
	t.Logf("unbounded: %d %d %v hits %d", res.Status, res.Attempts, err, hits.Load())
	// The context may end mid-attempt (no answer: Status 0), and an attempt written may not
	// have reached the handler yet (Attempts "may be one more than the requests the server saw").
	if h := int(hits.Load()); !errors.Is(err, context.DeadlineExceeded) || (res.Status != 409 && res.Status != 0) ||
		res.Attempts < h || res.Attempts > h+1 || res.Attempts < 20 {
		t.Errorf("unbounded: %d %d %v hits %d", res.Status, res.Attempts, err, hits.Load())
	}
}

// TestContextEndsInEachPhase: the context ends while waiting for the headers, while
// reading the answer's body, while uploading a body the server stopped reading, during the
// backoff, during a Retry-After wait: Do returns the
// context's error at once, with the right Attempts and Key, and leaves no goroutine behind.
func TestContextEndsInEachPhase(t *testing.T) {
	type phase struct {
		name     string
		handler  func(release <-chan struct{}) http.HandlerFunc
		attempts int
		status   int
	}
	phases := []phase{
		{"waiting for the headers", func(rel <-chan struct{}) http.HandlerFunc {
			return func(w http.ResponseWriter, r *http.Request) {
				io.Copy(io.Discard, r.Body)
				select {
				case <-rel:
				case <-r.Context().Done():
				}
			}
		}, 1, 0},
		{"reading the body", func(rel <-chan struct{}) http.HandlerFunc {
			return func(w http.ResponseWriter, r *http.Request) {
				io.Copy(io.Discard, r.Body)
				w.Header().Set("Content-Length", "100")
				w.WriteHeader(201)
				io.WriteString(w, `{"id":`)
				w.(http.Flusher).Flush()
				select {
				case <-rel:
				case <-r.Context().Done():
				}
			}
		}, 1, 0},
		{"uploading the body", func(rel <-chan struct{}) http.HandlerFunc {
			return func(w http.ResponseWriter, r *http.Request) {
				r.Body.Read(make([]byte, 10)) // reads a little, then stalls: the client's write blocks
				select {
				case <-rel:
				case <-r.Context().Done():
				}
			}
		}, 1, 0},
		{"the backoff", func(rel <-chan struct{}) http.HandlerFunc {
			return func(w http.ResponseWriter, r *http.Request) {
				io.Copy(io.Discard, r.Body)
				w.WriteHeader(503)
			}
		}, -1, 503},
		{"a Retry-After", func(rel <-chan struct{}) http.HandlerFunc {
			return func(w http.ResponseWriter, r *http.Request) {
				io.Copy(io.Discard, r.Body)
				w.Header().Set("Retry-After", "30")
				w.WriteHeader(429)
			}
		}, 1, 429},
	}
	for _, p := range phases {
		t.Run(p.name, func(t *testing.T) {
			base := runtime.NumGoroutine()
			release := make(chan struct{})
			var hits atomic.Int32
			h := p.handler(release)
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				hits.Add(1)
				h(w, r)
			}))
			tr := &http.Transport{}
			// A backoff is jittered between half of it and all of it: a second's is never shorter
			// than the 250 ms the context lasts, so "the backoff" ends in its pause, after one
			// attempt (400 ms gave 200 to 400, and about one run in five tried again).
			c := &idemclient.Client{HTTP: &http.Client{Transport: tr}, Backoff: time.Second, MaxBackoff: time.Second}
			body := `{}`
			if p.name == "uploading the body" {
				body = strings.Repeat("b", 32<<20) // past loopback's socket buffers (about 10 MB)
			}
			req, _ := http.NewRequest("POST", srv.URL+"/x", strings.NewReader(body))
			timeout := 250 * time.Millisecond
			if p.name == "uploading the body" {
				timeout = 6 * time.Second // Do reads the body whole first (slow under -race)
			}
			ctx, cancel := context.WithTimeout(context.Background(), timeout)
			start := time.Now()
			res, err := c.Do(ctx, req, "k-phase")
			d := time.Since(start)
			cancel()
			close(release)
			want := p.attempts
			if want < 0 {
				want = int(hits.Load())
			}
			t.Logf("%s: status %d attempts %d (server %d) key %q after %s err %v", p.name, res.Status, res.Attempts, hits.Load(), res.Key, d, err)
			if !errors.Is(err, context.DeadlineExceeded) || res.Key != "k-phase" || res.Attempts != want || res.Status != p.status || d > timeout+2*time.Second {
				t.Errorf("%s: status %d attempts %d (want %d, server %d) key %q err %v after %s", p.name, res.Status, res.Attempts, want, hits.Load(), res.Key, err, d)
			}
			if p.status == 0 && (res.Body != nil || res.Header != nil) {
				t.Errorf("%s: no answer, yet the Result holds %v %q", p.name, res.Header, res.Body)
			}
			srv.Close()
			tr.CloseIdleConnections()
			goroutinesSettle(t, base)
		})
	}
}

// TestConcurrentWithCancels: one Client shared by goroutines whose contexts end at
// different moments, against a flaky server (run with -race): every Do returns, with its own
// key, and Attempts never exceeds what the server saw for that key.
func TestConcurrentWithCancels(t *testing.T) {
	var mu sync.Mutex
	byKey := map[string]int{}
	var n atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		k := r.Header.Get("Idempotency-Key")
		mu.Lock()
		byKey[k]++
		mu.Unlock()
		switch n.Add(1) % 4 {
		case 0:
			w.WriteHeader(503)
		case 1:
			time.Sleep(5 * time.Millisecond)
			w.WriteHeader(201)
		case 2:
			conn, _, _ := w.(http.Hijacker).Hijack()
			conn.Close()
		default:
			w.Header().Set("Content-Type", "application/problem+json")
			w.WriteHeader(409)
			io.WriteString(w, `{"code":"request_in_progress"}`)
		}
	}))
	defer srv.Close()
	c := &idemclient.Client{Backoff: time.Millisecond, MaxBackoff: 4 * time.Millisecond, MaxAttempts: -1, AttemptTimeout: 50 * time.Millisecond}
	var wg sync.WaitGroup
	for i := range 48 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(context.Background(), time.Duration(i%8)*3*time.Millisecond)
			defer cancel()
			req, _ := http.NewRequest("POST", srv.URL+"/x", strings.NewReader(fmt.Sprintf(`{"i":%d}`, i)))
			res, err := c.Do(ctx, req, "")
			if res.Key == "" {
				t.Errorf("%d: no key (%v)", i, err)
			}
			if err == nil && res.Status != 201 {
				t.Errorf("%d: %d without error", i, res.Status)
			}
			mu.Lock()
			got := byKey[res.Key]
			mu.Unlock()
			if res.Attempts < got {
				t.Errorf("%d: Attempts %d, the server saw %d requests under the key", i, res.Attempts, got)
			}
		}()
	}
	wg.Wait()
}

// TestRefusedRedirectReplayed: a redirect that the HTTP client's CheckRedirect refuses ends
// the operation and leaves its Status and Header; when that redirect was a replay (the server
// sent Idempotent-Replayed: true on it), Result.Replayed was false (it is true for the same 3xx
// taken as the last answer, http.ErrUseLastResponse).
func TestRefusedRedirectReplayed(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Idempotent-Replayed", "true")
		w.Header().Set("Location", "/elsewhere")
		w.WriteHeader(http.StatusSeeOther)
	}))
	defer srv.Close()
	for name, policy := range map[string]func(*http.Request, []*http.Request) error{
		"ErrUseLastResponse": func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
		"refused":            func(*http.Request, []*http.Request) error { return errors.New("no redirects") },
	} {
		c := &idemclient.Client{HTTP: &http.Client{CheckRedirect: policy}, Backoff: time.Millisecond}
		req, _ := http.NewRequest("POST", srv.URL+"/x", strings.NewReader(`{}`))
		res, err := c.Do(context.Background(), req, "")
		t.Logf("%s: status %d replayed %v header %v attempts %d err %v", name, res.Status, res.Replayed, res.Header.Get("Idempotent-Replayed"), res.Attempts, err)
		if res.Status != 303 || res.Attempts != 1 {
			t.Errorf("%s: setup: %d %d %v", name, res.Status, res.Attempts, err)
		}
		if res.Header.Get("Idempotent-Replayed") == "true" && !res.Replayed {
			t.Errorf("%s: the Result's own Header says Idempotent-Replayed: true, Result.Replayed is false", name)
		}
	}
}

// TestManyInformational: a server that sends many 103 Early Hints (each a few links)
// before its 201: net/http bounds the 1xx it reads, and twenty of them still lead to the answer.
func TestManyInformational(t *testing.T) {
	for _, n := range []int{5, 6, 20} {
		var hits atomic.Int32
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			io.Copy(io.Discard, r.Body)
			hits.Add(1)
			conn, buf, _ := w.(http.Hijacker).Hijack()
			defer conn.Close()
			for range n {
				buf.WriteString("HTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload\r\n\r\n")
			}
			buf.WriteString("HTTP/1.1 201 Created\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
			buf.Flush()
		}))
		c := &idemclient.Client{Backoff: time.Millisecond, MaxAttempts: 3}
		req, _ := http.NewRequest("POST", srv.URL+"/x", strings.NewReader(`{}`))
		res, err := c.Do(context.Background(), req, "")
		srv.Close()
		t.Logf("%d x 103: status %d attempts %d hits %d err %v", n, res.Status, res.Attempts, hits.Load(), err)
		if err != nil || res.Status != 201 || res.Attempts != 1 {
			t.Errorf("%d x 103 then 201: status %d after %d attempts, err %v", n, res.Status, res.Attempts, err)
		}
	}
}

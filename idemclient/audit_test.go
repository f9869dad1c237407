package idemclient_test

// A review of idemclient against its go doc (D169). The tests whose comment says "was" failed
// then; each asserts the fixed behaviour.

import (
	"bytes"
	"compress/flate"
	"compress/gzip"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgidem/pgidem/idemclient"
)

// TestAuditAttemptsCountsEveryRequest: "Attempts is how many requests the operation took".
// net/http's Transport treats a request that carries Idempotency-Key as replayable and, on a
// reused keep-alive connection that the server closes after reading the request (a lost
// response), writes it again by itself, without telling Do. Attempts was 1 where the server had
// two requests (and Replayed true, "an earlier attempt had taken effect"). Do now counts the
// requests the transport wrote (not the redirects it follows).
func TestAuditAttemptsCountsEveryRequest(t *testing.T) {
	var hits atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		if r.URL.Path == "/warm" {
			w.WriteHeader(204)
			return
		}
		if hits.Add(1) == 1 { // the request is read (it "took effect"), its answer is lost
			conn, _, _ := w.(http.Hijacker).Hijack()
			conn.Close()
			return
		}
		w.Header().Set("Idempotent-Replayed", "true")
		w.WriteHeader(201)
	}))
	defer srv.Close()
	hc := &http.Client{Transport: &http.Transport{}}
	// A keep-alive connection in the pool, as any client that has sent one request before has.
	warm, _ := http.NewRequest("POST", srv.URL+"/warm", strings.NewReader(`{}`))
	if resp, err := hc.Do(warm); err != nil {
		t.Fatal(err)
	} else {
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
	c := &idemclient.Client{HTTP: hc, Backoff: time.Millisecond, MaxAttempts: 1}
	req, _ := http.NewRequest("POST", srv.URL+"/x", strings.NewReader(`{"a":1}`))
	res, err := c.Do(context.Background(), req, "")
	t.Logf("status %d replayed %v attempts %d err %v; the server saw %d requests", res.Status, res.Replayed, res.Attempts, err, hits.Load())
	if int(hits.Load()) != res.Attempts || res.Attempts != 2 || err != nil || res.Status != 201 {
		t.Fatalf("Result.Attempts %d, but the server received %d requests under the key (MaxAttempts 1)", res.Attempts, hits.Load())
	}
}

// TestAuditRefusedRedirectKeepsTheAnswer: "A redirect that the HTTP client's CheckRedirect
// refuses ... ends the operation too: the server answered", and Result's "Status, Header and
// Body are the final answer's (... zero when that attempt got no answer: a network error, a
// timeout)". The server did answer (a 307 with its Location), yet the Result was zero: the
// caller could not tell where it was sent, nor that it was a redirect.
func TestAuditRefusedRedirectKeepsTheAnswer(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Location", "https://elsewhere.example/v1/orders")
		w.WriteHeader(http.StatusTemporaryRedirect)
	}))
	defer srv.Close()
	hc := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return errors.New("no redirects") }}
	c := &idemclient.Client{HTTP: hc, Backoff: time.Millisecond}
	req, _ := http.NewRequest("POST", srv.URL+"/x", strings.NewReader(`{}`))
	res, err := c.Do(context.Background(), req, "")
	t.Logf("%+v %v", res, err)
	if err == nil || res.Status != http.StatusTemporaryRedirect || res.Header.Get("Location") != "https://elsewhere.example/v1/orders" || res.Attempts != 1 {
		t.Fatalf("a refused redirect: Status %d, Location %q, err %v; the server answered 307, want its status and headers in the Result", res.Status, res.Header.Get("Location"), err)
	}
}

// TestAuditControlCharInURLIsRefusedBeforeSending: net/http refuses, at every attempt, a request
// whose request-target has a control character ("net/http: can't write control character in
// Request.URL"; here through URL.Opaque, the documented way to send a path unescaped):
// nothing is ever sent. Do retried it MaxAttempts times and reported ErrGaveUp, that is "the
// outcome is unknown: retry later under res.Key", when the outcome was known (nothing was
// sent). It is now refused before sending, as the other requests net/http refuses are.
func TestAuditControlCharInURLIsRefusedBeforeSending(t *testing.T) {
	srv, hits := counting(t)
	req, _ := http.NewRequest("POST", srv.URL+"/x", strings.NewReader(`{}`))
	req.URL.Opaque = "//" + req.URL.Host + "/x\x7f"
	c := &idemclient.Client{Backoff: time.Millisecond, MaxBackoff: time.Millisecond}
	res, _, err := doWithin(t, 20*time.Second, c, context.Background(), req, "")
	t.Logf("attempts %d err %v hits %d", res.Attempts, err, hits.Load())
	if err == nil || errors.Is(err, idemclient.ErrGaveUp) || res.Attempts != 0 || hits.Load() != 0 {
		t.Fatalf("a URL net/http refuses: Attempts %d, err %v; want an error before any attempt, not ErrGaveUp", res.Attempts, err)
	}
}

// TestAuditInProgressCompressed: a 409 request_in_progress whose problem body comes compressed
// (a gzip proxy in front of the API; the caller asked for gzip itself, so net/http does not
// decompress) was taken for a final answer: Do returned 409 with no error after one attempt,
// though the outcome was unknown. Code reads a gzip or deflate body decompressed now.
func TestAuditInProgressCompressed(t *testing.T) {
	var hits atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		if hits.Add(1) == 1 {
			var b bytes.Buffer
			z := gzip.NewWriter(&b)
			io.WriteString(z, `{"type":"about:blank","title":"Request in progress","status":409,"code":"request_in_progress"}`)
			z.Close()
			w.Header().Set("Content-Type", "application/problem+json")
			w.Header().Set("Content-Encoding", "gzip")
			w.Header().Set("Retry-After", "1")
			w.WriteHeader(409)
			w.Write(b.Bytes())
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
		t.Fatalf("a compressed 409 request_in_progress was final: %d after %d attempt(s), Code %q", res.Status, res.Attempts, res.Code())
	}
}

// TestAuditCancelMidBackoff: a context cancelled while Do waits out a long Retry-After (60s) ends
// Do at once, with the last answer and the key.
func TestAuditCancelMidBackoff(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Retry-After", "3600")
		w.Header().Set("Content-Type", "application/problem+json")
		w.WriteHeader(409)
		io.WriteString(w, `{"code":"request_in_progress"}`)
	}))
	defer srv.Close()
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(300*time.Millisecond, cancel)
	c := &idemclient.Client{}
	req, _ := http.NewRequest("POST", srv.URL+"/x", strings.NewReader(`{}`))
	start := time.Now()
	res, err := c.Do(ctx, req, "k-1")
	if d := time.Since(start); d > 3*time.Second || !errors.Is(err, context.Canceled) || res.Status != 409 || res.Key != "k-1" || res.Attempts != 1 {
		t.Fatalf("%s: %+v %v", d, res, err)
	}
}

// TestAuditDeadlineDuringAttempt: a deadline that ends during an attempt (a server that never
// answers) ends Do at its deadline, with no answer.
func TestAuditDeadlineDuringAttempt(t *testing.T) {
	release := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		<-release
	}))
	defer srv.Close()
	defer close(release)
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	c := &idemclient.Client{}
	req, _ := http.NewRequest("POST", srv.URL+"/x", strings.NewReader(`{}`))
	start := time.Now()
	res, err := c.Do(ctx, req, "")
	if d := time.Since(start); d > 3*time.Second || !errors.Is(err, context.DeadlineExceeded) || res.Status != 0 || res.Attempts != 1 {
		t.Fatalf("%s: %+v %v", d, res, err)
	}
}

// TestAuditWhatIsRetried: the table of the docs, one answer at a time.
func TestAuditWhatIsRetried(t *testing.T) {
	cases := []struct {
		status int
		code   string
		retry  bool
	}{
		{503, "outcome_unknown", true}, {503, "store_unavailable", true}, {503, "shutting_down", true},
		{500, "internal_error", true}, {500, "idempotency_misconfigured", false}, {501, "", false},
		{505, "", false}, {502, "", true}, {504, "", true}, {408, "", true}, {425, "", true}, {429, "", true},
		{409, "request_in_progress", true}, {409, "one_time_secret", false}, {409, "response_not_replayable", false},
		{422, "idempotency_key_reuse", false}, {422, "insufficient_funds", false}, {400, "idempotency_key_invalid", false},
		{401, "", false}, {404, "", false}, {413, "request_too_large", false}, {200, "", false}, {201, "", false},
	}
	for _, cs := range cases {
		var hits atomic.Int32
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			io.Copy(io.Discard, r.Body)
			w.Header().Set("Content-Type", "application/problem+json")
			w.WriteHeader(cs.status)
			if cs.code != "" {
				io.WriteString(w, `{"code":"`+cs.code+`"}`)
			}
			hits.Add(1)
		}))
		c := &idemclient.Client{Backoff: time.Millisecond, MaxBackoff: time.Millisecond, MaxAttempts: 3}
		req, _ := http.NewRequest("POST", srv.URL+"/x", strings.NewReader(`{}`))
		res, err := c.Do(context.Background(), req, "")
		srv.Close()
		want := 1
		if cs.retry {
			want = 3
		}
		if res.Attempts != want || int(hits.Load()) != want || res.Status != cs.status || (cs.retry != errors.Is(err, idemclient.ErrGaveUp)) {
			t.Errorf("%d %s: %d attempts (%d hits), status %d, err %v; want %d attempts", cs.status, cs.code, res.Attempts, hits.Load(), res.Status, err, want)
		}
	}
}

// TestAuditConcurrentNewKeys: NewKey from many goroutines at once: unique, well-formed.
func TestAuditConcurrentNewKeys(t *testing.T) {
	var mu sync.Mutex
	seen := map[string]bool{}
	var wg sync.WaitGroup
	for range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			prev := ""
			local := make([]string, 0, 20000)
			for range 20000 {
				k := idemclient.NewKey()
				if k <= prev {
					t.Errorf("not increasing in one goroutine: %q after %q", k, prev)
					return
				}
				prev = k
				local = append(local, k)
			}
			mu.Lock()
			for _, k := range local {
				if seen[k] {
					t.Errorf("duplicate %q", k)
				}
				seen[k] = true
			}
			mu.Unlock()
		}()
	}
	wg.Wait()
}

// TestAuditCodeRawDeflate: "A body compressed with gzip or deflate ... is read decompressed".
// Go's own compressing middlewares (go-chi/middleware.Compress, gorilla/handlers) write
// Content-Encoding: deflate as raw DEFLATE (compress/flate), not zlib; Code read "" and a
// 409 request_in_progress behind them was final. D169's review; Code falls back to raw DEFLATE.
func TestAuditCodeRawDeflate(t *testing.T) {
	var buf bytes.Buffer
	fw, _ := flate.NewWriter(&buf, flate.DefaultCompression)
	fw.Write([]byte(`{"code":"request_in_progress"}`))
	fw.Close()
	r := idemclient.Result{Status: 409, Header: http.Header{"Content-Encoding": {"deflate"}}, Body: buf.Bytes()}
	if got := r.Code(); got != "request_in_progress" {
		t.Fatalf("Code() of a raw-deflate body = %q, want request_in_progress", got)
	}
}

// TestAuditHostWithSpaceNetHTTPSends: D169's first build refused a host with a space, "which
// net/http refuses to send". It does not: for a request not sent through a proxy, net/http
// sends an invalid req.Host as an empty Host header (go.dev/issue/61431), and the server
// answers. Do sends what net/http sends.
func TestAuditHostWithSpaceNetHTTPSends(t *testing.T) {
	var hits atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { hits.Add(1); w.WriteHeader(201) }))
	defer srv.Close()
	plain, _ := http.NewRequest("POST", srv.URL+"/x", strings.NewReader("a=1"))
	plain.Host = "api example"
	resp, err := http.DefaultClient.Do(plain)
	if err != nil {
		t.Fatalf("net/http refused it: %v", err)
	}
	resp.Body.Close()
	t.Logf("net/http sent it: %d, server hits %d", resp.StatusCode, hits.Load())
	req, _ := http.NewRequest("POST", srv.URL+"/x", strings.NewReader("a=1"))
	req.Host = "api example"
	res, err := (&idemclient.Client{}).Do(context.Background(), req, "")
	if err != nil || res.Status != 201 {
		t.Fatalf("Do: status %d, err %v; net/http sends this request (status %d)", res.Status, err, resp.StatusCode)
	}
}

// failingConn is a conn whose first write after the first response fails with nothing
// written, as a kept-alive connection the server has reset does.
type failingConn struct {
	net.Conn
	fail *atomic.Bool
}

func (c failingConn) Write(b []byte) (int, error) {
	if c.fail.CompareAndSwap(true, false) {
		c.Conn.Close()
		return 0, errors.New("write: connection reset by peer")
	}
	return c.Conn.Write(b)
}

// TestAuditAttemptsNothingWritten: when the write on a reused connection fails with nothing
// written, net/http dials again and writes the request once (nothingWrittenError): the server
// has one request. Do counts the failed write too (httptrace's WroteRequest fires before the
// flush fails): Attempts may be one more than the requests the server saw, never fewer, as
// its doc says.
func TestAuditAttemptsNothingWritten(t *testing.T) {
	var hits atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		if r.URL.Path != "/warm" {
			hits.Add(1)
		}
		w.WriteHeader(201)
	}))
	defer srv.Close()
	var fail atomic.Bool
	var mu sync.Mutex
	dials := 0
	tr := &http.Transport{DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
		mu.Lock()
		dials++
		mu.Unlock()
		c, err := (&net.Dialer{}).DialContext(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		return failingConn{c, &fail}, nil
	}}
	defer tr.CloseIdleConnections()
	hc := &http.Client{Transport: tr}
	warm, _ := http.NewRequest("GET", srv.URL+"/warm", nil)
	resp, err := hc.Do(warm)
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	time.Sleep(50 * time.Millisecond) // the connection back in the idle pool
	fail.Store(true)
	c := &idemclient.Client{HTTP: hc}
	req, _ := http.NewRequest("POST", srv.URL+"/op", strings.NewReader("a=1"))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	res, err := c.Do(ctx, req, "")
	if err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	d := dials
	mu.Unlock()
	if h := int(hits.Load()); h != 1 || res.Attempts < h || res.Attempts > h+1 {
		t.Fatalf("Attempts %d, the server had %d requests (dials %d, status %d); want one request, Attempts 1 or 2", res.Attempts, h, d, res.Status)
	}
}

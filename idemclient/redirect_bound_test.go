package idemclient_test

// Second look at this session's idemclient changes (D216, D217): MaxResponseBytes, Replayed
// through redirects, the key on redirects, Code.

import (
	"bytes"
	"compress/flate"
	"compress/gzip"
	"context"
	"errors"
	"fmt"
	"io"
	"math"
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

func rbCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// TestMaxInt64BoundReadsTheBody: MaxResponseBytes = math.MaxInt64 is a bound no body
// reaches; the body comes back whole. Do read through io.LimitReader(limit+1), and limit+1
// overflowed to a negative N: the reader gave EOF at once, Body was empty, and no error said so.
func TestMaxInt64BoundReadsTheBody(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(201)
		io.WriteString(w, `{"id":"o-1"}`)
	}))
	defer srv.Close()
	for _, limit := range []int64{math.MaxInt64, math.MaxInt64 - 1} {
		c := &idemclient.Client{MaxResponseBytes: limit, Backoff: time.Millisecond}
		req, _ := http.NewRequest("POST", srv.URL, strings.NewReader(`{}`))
		res, err := c.Do(rbCtx(t), req, "")
		if err != nil || res.Status != 201 || string(res.Body) != `{"id":"o-1"}` {
			t.Errorf("MaxResponseBytes %d: status %d body %q err %v; want 201 with the body {\"id\":\"o-1\"}", limit, res.Status, res.Body, err)
		}
	}
}

// TestHeadAnswerHasNoBody: a HEAD answer's Content-Length is the size of the GET's
// body (RFC 9110 9.3.2), its own body is empty; net/http sets resp.ContentLength from the
// header for HEAD. Do compared it with MaxResponseBytes and ended a bodiless answer with
// ErrResponseTooLarge; a HEAD's Content-Length is not looked at now.
func TestHeadAnswerHasNoBody(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", "1000")
		w.Header().Set("X-Head", "yes")
		w.WriteHeader(200)
		if r.Method != "HEAD" {
			w.Write(bytes.Repeat([]byte("h"), 1000))
		}
	}))
	defer srv.Close()
	c := &idemclient.Client{MaxResponseBytes: 100, Backoff: time.Millisecond}
	req, _ := http.NewRequest("HEAD", srv.URL+"/file", nil)
	res, err := c.Do(rbCtx(t), req, "")
	t.Logf("HEAD: status %d header %v body %d err %v", res.Status, res.Header, len(res.Body), err)
	if err != nil || res.Status != 200 || res.Header.Get("X-Head") != "yes" {
		t.Errorf("HEAD answered 200 with no body (Content-Length: 1000 describes the GET's); Do: status %d err %v; "+
			"want 200 and no error: the answer's body (0 bytes) is not longer than MaxResponseBytes (100)", res.Status, err)
	}
	// The same with the default bound and a HEAD of a 100 MiB resource.
	srv2 := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", fmt.Sprint(100<<20))
		w.WriteHeader(200)
	}))
	defer srv2.Close()
	req, _ = http.NewRequest("HEAD", srv2.URL+"/big", nil)
	res, err = (&idemclient.Client{Backoff: time.Millisecond}).Do(rbCtx(t), req, "")
	if err != nil || res.Status != 200 {
		t.Errorf("HEAD of a 100 MiB resource, default bound: status %d err %v; want 200, no error", res.Status, err)
	}
}

// TestNoBodyStatusesWithContentLength: 204 and 304 with a Content-Length above the
// bound have no body: read as such.
func TestNoBodyStatusesWithContentLength(t *testing.T) {
	for _, code := range []int{204, 304} {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			io.Copy(io.Discard, r.Body)
			w.Header().Set("Content-Length", "5000")
			w.WriteHeader(code)
		}))
		c := &idemclient.Client{MaxResponseBytes: 10, Backoff: time.Millisecond}
		req, _ := http.NewRequest("POST", srv.URL, strings.NewReader(`{}`))
		res, err := c.Do(rbCtx(t), req, "")
		srv.Close()
		if err != nil || res.Status != code || len(res.Body) != 0 {
			t.Errorf("%d with Content-Length 5000: status %d body %d err %v", code, res.Status, len(res.Body), err)
		}
	}
}

// TestBoundAtOne: MaxResponseBytes 1 reads a 1-byte body (by Content-Length or
// chunked) and refuses 2 bytes either way.
func TestBoundAtOne(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body := r.URL.Query().Get("b")
		if r.URL.Query().Get("chunked") == "" {
			w.Header().Set("Content-Length", fmt.Sprint(len(body)))
		}
		w.WriteHeader(200)
		for i := range len(body) {
			w.Write([]byte{body[i]})
			w.(http.Flusher).Flush()
		}
	}))
	defer srv.Close()
	c := &idemclient.Client{MaxResponseBytes: 1, Backoff: time.Millisecond}
	for _, q := range []string{"b=a", "b=a&chunked=1", "b=ab", "b=ab&chunked=1", "b=", "b=&chunked=1"} {
		req, _ := http.NewRequest("POST", srv.URL+"/?"+q, strings.NewReader(`{}`))
		res, err := c.Do(rbCtx(t), req, "")
		long := strings.HasPrefix(q, "b=ab")
		if long != errors.Is(err, idemclient.ErrResponseTooLarge) || res.Attempts != 1 {
			t.Errorf("%s: body %q err %v attempts %d", q, res.Body, err, res.Attempts)
		}
		if !long && (err != nil || len(res.Body) != len(q[2:strings.IndexAny(q+"&", "&")])) {
			t.Errorf("%s: body %q err %v", q, res.Body, err)
		}
	}
}

// TestRedirectWithoutHostEndsTheOperation: the doc (package idemclient) says a redirect
// net/http cannot follow ends the operation ("the server answered"), as does a request whose
// URL has no host, which Do refuses up front. A Location of "http:///x" (no host) or a port out
// of range reached the transport, which failed it as a network error; Do took it for a lost
// answer and sent the POST again and again to ErrGaveUp, its Result without the redirect. Such a
// Location is refused as one that is not http or https is: the operation ends with the 3xx.
func TestRedirectWithoutHostEndsTheOperation(t *testing.T) {
	for _, loc := range []string{"http:///x", "http://127.0.0.1:99999/x"} {
		var log reqLog
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			log.add(r)
			w.Header().Set("Location", loc)
			w.WriteHeader(http.StatusSeeOther)
		}))
		c := &idemclient.Client{Backoff: time.Millisecond, MaxAttempts: 4}
		req, _ := http.NewRequest("POST", srv.URL+"/orders", strings.NewReader(`{}`))
		res, err := c.Do(rbCtx(t), req, "k-loc")
		srv.Close()
		t.Logf("%s: status %d attempts %d err %v; server saw %d requests", loc, res.Status, res.Attempts, err, len(log.all()))
		if res.Attempts != 1 || len(log.all()) != 1 || res.Status != http.StatusSeeOther || errors.Is(err, idemclient.ErrGaveUp) {
			t.Errorf("Location %q: the server answered 303 to a place net/http cannot go; Do: %d attempts, server saw %d POSTs, "+
				"status %d, err %v; want one attempt ending with the 303's status and headers, not ErrGaveUp",
				loc, res.Attempts, len(log.all()), res.Status, err)
		}
	}
}

// TestGetWithoutMethodKeepsItsKey: Method "" is GET (net/http). A 302 of a GET
// redirects a GET to a GET: the same request, so the key stays, as it does for Method "GET".
// The wrapper compared req.Method with via[0].Method, "GET" with "", and dropped it.
func TestGetWithoutMethodKeepsItsKey(t *testing.T) {
	for _, method := range []string{"GET", ""} {
		var log reqLog
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			log.add(r)
			if r.URL.Path == "/a" {
				w.Header().Set("Location", "/b")
				w.WriteHeader(302)
				return
			}
			w.WriteHeader(200)
		}))
		req, _ := http.NewRequest("GET", srv.URL+"/a", nil)
		req.Method = method
		res, err := (&idemclient.Client{Backoff: time.Millisecond}).Do(rbCtx(t), req, "k-get")
		srv.Close()
		seen := log.all()
		if err != nil || res.Status != 200 || len(seen) != 2 {
			t.Fatalf("method %q: %d %v %+v", method, res.Status, err, seen)
		}
		if seen[1].Key != "k-get" {
			t.Errorf("method %q: a 302 of a GET is followed by a GET without the key (%+v); with Method \"GET\" it keeps it", method, seen)
		}
	}
}

// TestSeeOtherThen307SendsNoBody: POST, 303, GET, 307, GET. The doc: a 303 turns the
// POST into "a GET without the body", followed without the key; a 307 "sends the request
// again". net/http takes the 307's body from the first request (ireq.GetBody), so the GET after
// the 307 carries the POST's body: the operation's body goes to another URL as a GET, without
// its key. The wrapper drops the key on a method change but leaves the body.
func TestSeeOtherThen307SendsNoBody(t *testing.T) {
	var log reqLog
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		log.add(r)
		switch r.URL.Path {
		case "/a":
			w.Header().Set("Location", "/b")
			w.WriteHeader(303)
		case "/b":
			w.Header().Set("Location", "/c")
			w.WriteHeader(307)
		default:
			w.WriteHeader(200)
		}
	}))
	defer srv.Close()
	req, _ := http.NewRequest("POST", srv.URL+"/a", strings.NewReader(`{"card":"4111"}`))
	res, err := (&idemclient.Client{Backoff: time.Millisecond}).Do(rbCtx(t), req, "k-chain")
	seen := log.all()
	t.Logf("status %d err %v; server saw %+v", res.Status, err, seen)
	if err != nil || res.Status != 200 || len(seen) != 3 {
		t.Fatalf("setup: %d %v %+v", res.Status, err, seen)
	}
	for _, s := range seen[1:] {
		if s.Method != "GET" || s.Key != "" || s.Body != "" {
			t.Errorf("after the 303: %s %s with key %q and body %q; want a GET without key and without the POST's body", s.Method, s.Path, s.Key, s.Body)
		}
	}
}

// Test307Then303: POST, 307 (key and body kept), 303 (GET, neither).
func Test307Then303(t *testing.T) {
	var log reqLog
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		log.add(r)
		switch r.URL.Path {
		case "/a":
			w.Header().Set("Location", "/b")
			w.WriteHeader(307)
		case "/b":
			w.Header().Set("Location", "/c")
			w.Header().Set("Idempotent-Replayed", "true")
			w.WriteHeader(303)
		default:
			w.WriteHeader(200)
		}
	}))
	defer srv.Close()
	req, _ := http.NewRequest("POST", srv.URL+"/a", strings.NewReader(`{"x":1}`))
	res, err := (&idemclient.Client{Backoff: time.Millisecond}).Do(rbCtx(t), req, "k-73")
	seen := log.all()
	if err != nil || res.Status != 200 || len(seen) != 3 || !res.Replayed {
		t.Fatalf("%d %v replayed %v %+v", res.Status, err, res.Replayed, seen)
	}
	if seen[1] != (seenReq{"POST", "/b", "k-73", `{"x":1}`}) || seen[2] != (seenReq{"GET", "/c", "", ""}) {
		t.Errorf("server saw %+v", seen)
	}
}

// TestUserPolicies: the user's CheckRedirect is kept. ErrUseLastResponse gives the
// redirect as the answer (Replayed from it); a custom error ends the operation (one attempt)
// with the redirect's status, Replayed from it; a policy that sees the GET already without the
// key, and via[0] with it; a policy that sets a header sends it.
func TestUserPolicies(t *testing.T) {
	var log reqLog
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		log.add(r)
		if r.URL.Path == "/a" {
			w.Header().Set("Location", "/b")
			w.Header().Set("Idempotent-Replayed", "true")
			w.WriteHeader(303)
			io.WriteString(w, "see other")
			return
		}
		w.Header().Set("X-Seen-Policy", r.Header.Get("X-Policy"))
		w.WriteHeader(200)
	}))
	defer srv.Close()
	send := func(policy func(*http.Request, []*http.Request) error) (idemclient.Result, error) {
		c := &idemclient.Client{Backoff: time.Millisecond, HTTP: &http.Client{CheckRedirect: policy}}
		req, _ := http.NewRequest("POST", srv.URL+"/a", strings.NewReader(`{}`))
		return c.Do(rbCtx(t), req, "k-pol")
	}
	res, err := send(func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse })
	if err != nil || res.Status != 303 || !res.Replayed || string(res.Body) != "see other" || res.Attempts != 1 {
		t.Errorf("ErrUseLastResponse: %d %q replayed %v attempts %d err %v", res.Status, res.Body, res.Replayed, res.Attempts, err)
	}
	mine := errors.New("no redirects here")
	res, err = send(func(*http.Request, []*http.Request) error { return mine })
	if !errors.Is(err, mine) || res.Status != 303 || !res.Replayed || res.Attempts != 1 || res.Header.Get("Location") != "/b" {
		t.Errorf("custom error: %d replayed %v attempts %d err %v", res.Status, res.Replayed, res.Attempts, err)
	}
	var sawKey, sawVia0Key string
	res, err = send(func(req *http.Request, via []*http.Request) error {
		sawKey, sawVia0Key = req.Header.Get("Idempotency-Key"), via[0].Header.Get("Idempotency-Key")
		req.Header.Set("X-Policy", "set")
		return nil
	})
	if err != nil || res.Status != 200 || sawKey != "" || sawVia0Key != "k-pol" || res.Header.Get("X-Seen-Policy") != "set" || !res.Replayed {
		t.Errorf("inspecting policy: %d err %v key %q via0 %q policy header %q replayed %v", res.Status, err, sawKey, sawVia0Key,
			res.Header.Get("X-Seen-Policy"), res.Replayed)
	}
}

// TestDefaultTenRedirects: without a policy, net/http's own: it stops when via holds
// ten requests, so 9 redirects are followed and the 10th is refused (one attempt, the
// redirect's status, not retried), as plain net/http does.
func TestDefaultTenRedirects(t *testing.T) {
	var hits atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		hits.Add(1)
		var n int
		fmt.Sscanf(r.URL.Query().Get("n"), "%d", &n)
		if n > 0 {
			w.Header().Set("Location", fmt.Sprintf("/?n=%d", n-1))
			w.WriteHeader(307)
			return
		}
		w.WriteHeader(200)
	}))
	defer srv.Close()
	c := &idemclient.Client{Backoff: time.Millisecond}
	for _, n := range []int{9, 10} {
		hits.Store(0)
		plain, perr := http.Post(fmt.Sprintf("%s/?n=%d", srv.URL, n), "", strings.NewReader(`{}`))
		plainHits := hits.Load()
		if plain != nil {
			plain.Body.Close()
		}
		hits.Store(0)
		req, _ := http.NewRequest("POST", fmt.Sprintf("%s/?n=%d", srv.URL, n), strings.NewReader(`{}`))
		res, err := c.Do(rbCtx(t), req, "")
		if (perr == nil) != (err == nil) || hits.Load() != plainHits || res.Attempts != 1 {
			t.Errorf("%d redirects: net/http err %v after %d requests; Do: %d %v attempts %d after %d requests", n, perr, plainHits, res.Status, err, res.Attempts, hits.Load())
		}
		if n == 10 && res.Status != 307 {
			t.Errorf("the refused redirect's status: %d", res.Status)
		}
	}
}

// TestCrossHost307KeepsKey: a 307 to another host carries key and body (the same
// operation), a 303 to another host does not carry the key.
func TestCrossHost307KeepsKey(t *testing.T) {
	var log reqLog
	other := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		log.add(r)
		w.WriteHeader(201)
	}))
	defer other.Close()
	for _, code := range []int{307, 303} {
		first := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			io.Copy(io.Discard, r.Body)
			w.Header().Set("Location", strings.Replace(other.URL, "127.0.0.1", "localhost", 1)+"/x")
			w.WriteHeader(code)
		}))
		req, _ := http.NewRequest("POST", first.URL, strings.NewReader(`{"y":2}`))
		res, err := (&idemclient.Client{Backoff: time.Millisecond}).Do(rbCtx(t), req, "k-x")
		first.Close()
		seen := log.all()
		last := seen[len(seen)-1]
		want := seenReq{"POST", "/x", "k-x", `{"y":2}`}
		if code == 303 {
			want = seenReq{"GET", "/x", "", ""}
		}
		if err != nil || res.Status != 201 || last != want {
			t.Errorf("%d across hosts: %d %v, other host saw %+v want %+v", code, res.Status, err, last, want)
		}
	}
}

// TestTooLargeAfterReplayedRedirect: a replayed 307 to an answer that is too large:
// ErrResponseTooLarge, Replayed true, the answer's status.
func TestTooLargeAfterReplayedRedirect(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		if r.URL.Path == "/a" {
			w.Header().Set("Location", "/b")
			w.Header().Set("Idempotent-Replayed", "true")
			w.WriteHeader(307)
			return
		}
		w.WriteHeader(201)
		io.WriteString(w, strings.Repeat("z", 100))
	}))
	defer srv.Close()
	req, _ := http.NewRequest("POST", srv.URL+"/a", strings.NewReader(`{}`))
	res, err := (&idemclient.Client{Backoff: time.Millisecond, MaxResponseBytes: 50}).Do(rbCtx(t), req, "")
	if !errors.Is(err, idemclient.ErrResponseTooLarge) || res.Status != 201 || !res.Replayed || res.Body != nil || res.Attempts != 1 {
		t.Errorf("%d replayed %v body %d attempts %d err %v", res.Status, res.Replayed, len(res.Body), res.Attempts, err)
	}
}

// TestReplayedRedirectToA503IsRetried pins what Do does: a replayed 303 whose GET answers 503
// leaves the outcome open (the GET's answer is not a replay), so Do retries, here until it
// gives up, with Status 503 and Replayed true (D253; it used to end the operation there, with
// no error, as if the 503 were the stored answer).
func TestReplayedRedirectToA503IsRetried(t *testing.T) {
	var posts atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		if r.Method == "POST" {
			posts.Add(1)
			w.Header().Set("Location", "/b")
			w.Header().Set("Idempotent-Replayed", "true")
			w.WriteHeader(303)
			return
		}
		w.WriteHeader(503)
	}))
	defer srv.Close()
	req, _ := http.NewRequest("POST", srv.URL+"/a", strings.NewReader(`{}`))
	res, err := (&idemclient.Client{Backoff: time.Millisecond}).Do(rbCtx(t), req, "")
	t.Logf("%d replayed %v attempts %d err %v", res.Status, res.Replayed, res.Attempts, err)
	if !errors.Is(err, idemclient.ErrGaveUp) || res.Status != 503 || !res.Replayed || res.Attempts != idemclient.DefaultMaxAttempts ||
		posts.Load() != int32(idemclient.DefaultMaxAttempts) {
		t.Errorf("%d replayed %v attempts %d err %v", res.Status, res.Replayed, res.Attempts, err)
	}
}

// TestCallerGzipCountsCompressedBytes: with the caller's own Accept-Encoding net/http
// leaves the body compressed: Body is the compressed bytes, the bound counts them (as the doc
// says: after net/http's own decompression only when it asked), and Code reads a gzip 409.
func TestCallerGzipCountsCompressedBytes(t *testing.T) {
	gz := func(s string) []byte {
		var b bytes.Buffer
		w := gzip.NewWriter(&b)
		io.WriteString(w, s)
		w.Close()
		return b.Bytes()
	}
	big := gz(`{"detail":"` + strings.Repeat("a", 1<<20) + `"}`)
	var posts atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Encoding", "gzip")
		if r.URL.Path == "/big" {
			w.WriteHeader(200)
			w.Write(big)
			return
		}
		if posts.Add(1) < 3 {
			w.WriteHeader(409)
			w.Write(gz(` {"code" : "request_in_progress"} `))
			return
		}
		w.WriteHeader(201)
	}))
	defer srv.Close()
	c := &idemclient.Client{Backoff: time.Millisecond, MaxResponseBytes: 64 << 10}
	req, _ := http.NewRequest("POST", srv.URL+"/big", strings.NewReader(`{}`))
	req.Header.Set("Accept-Encoding", "gzip")
	res, err := c.Do(rbCtx(t), req, "")
	if err != nil || !bytes.Equal(res.Body, big) {
		t.Errorf("compressed %d bytes (1 MiB inflated) under a 64 KiB bound: body %d err %v", len(big), len(res.Body), err)
	}
	req, _ = http.NewRequest("POST", srv.URL+"/p", strings.NewReader(`{}`))
	req.Header.Set("Accept-Encoding", "gzip")
	res, err = c.Do(rbCtx(t), req, "")
	if err != nil || res.Status != 201 || res.Attempts != 3 {
		t.Errorf("gzip 409 request_in_progress twice: %d attempts %d err %v", res.Status, res.Attempts, err)
	}
}

// TestCodeOddJSON: Code on odd bodies.
func TestCodeOddJSON(t *testing.T) {
	for _, tc := range []struct{ body, want string }{
		{`{"\u0063ode":"request_in_progress"}`, "request_in_progress"},
		{`{"c\u006fde":"x","code":"y"}`, "y"},
		{`{"code":"a","code":"b"}`, "b"},
		{`{"code":"a","code":null}`, ""},
		{`{"code":"a","code":1}`, ""},
		{`{"code":"a","code":{"code":"b"}}`, ""},
		{`{"code":"a","code":["b"]}`, ""},
		{`{"code":"a","x":{"code":"b"}}`, "a"},
		{`{"x":{"code":"b"}}`, ""},
		{"\t\r\n {\"code\" :\"a\"} \n\t\r ", "a"},
		{`{"code":"a"}{}`, ""},
		{`{"code":"a"} x`, ""},
		{`{"code":"a",}`, ""},
		{`{"code":"a"`, ""},
		{`["code","a"]`, ""},
		{`"code"`, ""},
		{`{"code":"req\u0075est_in_progress"}`, "request_in_progress"},
		{`{"code":"a","d":1e400}`, "a"},
		{`{"code":"a","d":01}`, ""},
		{`{"code":"a" "x":1}`, ""},
		{`{"code":"a","d":tru}`, ""},
		{"{\"code\":\"a\"}\x00", ""},
		{`{"code":"a"}` + "\n", "a"},
		{`{"code" "a"}`, ""},
		{`{"code":"\ud800"}`, "\ufffd"},
	} {
		r := idemclient.Result{Status: 409, Header: http.Header{}, Body: []byte(tc.body)}
		if got := r.Code(); got != tc.want {
			t.Errorf("Code(%q) = %q, want %q", tc.body, got, tc.want)
		}
	}
}

// TestCodeAfterBOM: a UTF-8 byte order mark before the object. RFC 8259 lets a parser ignore
// it; encoding/json does not, and Code read "" (not a JSON object), so a 409
// request_in_progress with a BOM was final. Code skips the mark now.
func TestCodeAfterBOM(t *testing.T) {
	r := idemclient.Result{Status: 409, Header: http.Header{}, Body: []byte("\ufeff{\"code\":\"request_in_progress\"}")}
	if got := r.Code(); got != "request_in_progress" {
		t.Errorf("Code with a byte order mark = %q, want request_in_progress (RFC 8259 lets a parser ignore it)", got)
	}
}

// TestConcurrentNoLeak: many concurrent operations through redirects, too-large
// answers, refused redirects and retries; goroutines settle afterwards, and there is no race.
func TestConcurrentNoLeak(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		switch r.URL.Path {
		case "/redir":
			w.Header().Set("Location", "/ok")
			w.Header().Set("Idempotent-Replayed", "true")
			w.WriteHeader(303)
		case "/big":
			w.WriteHeader(200)
			w.Write(bytes.Repeat([]byte("b"), 10<<10))
		case "/loop":
			w.Header().Set("Location", "/loop")
			w.WriteHeader(307)
		case "/busy":
			w.WriteHeader(409)
			io.WriteString(w, `{"code":"request_in_progress"}`)
		default:
			w.WriteHeader(200)
		}
	}))
	defer srv.Close()
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	c := &idemclient.Client{Backoff: time.Millisecond, MaxAttempts: 3, MaxResponseBytes: 4 << 10, HTTP: &http.Client{Transport: tr}}
	before := runtime.NumGoroutine()
	var wg sync.WaitGroup
	var bad atomic.Int32
	for i := range 80 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			path := []string{"/redir", "/big", "/loop", "/busy"}[i%4]
			req, _ := http.NewRequest("POST", srv.URL+path, strings.NewReader(`{}`))
			res, err := c.Do(context.Background(), req, "")
			ok := false
			switch path {
			case "/redir":
				ok = err == nil && res.Replayed && res.Status == 200
			case "/big":
				ok = errors.Is(err, idemclient.ErrResponseTooLarge)
			case "/loop":
				ok = err != nil && res.Status == 307 && res.Attempts == 1
			case "/busy":
				ok = errors.Is(err, idemclient.ErrGaveUp) && res.Attempts == 3
			}
			if !ok {
				bad.Add(1)
				t.Logf("%s: %d replayed %v attempts %d err %v", path, res.Status, res.Replayed, res.Attempts, err)
			}
		}()
	}
	wg.Wait()
	if bad.Load() > 0 {
		t.Errorf("%d operations ended otherwise than expected", bad.Load())
	}
	tr.CloseIdleConnections()
	deadline := time.Now().Add(5 * time.Second)
	for runtime.NumGoroutine() > before+2 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
		tr.CloseIdleConnections()
	}
	if n := runtime.NumGoroutine(); n > before+2 {
		buf := make([]byte, 1<<20)
		t.Errorf("goroutines %d before, %d after:\n%s", before, n, buf[:runtime.Stack(buf, true)])
	}
}

// TestRawDeflateThatLooksLikeZlib: the doc promises a "deflate" body is read whether
// it is zlib's format "or raw DEFLATE as some servers send it". Code tries zlib first and falls
// back to raw DEFLATE only when zlib's two-byte header is refused. A raw DEFLATE stream whose
// first stored block has its ignored padding bits set (RFC 1951 3.2.4: "ignored") and a LEN
// whose low byte is 0x9C starts with 78 9C, a valid zlib header: zlib then fails mid-stream,
// and Code read "" (unreadable), though the body is valid raw DEFLATE of a request_in_progress.
// Contrived (no common encoder sets those padding bits), and mended: a zlib stream that fails is
// read again as raw DEFLATE.
func TestRawDeflateThatLooksLikeZlib(t *testing.T) {
	plain := `{"code":"request_in_progress"}`
	plain += strings.Repeat(" ", 156-len(plain))
	var b []byte
	b = append(b, 0x78, 0x9C, 0x00, 0x63, 0xFF) // stored block, padding 01111, LEN 156, NLEN
	b = append(b, plain...)
	b = append(b, 0x01, 0x00, 0x00, 0xFF, 0xFF) // final empty stored block
	// It is valid raw DEFLATE:
	got, err := io.ReadAll(flateReader(b))
	if err != nil || string(got) != plain {
		t.Fatalf("setup: raw DEFLATE reads %q %v", got, err)
	}
	r := idemclient.Result{Status: 409, Header: http.Header{"Content-Encoding": {"deflate"}}, Body: b}
	if c := r.Code(); c != "request_in_progress" {
		t.Errorf("Code() of a valid raw-DEFLATE body that begins like a zlib header = %q, want request_in_progress", c)
	}
}

// TestUnreadableRunIgnoresNoAnswers: "DefaultMaxAttempts of them in a row, not
// counting attempts that got no answer, end the operation with ErrGaveUp, whatever
// MaxAttempts": 5 unreadable 409s, 3 dropped connections, 5 more: ErrGaveUp at the 13th
// attempt. And a 503 in between breaks the row: 9, 503, 9, then 201 succeeds.
func TestUnreadableRunIgnoresNoAnswers(t *testing.T) {
	run := func(script string) (idemclient.Result, int32, error) {
		var n atomic.Int32
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			io.Copy(io.Discard, r.Body)
			i := int(n.Add(1)) - 1
			step := byte('O')
			if i < len(script) {
				step = script[i]
			}
			switch step {
			case 'B':
				w.Header().Set("Content-Encoding", "br")
				w.WriteHeader(409)
				w.Write([]byte{0x8b, 0x01, 0x80})
			case 'X':
				conn, _, _ := w.(http.Hijacker).Hijack()
				conn.Close()
			case '5':
				w.WriteHeader(503)
			default:
				w.WriteHeader(201)
			}
		}))
		defer srv.Close()
		c := &idemclient.Client{Backoff: time.Millisecond, MaxBackoff: 2 * time.Millisecond, MaxAttempts: -1}
		req, _ := http.NewRequest("POST", srv.URL, strings.NewReader(`{}`))
		res, err := c.Do(rbCtx(t), req, "")
		return res, n.Load(), err
	}
	res, hits, err := run("BBBBBXXXBBBBBOOOO")
	if !errors.Is(err, idemclient.ErrGaveUp) || hits != 13 || res.Status != 409 {
		t.Errorf("5 B, 3 X, 5 B: status %d attempts %d hits %d err %v; want ErrGaveUp at the 13th", res.Status, res.Attempts, hits, err)
	}
	res, hits, err = run("BBBBBBBBB5BBBBBBBBBO")
	if err != nil || res.Status != 201 || hits != 20 {
		t.Errorf("9 B, 503, 9 B, 201: status %d attempts %d hits %d err %v", res.Status, res.Attempts, hits, err)
	}
}

// TestContentLengthLies: a Content-Length larger than the body (under the bound) is a
// lost answer (retried, the same key); one smaller than the body gives its first bytes.
func TestContentLengthLies(t *testing.T) {
	var n atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		conn, bw, _ := w.(http.Hijacker).Hijack()
		defer conn.Close()
		if r.URL.Path == "/short" || n.Add(1) > 1 {
			bw.WriteString("HTTP/1.1 201 Created\r\nContent-Length: 3\r\nConnection: close\r\n\r\nabcdef")
		} else {
			bw.WriteString("HTTP/1.1 201 Created\r\nContent-Length: 100\r\nConnection: close\r\n\r\nabc")
		}
		bw.Flush()
	}))
	defer srv.Close()
	c := &idemclient.Client{Backoff: time.Millisecond, MaxResponseBytes: 1000}
	req, _ := http.NewRequest("POST", srv.URL+"/long", strings.NewReader(`{}`))
	res, err := c.Do(rbCtx(t), req, "")
	if err != nil || res.Attempts != 2 || string(res.Body) != "abc" {
		t.Errorf("long Content-Length: %d %q attempts %d err %v", res.Status, res.Body, res.Attempts, err)
	}
	req, _ = http.NewRequest("POST", srv.URL+"/short", strings.NewReader(`{}`))
	res, err = c.Do(rbCtx(t), req, "")
	if err != nil || res.Attempts != 1 || string(res.Body) != "abc" {
		t.Errorf("short Content-Length: %d %q attempts %d err %v", res.Status, res.Body, res.Attempts, err)
	}
}

func flateReader(b []byte) io.Reader { return flate.NewReader(bytes.NewReader(b)) }

// TestCodeOfASuccessIsEmpty: the doc of Result.Code: "" for a success. A 201 whose
// created resource has a "code" member (a coupon, a country) is not a problem; Code did not
// look at the status and returned the member.
func TestCodeOfASuccessIsEmpty(t *testing.T) {
	for _, status := range []int{200, 201} {
		r := idemclient.Result{Status: status, Header: http.Header{}, Body: []byte(`{"id":"c-1","code":"SUMMER10"}`)}
		if c := r.Code(); c != "" {
			t.Errorf("Code() of a %d = %q; the doc says \"\" for a success", status, c)
		}
	}
}

// Test307KeepsTrailers: a request with trailers is sent chunked, its trailers after
// the body (doc of Do); a 307 "sends the same request again, key and body" (D217). net/http
// builds the redirected request anew, without req.Trailer: the POST to the new URL arrived
// without the trailers the first one had. The redirect wrapper gives them back.
func Test307KeepsTrailers(t *testing.T) {
	type got struct{ path, body, trailer string }
	var mu sync.Mutex
	var seen []got
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		mu.Lock()
		seen = append(seen, got{r.URL.Path, string(b), r.Trailer.Get("X-Checksum")})
		mu.Unlock()
		if r.URL.Path == "/a" {
			w.Header().Set("Location", "/b")
			w.WriteHeader(307)
			return
		}
		w.WriteHeader(201)
	}))
	defer srv.Close()
	req, _ := http.NewRequest("POST", srv.URL+"/a", strings.NewReader(`{"x":1}`))
	req.Trailer = http.Header{"X-Checksum": {"abc"}}
	res, err := (&idemclient.Client{Backoff: time.Millisecond}).Do(rbCtx(t), req, "")
	mu.Lock()
	defer mu.Unlock()
	t.Logf("%d %v %+v", res.Status, err, seen)
	if err != nil || res.Status != 201 || len(seen) != 2 {
		t.Fatalf("setup: %d %v %+v", res.Status, err, seen)
	}
	if seen[1] != (got{"/b", `{"x":1}`, "abc"}) {
		t.Errorf("after the 307 the server got %+v; the first request was %+v", seen[1], seen[0])
	}
}

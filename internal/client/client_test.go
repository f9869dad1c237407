package client

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// script is a fake server that answers each attempt from a list, and records the keys.
type script struct {
	mu      sync.Mutex
	answers []func(w http.ResponseWriter)
	keys    []string
	types   []string
}

func (s *script) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	n := len(s.keys)
	s.keys = append(s.keys, r.Header.Get("Idempotency-Key"))
	s.types = append(s.types, r.Header.Get("Content-Type"))
	s.mu.Unlock()
	if n >= len(s.answers) {
		w.WriteHeader(599)
		return
	}
	s.answers[n](w)
}

func status(code int, body string, header ...string) func(w http.ResponseWriter) {
	return func(w http.ResponseWriter) {
		for i := 0; i+1 < len(header); i += 2 {
			w.Header().Set(header[i], header[i+1])
		}
		w.WriteHeader(code)
		fmt.Fprint(w, body)
	}
}

// hang never answers in time: the attempt times out, its outcome unknown.
func hang(w http.ResponseWriter) { time.Sleep(300 * time.Millisecond) }

func newClient(t *testing.T, s *script) *Ledger {
	srv := httptest.NewServer(s)
	t.Cleanup(srv.Close)
	c := NewLedger(srv.URL, "tok")
	c.Backoff, c.MaxBackoff, c.AttemptTimeout = time.Millisecond, 5*time.Millisecond, 100*time.Millisecond
	return c
}

// TestRetriesUntilFinal: a timeout, a 503, a 409 in progress and a 429 are retried under the
// same key; the replayed 201 ends the operation and says it was a replay.
func TestRetriesUntilFinal(t *testing.T) {
	s := &script{answers: []func(http.ResponseWriter){
		hang,
		status(503, `{"code":"outcome_unknown"}`, "Retry-After", "0"),
		status(409, `{"code":"request_in_progress"}`, "Retry-After", "0"),
		status(429, ``),
		status(201, `{"id":7}`, "Idempotent-Replayed", "true"),
	}}
	c := newClient(t, s)
	res, err := c.Post(context.Background(), "/v1/transfers", map[string]int{"amount": 5})
	if err != nil || res.Status != 201 || !res.Replayed || res.Attempts != 5 || string(res.Body) != `{"id":7}` {
		t.Fatalf("%+v %v", res, err)
	}
	for _, k := range s.keys {
		if k != s.keys[0] || k == "" || k != res.Key {
			t.Fatalf("keys %v: one key per operation, kept across retries", s.keys)
		}
	}
	if s.types[0] != "application/json" {
		t.Fatalf("Content-Type %q", s.types[0])
	}
}

// TestFinalAnswersAreNotRetried: a 422, a 400, a 409 other than in-progress and a 500
// idempotency_misconfigured (the server's configuration refuses the request: it used to be
// retried until the context ended) are answers; another 500 is retried.
func TestFinalAnswersAreNotRetried(t *testing.T) {
	for _, a := range []func(http.ResponseWriter){
		status(422, `{"code":"insufficient_funds"}`),
		status(400, `{"code":"malformed_body"}`),
		status(409, `{"code":"one_time_secret"}`),
		status(500, `{"type":"https://github.com/pgidem/pgidem/blob/main/docs/http.md#idempotency_misconfigured","code":"idempotency_misconfigured"}`,
			"Content-Type", "application/problem+json"),
	} {
		s := &script{answers: []func(http.ResponseWriter){a}}
		res, err := newClient(t, s).Post(context.Background(), "/x", nil)
		if err != nil || res.Attempts != 1 || len(s.keys) != 1 {
			t.Fatalf("%+v %v: a final answer was retried", res, err)
		}
	}
	s := &script{answers: []func(http.ResponseWriter){status(500, `{"code":"internal_error"}`), status(201, `{}`)}}
	if res, err := newClient(t, s).Post(context.Background(), "/x", nil); err != nil || res.Status != 201 || res.Attempts != 2 {
		t.Fatalf("%+v %v: another 500 is not final", res, err)
	}
}

// TestAttemptsAreBoundedByDefault: a zero MaxAttempts stops after DefaultMaxAttempts (10)
// attempts with ErrGaveUp, however long the context runs; a negative one retries until the
// context ends.
func TestAttemptsAreBoundedByDefault(t *testing.T) {
	s := &script{}
	for range 1000 {
		s.answers = append(s.answers, status(503, ``))
	}
	c := newClient(t, s)
	res, err := c.Post(context.Background(), "/x", nil)
	if !errors.Is(err, ErrGaveUp) || res.Attempts != DefaultMaxAttempts || len(s.keys) != DefaultMaxAttempts {
		t.Fatalf("%+v %v, want ErrGaveUp after %d attempts", res, err, DefaultMaxAttempts)
	}
	c.MaxAttempts = -1
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	res, err = c.Post(ctx, "/x", nil)
	if !errors.Is(err, context.DeadlineExceeded) || res.Attempts <= DefaultMaxAttempts {
		t.Fatalf("%+v %v, want more than %d attempts, until the context ended", res, err, DefaultMaxAttempts)
	}
}

// TestTheContextBoundsTheOperation: retries stop when the context ends; MaxAttempts bounds
// them too.
func TestTheContextBoundsTheOperation(t *testing.T) {
	s := &script{}
	for range 1000 {
		s.answers = append(s.answers, status(503, ``))
	}
	c := newClient(t, s)
	c.MaxAttempts = -1
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if _, err := c.Post(ctx, "/x", nil); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("%v, want the context's error", err)
	}
	c.MaxAttempts = 3
	res, err := c.Send(context.Background(), "POST", "/x", "k", nil)
	if !errors.Is(err, ErrGaveUp) || res.Attempts != 3 || res.Status != 503 {
		t.Fatalf("%+v %v, want ErrGaveUp after 3 attempts", res, err)
	}
}

// TestRetryAfterIsHonoured: a 409 with Retry-After: 1 waits a second (capped by MaxBackoff).
func TestRetryAfterIsHonoured(t *testing.T) {
	s := &script{answers: []func(http.ResponseWriter){
		status(409, `{"code":"request_in_progress"}`, "Retry-After", "1"),
		status(201, `{}`),
	}}
	c := newClient(t, s)
	c.MaxBackoff = 5 * time.Second
	start := time.Now()
	if res, err := c.Post(context.Background(), "/x", nil); err != nil || res.Status != 201 {
		t.Fatalf("%+v %v", res, err)
	}
	if d := time.Since(start); d < 900*time.Millisecond || d > 3*time.Second {
		t.Fatalf("waited %s, want about the Retry-After of 1s", d)
	}
}

// TestNewKeyIsAUUIDv7: RFC 9562 version 7: the 48-bit Unix millisecond timestamp of when it
// was made (or a few milliseconds on, when more than 2048 keys share one), version 7, the
// variant; the keys of a process strictly increasing, as strings, across threads; the random
// bits differ.
func TestNewKeyIsAUUIDv7(t *testing.T) {
	before := time.Now().UnixMilli()
	const n = 20000
	keys := make([]string, 0, n)
	for range n {
		keys = append(keys, NewKey())
	}
	after := time.Now().UnixMilli()
	shape := regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$`)
	tails := map[string]bool{}
	for i, k := range keys {
		if !shape.MatchString(k) {
			t.Fatalf("key %q is not a UUIDv7", k)
		}
		if i > 0 && k <= keys[i-1] {
			t.Fatalf("key %d %q is not after %q", i, k, keys[i-1])
		}
		ms, _ := strconv.ParseInt(strings.ReplaceAll(k[:13], "-", ""), 16, 64)
		if ms < before || ms > after+n/2048+1 {
			t.Fatalf("key %q has the timestamp %d, made between %d and %d", k, ms, before, after)
		}
		tails[k[24:]] = true
	}
	if len(tails) < n-1 {
		t.Fatalf("%d distinct random tails in %d keys", len(tails), n)
	}
	// From several goroutines at once: every key distinct.
	var mu sync.Mutex
	seen := map[string]bool{}
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 1000 {
				k := NewKey()
				mu.Lock()
				if seen[k] {
					t.Errorf("key %q made twice", k)
				}
				seen[k] = true
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
}

// TestAnyRequest: the general client sends any request with a body as one operation: the
// same key (one it made, or the caller's) and the same body bytes on every attempt, other
// headers kept, and it never changes the body between tries.
func TestAnyRequest(t *testing.T) {
	var mu sync.Mutex
	var bodies, keys []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		mu.Lock()
		bodies, keys = append(bodies, string(b)), append(keys, r.Header.Get("X-Key")+"|"+r.Header.Get("X-Custom"))
		n := len(bodies)
		mu.Unlock()
		if n < 3 {
			w.WriteHeader(http.StatusBadGateway)
			return
		}
		w.WriteHeader(http.StatusAccepted)
	}))
	defer srv.Close()
	c := &Client{KeyHeader: "X-Key", Backoff: time.Millisecond}
	req, _ := http.NewRequest("PUT", srv.URL+"/things/1", strings.NewReader("raw \x00 body"))
	req.Header.Set("X-Custom", "kept")
	res, err := c.Do(context.Background(), req, "")
	if err != nil || res.Status != 202 || res.Attempts != 3 || len(res.Key) != 36 {
		t.Fatalf("%+v %v", res, err)
	}
	for i := range bodies {
		if bodies[i] != "raw \x00 body" || keys[i] != res.Key+"|kept" {
			t.Fatalf("attempt %d sent %q with %q, want the same body and key every time", i, bodies[i], keys[i])
		}
	}
	req2, _ := http.NewRequest("POST", srv.URL+"/x", strings.NewReader("b"))
	if res, err := c.Do(context.Background(), req2, "mine"); err != nil || res.Key != "mine" {
		t.Fatalf("the caller's key: %+v %v", res, err)
	}
}

// TestErrorsNoRetryMends: a URL that is not http or https fails before any attempt, a server
// whose certificate the client does not trust is tried once, and 501 and 505 are final:
// none of them loops until the context ends.
func TestErrorsNoRetryMends(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c := &Client{Backoff: time.Millisecond, MaxBackoff: time.Millisecond}
	req, _ := http.NewRequest("POST", "htp://127.0.0.1:1/x", strings.NewReader(`{}`))
	if res, err := c.Do(ctx, req, ""); err == nil || res.Attempts != 0 || ctx.Err() != nil {
		t.Fatalf("a URL that is not http: %+v %v, want an error before any attempt", res, err)
	}

	tlsSrv := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {}))
	defer tlsSrv.Close()
	tlsSrv.Config.ErrorLog = log.New(io.Discard, "", 0) // the refused handshakes
	req, _ = http.NewRequest("POST", tlsSrv.URL+"/x", strings.NewReader(`{}`))
	res, err := c.Do(ctx, req, "")
	if err == nil || res.Attempts != 1 || ctx.Err() != nil {
		t.Fatalf("an untrusted certificate: %+v %v, want an error after one attempt", res, err)
	}

	plain := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {}))
	defer plain.Close()
	req, _ = http.NewRequest("POST", strings.Replace(plain.URL, "http://", "https://", 1)+"/x", strings.NewReader(`{}`))
	if res, err := c.Do(ctx, req, ""); err == nil || res.Attempts != 1 || ctx.Err() != nil {
		t.Fatalf("TLS to a plain server: %+v %v, want an error after one attempt", res, err)
	}
	req, _ = http.NewRequest("POST", plain.URL+"/x", strings.NewReader(`{}`))
	if res, err := c.Do(ctx, req, "bad\nkey"); err == nil || res.Attempts != 0 || ctx.Err() != nil {
		t.Fatalf("a key with a control character: %+v %v, want an error before any attempt", res, err)
	}

	for _, code := range []int{501, 505} {
		s := &script{answers: []func(http.ResponseWriter){status(code, `{}`)}}
		if res, err := newClient(t, s).Post(ctx, "/x", nil); err != nil || res.Status != code || res.Attempts != 1 {
			t.Fatalf("%d: %+v %v, want it final after one attempt", code, res, err)
		}
	}
}

// TestRetryAfterAsADateAndBeyondMaxBackoff: a Retry-After given as an HTTP date is honoured,
// and so is one longer than MaxBackoff (it caps the client's own backoff, not the server's
// request); a huge one waits at most a minute (here: until the context ends).
func TestRetryAfterAsADateAndBeyondMaxBackoff(t *testing.T) {
	for _, c := range []struct {
		name, value string
		least       time.Duration
	}{
		{"a date", time.Now().Add(2 * time.Second).UTC().Format(http.TimeFormat), 900 * time.Millisecond},
		{"seconds beyond MaxBackoff", "1", 900 * time.Millisecond},
	} {
		s := &script{answers: []func(http.ResponseWriter){
			status(503, `{}`, "Retry-After", c.value),
			status(201, `{}`),
		}}
		cl := newClient(t, s) // MaxBackoff 5ms
		start := time.Now()
		if res, err := cl.Post(context.Background(), "/x", nil); err != nil || res.Status != 201 {
			t.Fatalf("%s: %+v %v", c.name, res, err)
		}
		if d := time.Since(start); d < c.least || d > 5*time.Second {
			t.Fatalf("%s: waited %s, want the server's Retry-After", c.name, d)
		}
	}
	if d := retryAfter(http.Header{"Retry-After": {"99999999999999999"}}, time.Now()); d != time.Minute {
		t.Fatalf("a huge Retry-After: %v, want a minute", d)
	}
	if d := retryAfter(http.Header{"Retry-After": {time.Now().Add(-time.Hour).UTC().Format(http.TimeFormat)}}, time.Now()); d != 0 {
		t.Fatalf("a Retry-After date in the past: %v, want none", d)
	}
}

// TestJitterStaysAtTheCap: once the backoff reaches MaxBackoff, the waits still spread
// between half of it and all of it, so that clients that failed together do not retry in step.
func TestJitterStaysAtTheCap(t *testing.T) {
	var below int
	for range 200 {
		if w := jitter(min(time.Second<<10, 100*time.Millisecond)); w < 50*time.Millisecond || w > 100*time.Millisecond {
			t.Fatalf("a wait of %v at a cap of 100ms", w)
		} else if w < 90*time.Millisecond {
			below++
		}
	}
	if below == 0 {
		t.Fatal("every wait at the cap was within 10% of it: no jitter")
	}
}

// TestTheCallersKeyIsKept: Do with an empty key sends the key the request already carries.
func TestTheCallersKeyIsKept(t *testing.T) {
	s := &script{answers: []func(http.ResponseWriter){status(503, `{}`), status(201, `{}`)}}
	srv := httptest.NewServer(s)
	defer srv.Close()
	req, _ := http.NewRequest("POST", srv.URL+"/x", strings.NewReader(`{}`))
	req.Header.Set("Idempotency-Key", "caller-set")
	res, err := (&Client{Backoff: time.Millisecond}).Do(context.Background(), req, "")
	if err != nil || res.Key != "caller-set" || len(s.keys) != 2 || s.keys[0] != "caller-set" || s.keys[1] != "caller-set" {
		t.Fatalf("%+v %v, keys sent %v: want the caller's key on every attempt", res, err, s.keys)
	}
}

// TestRequestsNetHTTPRefusesAreNotSent (review finding): a request that net/http refuses to
// send at every attempt (no host, a port out of range, a method or header that is not valid)
// was retried MaxAttempts times and reported as ErrGaveUp, "outcome unknown", though nothing
// was sent. Do refuses it before the first attempt; so with a context that has ended, and with
// two key headers (which key would the operation have?).
func TestRequestsNetHTTPRefusesAreNotSent(t *testing.T) {
	var hits sync.WaitGroup
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		defer hits.Done()
		t.Errorf("a request reached the server: %s %s", r.Method, r.URL)
	}))
	defer srv.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c := &Client{Backoff: 100 * time.Millisecond, MaxBackoff: 100 * time.Millisecond}
	newReq := func(method, url string, h map[string][]string) *http.Request {
		req, err := http.NewRequest("POST", url, strings.NewReader(`{}`))
		if err != nil {
			t.Fatal(err)
		}
		req.Method = method
		for k, v := range h {
			req.Header[k] = v
		}
		return req
	}
	ended, stop := context.WithCancel(ctx)
	stop()
	for name, c2 := range map[string]struct {
		req *http.Request
		ctx context.Context
	}{
		"no host":                {newReq("POST", "http:///x", nil), ctx},
		"a port out of range":    {newReq("POST", "http://127.0.0.1:99999/x", nil), ctx},
		"a method not a token":   {newReq("BAD METHOD", srv.URL+"/x", nil), ctx},
		"a header name":          {newReq("POST", srv.URL+"/x", map[string][]string{"Bad Name": {"v"}}), ctx},
		"a header value":         {newReq("POST", srv.URL+"/x", map[string][]string{"X-A": {"a\nb"}}), ctx},
		"two key headers":        {newReq("POST", srv.URL+"/x", map[string][]string{"Idempotency-Key": {"a", "b"}}), ctx},
		"a context already done": {newReq("POST", srv.URL+"/x", nil), ended},
	} {
		start := time.Now()
		res, err := c.Do(c2.ctx, c2.req, "")
		if err == nil || errors.Is(err, ErrGaveUp) || res.Attempts != 0 || time.Since(start) > time.Second {
			t.Errorf("%s: %+v %v after %s, want an error before any attempt", name, res, err, time.Since(start))
		}
	}
	// A tab may be in a header value, the key's too: sent.
	s := &script{answers: []func(http.ResponseWriter){status(201, `{}`)}}
	tab := httptest.NewServer(s)
	defer tab.Close()
	if res, err := c.Do(ctx, newReq("POST", tab.URL+"/x", nil), "a\tb"); err != nil || res.Status != 201 || s.keys[0] != "a\tb" {
		t.Fatalf("a key with a tab: %+v %v %q", res, err, s.keys)
	}
	hits.Wait()
}

// TestRetryLaterWithTheSameRequest (review finding): Do read a body without GetBody and left it
// consumed, so the documented "retry later under res.Key" with the same request sent an empty
// body under the key, and the server answered 422 (another request under the key) for an
// operation that had taken effect. Do now leaves the body readable again.
func TestRetryLaterWithTheSameRequest(t *testing.T) {
	var mu sync.Mutex
	var bodies []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		mu.Lock()
		bodies = append(bodies, string(b))
		n := len(bodies)
		mu.Unlock()
		if n <= 2 {
			w.WriteHeader(503)
			return
		}
		w.WriteHeader(201)
	}))
	defer srv.Close()
	ctx := context.Background()
	c := &Client{Backoff: time.Millisecond, MaxBackoff: time.Millisecond, MaxAttempts: 2}
	req, _ := http.NewRequest("POST", srv.URL+"/x", io.NopCloser(strings.NewReader(`{"amount":5}`))) // no GetBody
	res, err := c.Do(ctx, req, "")
	if !errors.Is(err, ErrGaveUp) || !strings.Contains(err.Error(), "after 2 attempts") {
		t.Fatalf("first operation: %+v %v, want ErrGaveUp after 2 attempts", res, err)
	}
	if res2, err := c.Do(ctx, req, res.Key); err != nil || res2.Status != 201 {
		t.Fatalf("retry later: %+v %v", res2, err)
	}
	for i, b := range bodies {
		if b != `{"amount":5}` {
			t.Fatalf("attempt %d sent body %q (all: %q)", i+1, b, bodies)
		}
	}
}

// TestNoStaleAnswerAfterALostOne (review finding): when the last attempt got no answer, the
// Result held an earlier attempt's 503 beside the network error.
func TestNoStaleAnswerAfterALostOne(t *testing.T) {
	s := &script{answers: []func(http.ResponseWriter){status(503, `{}`), hang, hang}}
	c := newClient(t, s)
	c.MaxAttempts = 3
	res, err := c.Post(context.Background(), "/x", nil)
	if !errors.Is(err, ErrGaveUp) || res.Status != 0 || res.Body != nil || res.Attempts != 3 {
		t.Fatalf("%+v %v, want ErrGaveUp with no answer after 3 attempts", res, err)
	}
}

// TestTooEarlyAndTheReplayHeader: 425 Too Early is retried (RFC 8470); Replayed reads the
// header's value in any case, and a header of another name when told so.
func TestTooEarlyAndTheReplayHeader(t *testing.T) {
	ctx := context.Background()
	s := &script{answers: []func(http.ResponseWriter){status(425, `{}`), status(201, `{}`, "Idempotent-Replayed", "TRUE")}}
	if res, err := newClient(t, s).Post(ctx, "/x", nil); err != nil || res.Status != 201 || res.Attempts != 2 || !res.Replayed {
		t.Fatalf("425 then a replay: %+v %v", res, err)
	}
	s = &script{answers: []func(http.ResponseWriter){status(201, `{}`, "X-Replayed", "true")}}
	c := newClient(t, s)
	c.ReplayedHeader = "X-Replayed"
	if res, err := c.Post(ctx, "/x", nil); err != nil || !res.Replayed {
		t.Fatalf("another replay header: %+v %v", res, err)
	}
	if d := retryAfter(http.Header{"Retry-After": {"99999999999999999999"}}, time.Now()); d != maxRetryAfter {
		t.Fatalf("a Retry-After beyond an int64: %s, want %s", d, maxRetryAfter)
	}
}

// TestKeyHeaderSpellingsAndName (review findings): a key header set in the map under another
// spelling is the caller's key (sent once, not beside a new one); a KeyHeader or a trailer that
// is not a header name is refused before sending.
func TestKeyHeaderSpellingsAndName(t *testing.T) {
	var mu sync.Mutex
	var got [][]string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		got = append(got, r.Header.Values("Idempotency-Key"))
		mu.Unlock()
		w.WriteHeader(201)
	}))
	defer srv.Close()
	ctx := context.Background()
	c := &Client{Backoff: time.Millisecond, MaxBackoff: time.Millisecond}
	req, _ := http.NewRequest("POST", srv.URL+"/x", strings.NewReader(`{}`))
	req.Header["idempotency-key"] = []string{"mine"}
	if res, err := c.Do(ctx, req, ""); err != nil || res.Key != "mine" || len(got) != 1 || len(got[0]) != 1 || got[0][0] != "mine" {
		t.Fatalf("a key set under another spelling: %+v %v, the server got %q", res, err, got)
	}
	req, _ = http.NewRequest("POST", srv.URL+"/x", strings.NewReader(`{}`))
	req.Header["idempotency-key"] = []string{"a"}
	req.Header["Idempotency-Key"] = []string{"b"}
	if res, err := c.Do(ctx, req, ""); err == nil || res.Attempts != 0 {
		t.Fatalf("two spellings, two keys: %+v %v, want an error before any attempt", res, err)
	}
	bad := &Client{KeyHeader: "Idem Key"}
	req, _ = http.NewRequest("POST", srv.URL+"/x", strings.NewReader(`{}`))
	if res, err := bad.Do(ctx, req, ""); err == nil || res.Attempts != 0 {
		t.Fatalf("a KeyHeader that is no header name: %+v %v, want an error before any attempt", res, err)
	}
	req, _ = http.NewRequest("POST", srv.URL+"/x", strings.NewReader(`{}`))
	req.Trailer = http.Header{"Bad Name": {"v"}}
	if res, err := c.Do(ctx, req, ""); err == nil || res.Attempts != 0 {
		t.Fatalf("a trailer that is no header name: %+v %v, want an error before any attempt", res, err)
	}
	if len(got) != 1 {
		t.Fatalf("%d requests reached the server, want 1", len(got))
	}
}

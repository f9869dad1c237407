package idem_test

// Hostile input, round two, through the middleware with a tiny handler: spellings that name
// the same key or the same request (docs/http.md, "The key" and "The fingerprint"), and
// refusals that must leave nothing behind.

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgidem/pgidem/idem"
)

// TestSameKeySpellings: "The header value is accepted as an RFC 8941 sf-string
// ("k1") and as a bare value (k1); both name the same key." An sf-string's escapes (\" and
// \\) unquote to one character; the bare value of that character is the same key.
func TestSameKeySpellings(t *testing.T) {
	t.Parallel()
	var runs atomic.Int32
	srv, _ := auditServer(t, idem.Options{}, idem.Route{}, func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		w.WriteHeader(http.StatusCreated)
	})
	for i, c := range []struct{ first, second string }{
		{`"sp-a\"b"`, `sp-a"b`},
		{`"sp-a\\b"`, `sp-a\b`},
		{`sp-plain`, `"sp-plain"`},
		{"\tsp-tab ", `"sp-tab"`},
	} {
		before := runs.Load()
		s1, _, b1 := auditPost(t, srv.URL, c.first, `{"n":1}`)
		s2, h2, b2 := auditPost(t, srv.URL, c.second, `{"n":1}`)
		if s1 != 201 || s2 != 201 || h2.Get("Idempotent-Replayed") != "true" || runs.Load()-before != 1 {
			t.Errorf("%d: key %s then %s: %d %s, %d %s (replayed %q), handler ran %d times; want one run and a replay",
				i, c.first, c.second, s1, b1, s2, b2, h2.Get("Idempotent-Replayed"), runs.Load()-before)
		}
	}
}

// TestSameRequestSpellings: "the canonical body: RFC 8785 when the body is strictly
// valid JSON" and "numbers compared by exact decimal value": two spellings of one JSON value
// are one request: the second is a replay, and the handler runs once.
func TestSameRequestSpellings(t *testing.T) {
	t.Parallel()
	var runs atomic.Int32
	srv, _ := auditServer(t, idem.Options{}, idem.Route{}, func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		w.WriteHeader(http.StatusCreated)
	})
	for i, c := range [][2]string{
		{`{"a":"\u00e9"}`, `{"a":"é"}`},
		{`{"a":"\ud83d\ude00"}`, `{"a":"😀"}`},
		{`{"a":"\/"}`, `{"a":"/"}`},
		{`{"\u0061":1}`, `{"a":1}`},
		{`{"b":1,"a":2}`, ` { "a" : 2 , "b" : 1 } `},
		{`{"a":-0}`, `{"a":0}`},
		{`{"a":-0.0e5}`, `{"a":0}`},
		{`{"a":1e2}`, `{"a":100}`},
		{`{"a":0.1e1}`, `{"a":1}`},
		{`{"a":1E+2}`, `{"a":100.000}`},
		{`{"a":1e400}`, `{"a":10e399}`},
		{`{"a":1e-400}`, `{"a":0.1e-399}`},
		{`{"a":123456789012345678901234567890}`, `{"a":1.23456789012345678901234567890e29}`},
		{`{"a":1e0000000000000000000001}`, `{"a":10}`},
		{`{"a":"\u2028\u2029"}`, "{\"a\":\"\u2028\u2029\"}"},
		{`{"a":"\u007f"}`, "{\"a\":\"\x7f\"}"},
		{`{"a":"\u001f"}`, `{"a":"\u001F"}`},
		{`{"€":1,"a":1,"\ud83d\ude00":1,"ﬀ":1}`, `{"ﬀ":1,"😀":1,"a":1,"€":1}`},
	} {
		key := fmt.Sprintf("sp-same-%d", i)
		before := runs.Load()
		s1, _, b1 := auditPost(t, srv.URL, key, c[0])
		s2, h2, b2 := auditPost(t, srv.URL, key, c[1])
		if s1 != 201 || s2 != 201 || h2.Get("Idempotent-Replayed") != "true" || runs.Load()-before != 1 {
			t.Errorf("%s then %s: %d %s, %d %s (replayed %q), handler ran %d times; want one run and a replay",
				c[0], c[1], s1, b1, s2, b2, h2.Get("Idempotent-Replayed"), runs.Load()-before)
		}
	}
}

// TestRefusedLeavesTheKeyFree: bad bodies are refused before the claim (400
// malformed_body, 413 request_too_large), and the same key then serves a good body as a
// first request ("the client may fix the body and send it under the same key").
func TestRefusedLeavesTheKeyFree(t *testing.T) {
	t.Parallel()
	var runs atomic.Int32
	srv, _ := auditServer(t, idem.Options{MaxBodyBytes: 64}, idem.Route{}, func(w http.ResponseWriter, r *http.Request) {
		var v any
		if !idem.DecodeJSON(w, r, &v) {
			return
		}
		runs.Add(1)
		w.WriteHeader(http.StatusCreated)
	})
	exactly := `{"a":"` + strings.Repeat("x", 64-8) + `"}`
	if len(exactly) != 64 {
		t.Fatalf("%d", len(exactly))
	}
	for i, c := range []struct {
		body    string
		chunked bool
		status  int
		code    string
	}{
		{body: `{"a":"\ud800"}`, status: 400, code: "malformed_body"},
		{body: `{"a":"\udc00\ud800"}`, status: 400, code: "malformed_body"},
		{body: `{"a":"\ud800\u0041"}`, status: 400, code: "malformed_body"},
		{body: `{"a":1,"\u0061":2}`, status: 400, code: "malformed_body"},
		{body: `{"a":01}`, status: 400, code: "malformed_body"},
		{body: `{"a":.5}`, status: 400, code: "malformed_body"},
		{body: `{"a":1.}`, status: 400, code: "malformed_body"},
		{body: `{"a":+1}`, status: 400, code: "malformed_body"},
		{body: `{"a":NaN}`, status: 400, code: "malformed_body"},
		{body: `{"a":Infinity}`, status: 400, code: "malformed_body"},
		{body: `{"a":1e}`, status: 400, code: "malformed_body"},
		{body: `{"a":"x` + "\t" + `"}`, status: 400, code: "malformed_body"},
		{body: `{'a':1}`, status: 400, code: "malformed_body"},
		{body: `{"a":1}` + "\x00", status: 400, code: "malformed_body"},
		{body: "\xef\xbb\xbf" + `{"a":1}`, status: 400, code: "malformed_body"},
		{body: `{"a":"\xc0\xaf"}`, status: 400, code: "malformed_body"},
		{body: `{"a":"\xed\xa0\x80"}`, status: 400, code: "malformed_body"},
		{body: `{"a":"\xf4\x90\x80\x80"}`, status: 400, code: "malformed_body"},
		{body: exactly + " ", status: 413, code: "request_too_large"},
		{body: exactly + " ", chunked: true, status: 413, code: "request_too_large"},
	} {
		key := fmt.Sprintf("sp-free-%d", i)
		s, _, b := sendBody(t, srv.URL, key, c.body, c.chunked)
		if s != c.status || auditCode(b) != c.code {
			t.Errorf("%d %q: %d %s, want %d %s", i, c.body, s, b, c.status, c.code)
			continue
		}
		before := runs.Load()
		s, h, b := sendBody(t, srv.URL, key, exactly, c.chunked)
		if s != 201 || h.Get("Idempotent-Replayed") != "" || runs.Load()-before != 1 {
			t.Errorf("%d %q refused, then a good body of exactly MaxBodyBytes under the same key: %d %s (replayed %q); want it run as a first request",
				i, c.body, s, b, h.Get("Idempotent-Replayed"))
		}
	}
}

// sendBody posts body under key, with a Content-Length or chunked.
func sendBody(t *testing.T, url, key, body string, chunked bool) (int, http.Header, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var rd io.Reader = strings.NewReader(body)
	if chunked {
		rd = io.MultiReader(bytes.NewReader([]byte(body))) // unknown length: sent chunked
	}
	req, err := http.NewRequestWithContext(ctx, "POST", url+"/things", rd)
	if err != nil {
		t.Fatal(err)
	}
	if chunked {
		req.ContentLength = -1
	}
	req.Header.Set("Idempotency-Key", key)
	req.Header.Set("Content-Type", "application/json")
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	b, _ := io.ReadAll(res.Body)
	return res.StatusCode, res.Header, string(b)
}

// TestRawHeaders: a header shape only a raw connection sends: two key lines
// are 400 idempotency_key_invalid, even with one value.
func TestRawHeaders(t *testing.T) {
	t.Parallel()
	var runs atomic.Int32
	srv, _ := auditServer(t, idem.Options{}, idem.Route{}, func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		w.WriteHeader(http.StatusCreated)
	})
	addr := strings.TrimPrefix(srv.URL, "http://")
	raw := func(head string, body string) (int, string) {
		c, err := net.DialTimeout("tcp", addr, 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(10 * time.Second))
		fmt.Fprintf(c, "POST /things HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: %d\r\n%s\r\n%s", len(body), head, body)
		b, _ := io.ReadAll(c)
		s := string(b)
		var status int
		fmt.Sscanf(s, "HTTP/1.1 %d", &status)
		return status, s
	}
	// Two lines, the same value: ambiguous by the docs.
	if s, b := raw("Idempotency-Key: sp-two\r\nIdempotency-Key: sp-two\r\n", `{}`); s != 400 || !strings.Contains(b, "idempotency_key_invalid") {
		t.Errorf("two key lines: %d %s", s, b)
	}
}

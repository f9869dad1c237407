package idem_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// d265Send sends one keyed request and reads its whole answer.
func d265Send(t *testing.T, method, url, key string) (*http.Response, string) {
	t.Helper()
	res, body, err := d265Do(method, url, key)
	if err != nil {
		t.Fatal(err)
	}
	return res, body
}

// d265Do is d265Send for a goroutine of a test: it returns what failed.
func d265Do(method, url, key string) (*http.Response, string, error) {
	req, _ := http.NewRequest(method, url, nil)
	req.Header.Set("Idempotency-Key", key)
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, "", err
	}
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	if err != nil {
		return nil, "", fmt.Errorf("%s %s: reading the body: %w", method, url, err)
	}
	return res, string(b), nil
}

// TestKeyedHeadReplaysItsHeaders (D265): a GET's handler serving a HEAD writes its GET's body,
// which net/http discards but reads to decide the answer's headers (a Content-Length for a
// body of at most 2048 bytes, a sniffed Content-Type). The recorder stored that body whole: one
// over MaxStoredBodyBytes made every repeat 409 response_not_replayable where the first answer
// was 200. Now at most its first 2049 bytes are stored, never withheld, and every repeat gets
// the first answer's headers; a handler's Content-Length that is no length is not sent.
func TestKeyedHeadReplaysItsHeaders(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 8)
	m, err := idem.New(context.Background(), idem.Options{DB: pool, Principal: alice, Logger: auditQuiet, MaxStoredBodyBytes: 1000})
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("/doc/{n}", m.Route(idem.Route{})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.PathValue("n") {
		case "small":
			w.Header().Set("Content-Type", "text/plain")
			_, _ = io.WriteString(w, strings.Repeat("x", 100))
		case "large":
			w.Header().Set("Content-Type", "text/plain")
			_, _ = io.WriteString(w, strings.Repeat("x", 5000))
		case "sniffed":
			_, _ = io.WriteString(w, "<html><body>"+strings.Repeat("x", 3000)+"</body></html>")
		case "notalength":
			w.Header().Set("Content-Length", "abc")
			_, _ = io.WriteString(w, "abc")
		case "notalength-nobody":
			w.Header().Set("Content-Length", "abc")
		}
	})))
	srv := httptest.NewServer(mux)
	defer srv.Close()
	for _, c := range []struct {
		name, length, ctype string
		stored              int
	}{
		{"small", "100", "text/plain", 100},
		{"large", "", "text/plain", 2049},
		{"sniffed", "", "text/html; charset=utf-8", 2049},
		{"notalength", "3", "text/plain; charset=utf-8", 3},
		{"notalength-nobody", "", "", 0},
	} {
		for i := range 3 {
			res, body := d265Send(t, http.MethodHead, srv.URL+"/doc/"+c.name, "head-"+c.name)
			if res.StatusCode != http.StatusOK || body != "" {
				t.Fatalf("HEAD %s, answer %d: %d %q, want 200 and no body", c.name, i+1, res.StatusCode, body)
			}
			if i > 0 && res.Header.Get("Idempotent-Replayed") != "true" {
				t.Errorf("HEAD %s, answer %d: not a replay: %v", c.name, i+1, res.Header)
			}
			if cl, ct := res.Header.Get("Content-Length"), res.Header.Get("Content-Type"); cl != c.length || ct != c.ctype {
				t.Errorf("HEAD %s, answer %d: Content-Length %q, Content-Type %q; want %q and %q", c.name, i+1, cl, ct, c.length, c.ctype)
			}
		}
		var stored *int
		if err := pool.QueryRow(context.Background(),
			`SELECT octet_length(response_body) FROM idem.idempotency_keys WHERE key = $1`, "head-"+c.name).Scan(&stored); err != nil {
			t.Fatal(err)
		}
		n := 0
		if stored != nil {
			n = *stored
		}
		if n != c.stored {
			t.Errorf("HEAD %s: %d bytes of body stored, want %d", c.name, n, c.stored)
		}
	}
	// A HEAD row stored before, its GET's body withheld as too large: a repeat gets its
	// status and headers, not 409.
	if _, err := pool.Exec(context.Background(), `UPDATE idem.idempotency_keys SET response_body = NULL, withheld = 'too_large'
		WHERE key = 'head-large'`); err != nil {
		t.Fatal(err)
	}
	if res, _ := d265Send(t, http.MethodHead, srv.URL+"/doc/large", "head-large"); res.StatusCode != http.StatusOK ||
		res.Header.Get("Content-Type") != "text/plain" {
		t.Errorf("HEAD of a row withheld as too large: %d %v, want 200 text/plain", res.StatusCode, res.Header)
	}
}

// TestSuppressedContentTypeStaysSuppressed (D265): a handler that sets
// w.Header()["Content-Type"] = nil keeps net/http from sniffing a Content-Type; the first answer
// went out without one, but nothing was stored for it, and a repeat came back with the type
// net/http sniffed from the body.
func TestSuppressedContentTypeStaysSuppressed(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 8)
	handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header()["Content-Type"] = nil
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, "<html><body>made</body></html>")
	})
	// Two middlewares on one database: a repeat in this process and one in another, which
	// reads the answer from the database alone.
	var urls []string
	for range 2 {
		m, err := idem.New(context.Background(), idem.Options{DB: pool, Principal: alice, Logger: auditQuiet})
		if err != nil {
			t.Fatal(err)
		}
		srv := httptest.NewServer(m.Route(idem.Route{})(handler))
		defer srv.Close()
		urls = append(urls, srv.URL)
	}
	for i, url := range []string{urls[0], urls[0], urls[1]} {
		res, body := d265Send(t, http.MethodPost, url+"/things", "no-type")
		if res.StatusCode != http.StatusCreated || body != "<html><body>made</body></html>" {
			t.Fatalf("answer %d: %d %q", i+1, res.StatusCode, body)
		}
		if ct, ok := res.Header["Content-Type"]; ok {
			t.Errorf("answer %d (replayed %q): Content-Type %q, want none, as the handler said", i+1, res.Header.Get("Idempotent-Replayed"), ct)
		}
	}
}

// TestReplayLeavesFramingToNetHTTP (D265): a row stored by an earlier configuration, or by
// another client through the SQL API, may hold fields StoredHeaders now refuses. A stored
// Content-Length of 10 on a 5-byte body cut nothing short but left the client waiting for
// bytes that never came (or, longer than the body, cut it); a stored Date and Connection went
// out again. A replay now leaves them to net/http, and keeps a Content-Length that says the
// body's length.
func TestReplayLeavesFramingToNetHTTP(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 8)
	ctx := context.Background()
	m, err := idem.New(ctx, idem.Options{DB: pool, Principal: alice, Logger: auditQuiet})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(m.Route(idem.Route{})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain")
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, "hello")
	})))
	defer srv.Close()
	for _, c := range []struct {
		name, headers, wantLength string
	}{
		{"longer", `{"Content-Type":"text/plain","Content-Length":"10","Date":"Mon, 01 Jan 2001 00:00:00 GMT","Connection":"close","Keep-Alive":"timeout=1"}`, "5"},
		{"shorter", `{"Content-Type":"text/plain","content-length":"3","Transfer-Encoding":"chunked"}`, "5"},
	} {
		key := "stale-" + c.name
		if res, body := d265Send(t, http.MethodPost, srv.URL+"/x", key); res.StatusCode != http.StatusCreated || body != "hello" {
			t.Fatalf("%s: the first answer %d %q", c.name, res.StatusCode, body)
		}
		if _, err := pool.Exec(ctx, `UPDATE idem.idempotency_keys SET response_headers = $2::jsonb WHERE key = $1`, key, c.headers); err != nil {
			t.Fatal(err)
		}
		done := make(chan struct{})
		go func() {
			defer close(done)
			res, body, err := d265Do(http.MethodPost, srv.URL+"/x", key)
			if err != nil {
				t.Errorf("%s: the replay: %v", c.name, err)
				return
			}
			if res.Header.Get("Idempotent-Replayed") != "true" || res.StatusCode != http.StatusCreated || body != "hello" {
				t.Errorf("%s: the replay %d %q %v, want the stored 201 hello", c.name, res.StatusCode, body, res.Header)
			}
			if cl := res.Header.Get("Content-Length"); cl != c.wantLength {
				t.Errorf("%s: the replay's Content-Length %q, want %s", c.name, cl, c.wantLength)
			}
			if d := res.Header.Get("Date"); strings.Contains(d, "2001") {
				t.Errorf("%s: the replay's Date is the stored one: %q", c.name, d)
			}
			if res.Close || res.Header.Get("Keep-Alive") != "" || len(res.TransferEncoding) > 0 {
				t.Errorf("%s: the replay carried the stored connection fields: close %v, %v, %v", c.name, res.Close, res.TransferEncoding, res.Header)
			}
		}()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			t.Fatalf("%s: the replay's body did not end within 5 s", c.name)
		}
	}
}

// TestKeyHashIsWhatTheLogsShow: idem.KeyHash of the principal and the key (unquoted) is the
// key_hash of the middleware's log line for that key.
func TestKeyHashIsWhatTheLogsShow(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 4)
	var logs bytes.Buffer
	var mu sync.Mutex
	logger := slog.New(slog.NewJSONHandler(lockedWriter{&mu, &logs}, nil))
	m, err := idem.New(context.Background(), idem.Options{DB: pool, Principal: alice, Logger: logger})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(m.Route(idem.Route{})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusCreated)
	})))
	defer srv.Close()
	for _, body := range []string{`{"a":1}`, `{"a":2}`} { // the second: key_reused, logged
		req, _ := http.NewRequest(http.MethodPost, srv.URL+"/x", strings.NewReader(body))
		req.Header.Set("Idempotency-Key", `"mail:ada@example.com"`)
		req.Header.Set("Content-Type", "application/json")
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		res.Body.Close()
	}
	want := idem.KeyHash("alice", "mail:ada@example.com")
	mu.Lock()
	defer mu.Unlock()
	var seen []string
	for _, line := range strings.Split(strings.TrimSpace(logs.String()), "\n") {
		var rec map[string]any
		if json.Unmarshal([]byte(line), &rec) == nil && rec["key_hash"] != nil {
			seen = append(seen, fmt.Sprint(rec["key_hash"]))
		}
		if strings.Contains(line, "ada@example.com") {
			t.Errorf("a log line holds the key: %s", line)
		}
	}
	if len(seen) == 0 || slices.ContainsFunc(seen, func(h string) bool { return h != want }) {
		t.Errorf("key_hash in the logs %q, want %s (idem.KeyHash) in each", seen, want)
	}
}

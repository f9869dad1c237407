package idem_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
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

// TestKeyedHeadKeepsNoBody (D265): a GET's handler serving a HEAD writes its GET's body, which
// net/http discards. The recorder kept it, and stored it: a body over MaxStoredBodyBytes made
// the repeat 409 response_not_replayable where the first answer was 200, and a smaller one took
// room for nothing. Now nothing of it is kept; the first answer and every repeat say its length
// as Content-Length (net/http's own says it only for a body that fits its buffer).
func TestKeyedHeadKeepsNoBody(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 8)
	m, err := idem.New(context.Background(), idem.Options{DB: pool, Principal: alice, Logger: auditQuiet, MaxStoredBodyBytes: 1000})
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("/doc/{n}", m.Route(idem.Route{})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := map[string]int{"small": 100, "large": 5000}[r.PathValue("n")]
		w.Header().Set("Content-Type", "text/plain")
		_, _ = io.WriteString(w, strings.Repeat("x", n))
	})))
	srv := httptest.NewServer(mux)
	defer srv.Close()
	for _, c := range []struct{ name, length string }{{"small", "100"}, {"large", "5000"}} {
		var got []string
		for i := range 3 {
			res, body := d265Send(t, http.MethodHead, srv.URL+"/doc/"+c.name, "head-"+c.name)
			if res.StatusCode != http.StatusOK || body != "" {
				t.Fatalf("HEAD %s, answer %d: %d %q, want 200 and no body", c.name, i+1, res.StatusCode, body)
			}
			if i > 0 && res.Header.Get("Idempotent-Replayed") != "true" {
				t.Errorf("HEAD %s, answer %d: not a replay: %v", c.name, i+1, res.Header)
			}
			got = append(got, res.Header.Get("Content-Length"))
		}
		for i, cl := range got {
			if cl != c.length {
				t.Errorf("HEAD %s: Content-Length of the answers %q, want %s in every one (answer %d)", c.name, got, c.length, i+1)
				break
			}
		}
		var stored *int
		if err := pool.QueryRow(context.Background(),
			`SELECT octet_length(response_body) FROM idem.idempotency_keys WHERE key = $1`, "head-"+c.name).Scan(&stored); err != nil {
			t.Fatal(err)
		}
		if stored != nil && *stored != 0 {
			t.Errorf("HEAD %s: %d bytes of body stored, want none (net/http sends none)", c.name, *stored)
		}
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
		{"right", `{"Content-Type":"text/plain","Content-Length":"5"}`, "5"},
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

package idem_test

// A review of the fingerprint (D178) found what the tests below assert mended: the body of a
// declared type other than JSON is hashed as its bytes and left to the handler; a body the
// principal function read (a form's access_token) is hashed whole; DecodeJSON refuses names
// that differ only in case whatever else the body holds.

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// rawEchoServer serves POST /things, a route that takes a body of any type and answers with the
// body it was given and its SHA-256, as a blob upload or a text note does.
func rawEchoServer(t *testing.T) (*httptest.Server, *atomic.Int32, *idem.Middleware, idem.Pool) {
	t.Helper()
	pool, _ := pgtest.NewPool(t, 8)
	m, err := idem.New(context.Background(), idem.Options{DB: pool,
		Principal: func(*http.Request) (string, bool) { return "alice", true },
		Logger:    slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	var runs atomic.Int32
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		b, err := io.ReadAll(r.Body)
		if err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		sum := sha256.Sum256(b)
		w.Header().Set("Content-Type", "text/plain")
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, hex.EncodeToString(sum[:8])+" "+string(b))
	})
	mux := http.NewServeMux()
	mux.Handle("POST /things", m.Route(idem.Route{Required: true})(h))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return srv, &runs, m, pool
}

// TestNonJSONBodyIsFingerprintedAsItsBytes: docs/http.md promised that "a body of another
// declared type is fingerprinted as its bytes", but the middleware canonicalized every body that
// parsed as strictly valid JSON, whatever its Content-Type: a text/plain "1.10" and then "1.1",
// or an upload of one JSON file and then of the same file with its members in another order,
// were one request, and the second got the first's answer.
func TestNonJSONBodyIsFingerprintedAsItsBytes(t *testing.T) {
	t.Parallel()
	srv, runs, _, _ := rawEchoServer(t)
	cases := []struct{ name, ctype, first, second string }{
		{"text number", "text/plain; charset=utf-8", "1.10", "1.1"},
		{"text escape", "text/plain", `"caf\u00e9"`, `"café"`},
		{"upload", "application/octet-stream", `{"b":2,"a":1}`, `{"a":1,"b":2}`},
		{"form-typed", "application/x-www-form-urlencoded", `2.50`, `2.5`},
	}
	for i, c := range cases {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		key := fmt.Sprintf("ct-%d", i)
		before := runs.Load()
		st, _, body := pgtest.Send(t, ctx, "POST", srv.URL+"/things", c.first, "Idempotency-Key", key, "Content-Type", c.ctype)
		if st != http.StatusCreated {
			t.Fatalf("%s: first %q: %d %s", c.name, c.first, st, body)
		}
		again, ha, bodyAgain := pgtest.Send(t, ctx, "POST", srv.URL+"/things", c.first, "Idempotency-Key", key, "Content-Type", c.ctype)
		if again != http.StatusCreated || ha.Get("Idempotent-Replayed") != "true" || bodyAgain != body {
			t.Errorf("%s: the same bytes again: %d %q (replayed %q), want the first answer", c.name, again, bodyAgain, ha.Get("Idempotent-Replayed"))
		}
		st2, h2, body2 := pgtest.Send(t, ctx, "POST", srv.URL+"/things", c.second, "Idempotency-Key", key, "Content-Type", c.ctype)
		cancel()
		if st2 != http.StatusUnprocessableEntity {
			t.Errorf("%s: %s body %q after %q under one key: %d (Idempotent-Replayed %q, handler runs %d) %q; want 422",
				c.name, c.ctype, c.second, c.first, st2, h2.Get("Idempotent-Replayed"), runs.Load()-before, body2)
		}
	}
}

// TestNonJSONBodyIsLeftToTheHandler: a text/plain note whose text happens to be a JSON string
// holding the escape \u0000 (or the text {"a":1,"A":2}) was refused as an ambiguous JSON body.
func TestNonJSONBodyIsLeftToTheHandler(t *testing.T) {
	t.Parallel()
	srv, _, _, _ := rawEchoServer(t)
	for i, text := range []string{`"C:\u0000"`, `{"a":1,"A":2}`} {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		st, _, body := pgtest.Send(t, ctx, "POST", srv.URL+"/things", text, "Idempotency-Key", fmt.Sprintf("left-%d", i), "Content-Type", "text/plain")
		cancel()
		if st != http.StatusCreated {
			t.Errorf("text/plain %q: %d %s; want the handler's 201 (the body is not sent as JSON)", text, st, body)
		}
	}
}

// TestEarlierReleaseKeyOfANonJSONBodyReplays: a key that a release before D178 stored for a
// text/plain body that is strictly valid JSON carries the fingerprint of its canonical form
// (idem.ComputeFingerprint); its retry, the same bytes, is hashed as its bytes now, and would
// be told the key was reused. The middleware asks the key again with the earlier fingerprint
// after a mismatch, and the retry gets the first answer.
func TestEarlierReleaseKeyOfANonJSONBodyReplays(t *testing.T) {
	t.Parallel()
	srv, runs, _, pool := rawEchoServer(t)
	ctx := context.Background()
	body := `{"to":"bob","amount":5}` // not canonical: its members out of order
	fp := idem.ComputeFingerprint("POST", "/things", []byte(body))
	storeFirstAnswer(t, pool, idem.Claim{Principal: "alice", Key: "before-d178", Action: "POST /things", Fingerprint: fp.Sum, Fields: fp.Fields})
	st, h, got := pgtest.Send(t, ctx, "POST", srv.URL+"/things", body, "Idempotency-Key", "before-d178", "Content-Type", "text/plain")
	if st != 201 || got != "the first answer" || h.Get("Idempotent-Replayed") != "true" || runs.Load() != 0 {
		t.Fatalf("the retry of a key stored before D178: %d %q (replayed %q, handler runs %d), want the first answer", st, got, h.Get("Idempotent-Replayed"), runs.Load())
	}
	// Another body under that key is still another request.
	if st, _, _ := pgtest.Send(t, ctx, "POST", srv.URL+"/things", `{"to":"bob","amount":6}`, "Idempotency-Key", "before-d178", "Content-Type", "text/plain"); st != 422 {
		t.Fatalf("another body under a key stored before D178: %d, want 422", st)
	}
}

// TestFormReadByThePrincipalIsFingerprinted: a principal function that reads a form-encoded
// access_token (r.FormValue, RFC 6750 section 2.2) made net/http parse the form, which read the
// body: the middleware hashed an empty body, and amount=500 after amount=1 under one key got
// the first's answer. What the principal function reads is kept now. A form parsed before the
// middleware (by an outer handler) cannot be hashed: 500 idempotency_misconfigured.
func TestFormReadByThePrincipalIsFingerprinted(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 8)
	m, err := idem.New(context.Background(), idem.Options{DB: pool,
		Principal: func(r *http.Request) (string, bool) {
			tok := r.FormValue("access_token")
			return tok, tok != ""
		},
		Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	var runs atomic.Int32
	pay := m.Route(idem.Route{Required: true})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "paid %s", r.FormValue("amount"))
	}))
	mux := http.NewServeMux()
	mux.Handle("POST /things", pay)
	mux.Handle("POST /parsed", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_ = r.ParseForm() // an outer handler that reads the form first
		pay.ServeHTTP(w, r)
	}))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	form := "application/x-www-form-urlencoded"
	st, _, body := pgtest.Send(t, ctx, "POST", srv.URL+"/things", "access_token=alice&amount=1", "Idempotency-Key", "form-1", "Content-Type", form)
	if st != http.StatusCreated || body != "paid 1" {
		t.Fatalf("first: %d %q", st, body)
	}
	st, _, body = pgtest.Send(t, ctx, "POST", srv.URL+"/things", "access_token=alice&amount=1", "Idempotency-Key", "form-1", "Content-Type", form)
	if st != http.StatusCreated || body != "paid 1" || runs.Load() != 1 {
		t.Fatalf("the same form again: %d %q, handler runs %d; want the first answer", st, body, runs.Load())
	}
	st, h, body := pgtest.Send(t, ctx, "POST", srv.URL+"/things", "access_token=alice&amount=500", "Idempotency-Key", "form-1", "Content-Type", form)
	if st != http.StatusUnprocessableEntity {
		t.Fatalf("amount=500 after amount=1 under one key: %d %q (Idempotent-Replayed %q, handler runs %d); want 422",
			st, body, h.Get("Idempotent-Replayed"), runs.Load())
	}
	st, _, body = pgtest.Send(t, ctx, "POST", srv.URL+"/parsed", "access_token=alice&amount=7", "Idempotency-Key", "form-2", "Content-Type", form)
	if st != http.StatusInternalServerError || !strings.Contains(body, idem.CodeMisconfigured) || runs.Load() != 1 {
		t.Fatalf("a form parsed before the middleware: %d %s (handler runs %d); want 500 %s, no work", st, body, runs.Load(), idem.CodeMisconfigured)
	}
}

// TestDecodeJSONRefusesCaseDuplicatesWhateverElse: without a key, DecodeJSON refused names that
// differ only in case only when that was the reason the fingerprint gave, and U+0000 elsewhere
// in the body was given first: the body decoded into a map with both members.
func TestDecodeJSONRefusesCaseDuplicatesWhateverElse(t *testing.T) {
	t.Parallel()
	for _, body := range []string{
		`{"amount":1,"Amount":500}`,
		`{"amount":1,"Amount":500,"memo":"\u0000"}`,
		`{"memo":"a\u0000b","to":{"id":1,"ID":2}}`,
	} {
		r := httptest.NewRequest(http.MethodPost, "/things", strings.NewReader(body))
		r.Header.Set("Content-Type", "application/json")
		w := httptest.NewRecorder()
		var v map[string]any
		if ok := idem.DecodeJSON(w, r, &v); ok || w.Code != http.StatusBadRequest {
			t.Errorf("DecodeJSON(%s) into a map: ok %v, status %d, decoded %v; want 400", body, ok, w.Code, v)
		}
	}
}

// storeFirstAnswer stores the key of c completed with 201 "the first answer", as an earlier
// release would have for the request whose fingerprint c carries.
func storeFirstAnswer(t *testing.T, pool idem.Pool, c idem.Claim) {
	t.Helper()
	ctx := context.Background()
	err := idem.RunTx(ctx, pool, idem.TxOptions{}, func(tx *idem.Tx) error {
		d, err := tx.Claim(ctx, c)
		if err != nil || d.Outcome != idem.Claimed {
			return fmt.Errorf("claim: %+v %v", d, err)
		}
		tx.CompleteOnCommit(idem.Response{Status: 201, Body: []byte("the first answer")})
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

package idem_test

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestPrincipalThatRestoresTheBodyGetsItOnce: a principal function that authenticates a
// request by a signature over its body (a webhook's HMAC) reads r.Body and puts a fresh reader
// with the same bytes back, the common net/http idiom. D178's first build kept what the
// principal function read AND read r.Body again: the body was the bytes twice (a JSON body
// refused 400, keyed or not; a text body doubled in the handler and the fingerprint). A body
// the principal function puts back is the whole body now.
func TestPrincipalThatRestoresTheBodyGetsItOnce(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 8)
	secret := []byte("s3cr3t")
	m, err := idem.New(context.Background(), idem.Options{DB: pool,
		Principal: func(r *http.Request) (string, bool) {
			b, err := io.ReadAll(r.Body)
			if err != nil {
				return "", false
			}
			r.Body = io.NopCloser(bytes.NewReader(b)) // put it back for the handler
			mac := hmac.New(sha256.New, secret)
			mac.Write(b)
			return "alice", hmac.Equal([]byte(r.Header.Get("X-Signature")), []byte(hex.EncodeToString(mac.Sum(nil))))
		},
		Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	sign := func(b string) string {
		mac := hmac.New(sha256.New, secret)
		mac.Write([]byte(b))
		return hex.EncodeToString(mac.Sum(nil))
	}
	mux := http.NewServeMux()
	mux.Handle("POST /json", m.Route(idem.Route{})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var v struct {
			Amount int `json:"amount"`
		}
		if !idem.DecodeJSON(w, r, &v) {
			return
		}
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "amount %d", v.Amount)
	})))
	mux.Handle("POST /text", m.Route(idem.Route{})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write(b)
	})))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	body := `{"amount":5}`
	for _, keyed := range []bool{true, false} {
		h := []string{"Content-Type", "application/json", "X-Signature", sign(body)}
		if keyed {
			h = append(h, "Idempotency-Key", "hmac-json")
		}
		st, _, got := pgtest.Send(t, ctx, "POST", srv.URL+"/json", body, h...)
		if st != http.StatusCreated || got != "amount 5" {
			t.Errorf("signed JSON %s (keyed %v): %d %s; want 201 amount 5", body, keyed, st, got)
		}
	}
	note := "pay bob 5"
	st, _, got := pgtest.Send(t, ctx, "POST", srv.URL+"/text", note, "Content-Type", "text/plain",
		"X-Signature", sign(note), "Idempotency-Key", "hmac-text")
	if st != http.StatusCreated || got != note {
		t.Errorf("signed text %q: the handler read %q (%d); want the body once", note, got, st)
	}
}

// TestEarlierReleaseLeaseThatRanOutIsTakenOver: a lease route's request with a text/plain
// body, claimed by a release before D178 (its canonical fingerprint) whose process died with
// the lease (a deploy, the very moment of the upgrade). Its client's retry, the same bytes, must
// take the key over once the lease ran out, as it does for a JSON body. D178's first fallback
// took only a replay or an in-progress answer: the takeover (Claimed) was rolled back and the
// retry told 422 for as long as the key lived. On a lease route it takes the claim now.
func TestEarlierReleaseLeaseThatRanOutIsTakenOver(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 8)
	m, err := idem.New(context.Background(), idem.Options{DB: pool,
		Principal: func(*http.Request) (string, bool) { return "alice", true },
		Logger:    slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	var runs atomic.Int32
	mux := http.NewServeMux()
	mux.Handle("POST /pay", m.Route(idem.Route{Required: true, Lease: time.Second})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		b, _ := io.ReadAll(r.Body)
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "paid %s", b)
	})))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	for _, ct := range []string{"application/json", "text/plain"} {
		body := `{"to":"bob","amount":12}`
		key := "crashed-" + ct
		// The earlier release's claim: canon.Compute's fingerprint, whatever the Content-Type.
		fp := idem.ComputeFingerprint("POST", "/pay", []byte(body))
		d, err := idem.Begin(ctx, pool, idem.Claim{Principal: "alice", Key: key, Action: "POST /pay",
			Fingerprint: fp.Sum, Fields: fp.Fields, Lease: time.Second})
		if err != nil || d.Outcome != idem.Claimed {
			t.Fatalf("the crashed holder's claim: %+v %v", d, err)
		}
		time.Sleep(1500 * time.Millisecond) // its lease runs out
		before := runs.Load()
		st, _, got := pgtest.Send(t, ctx, "POST", srv.URL+"/pay", body, "Idempotency-Key", key, "Content-Type", ct)
		if st != http.StatusCreated || runs.Load() != before+1 {
			t.Errorf("%s: the identical retry of a lease claimed before D178 whose lease ran out: %d %s (handler runs %d); want the takeover, 201",
				ct, st, got, runs.Load()-before)
		}
	}
}

// TestCustomFingerprintLeavesANonJSONBodyToTheHandler: D178 made a body declared as another
// type than JSON the handler's ("It is not refused as ambiguous either (a text note holding
// \u0000 was a 400): it is the handler's"), and Route.Fingerprint's doc says the body is judged
// "as with the default fingerprint". On a route with its own Fingerprint, a text/plain note
// whose text happens to be JSON with U+0000 or names that differ only in case is still refused
// 400 malformed_body before the claim, where the same route with the default fingerprint ran
// its handler (before D178 too). Both run it now.
func TestCustomFingerprintLeavesANonJSONBodyToTheHandler(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 8)
	m, err := idem.New(context.Background(), idem.Options{DB: pool,
		Principal: func(*http.Request) (string, bool) { return "alice", true },
		Logger:    slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	echo := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write(b)
	})
	byBytes := func(r *http.Request, body []byte) idem.Fingerprint {
		return idem.Fingerprint{Sum: sha256.Sum256(append([]byte(r.Method+" "+r.URL.EscapedPath()+"\n"), body...))}
	}
	mux := http.NewServeMux()
	mux.Handle("POST /default", m.Route(idem.Route{Required: true})(echo))
	mux.Handle("POST /custom", m.Route(idem.Route{Required: true, Fingerprint: byBytes})(echo))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for i, text := range []string{`"C:\u0000"`, `{"a":1,"A":2}`} {
		for _, path := range []string{"/default", "/custom"} {
			st, _, body := pgtest.Send(t, ctx, "POST", srv.URL+path, text, "Idempotency-Key", fmt.Sprintf("note-%d%s", i, path), "Content-Type", "text/plain")
			if st != http.StatusCreated {
				t.Errorf("%s text/plain %q: %d %s; want the handler's 201 (the body is not sent as JSON)", path, text, st, body)
			}
		}
	}
}

// TestEarlierReleaseKeyWithASixteenDigitExponentReplays: releases before D178 hashed a body
// with a 16-digit exponent as its bytes (the limit was 15: not strictly valid), whatever its
// Content-Type. D178's first fallback asked the key again with today's canon.Compute, which
// canonicalizes such a body (D178 raised the limit): the identical retry of a text/plain body
// stored before the upgrade was told 422. It uses canon.ComputeBefore178 now.
func TestEarlierReleaseKeyWithASixteenDigitExponentReplays(t *testing.T) {
	t.Parallel()
	srv, runs, _, pool := rawEchoServer(t)
	ctx := context.Background()
	body := `1e1000000000000000` // a 16-digit exponent
	// The fingerprint a release before D178 stored: the raw form (no " bytes" separator).
	fp := sha256.Sum256([]byte("POST\n/things\n" + body))
	storeFirstAnswer(t, pool, idem.Claim{Principal: "alice", Key: "before-d178-exp", Action: "POST /things", Fingerprint: fp})
	st, h, got := pgtest.Send(t, ctx, "POST", srv.URL+"/things", body, "Idempotency-Key", "before-d178-exp", "Content-Type", "text/plain")
	if st != 201 || got != "the first answer" || h.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("the retry of a key stored before D178: %d %q (handler runs %d), want the first answer", st, got, runs.Load())
	}
}

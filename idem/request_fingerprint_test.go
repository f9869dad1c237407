package idem_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestRequestFingerprintIsTheMiddlewares: ComputeFingerprint said it was the fingerprint "as
// the middleware computes it", but for a body declared as another type than JSON the
// middleware hashes the bytes: "1.10" sent as text/plain and ComputeFingerprint's "1.10" (a
// JSON number, canonically 1.1) differ, and a route built on ComputeFingerprint replayed
// text/plain "1.1" for "1.10" (D248). RequestFingerprint is the middleware's own, for any
// Content-Type: a claim with it replays what the middleware stored, and a route built on it
// tells "1.1" from "1.10".
func TestRequestFingerprintIsTheMiddlewares(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	pool, _ := pgtest.NewPool(t, 8)
	m, err := idem.New(ctx, idem.Options{DB: pool, Principal: glAlice, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	echo := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "read %s", b)
	})
	mux := http.NewServeMux()
	mux.Handle("POST /default", m.Route(idem.Route{})(echo))
	mux.Handle("POST /custom", m.Route(idem.Route{Fingerprint: idem.RequestFingerprint})(echo))
	srv := httptest.NewServer(mux)
	defer srv.Close()
	for i, c := range []struct{ contentType, body string }{
		{"text/plain", "1.10"}, {"application/json", `{"a":1.10}`}, {"", `{"a":1}`}, {"application/octet-stream", "\x00\xff"},
	} {
		key := fmt.Sprintf("rf-%d", i)
		headers := []string{"Idempotency-Key", key}
		if c.contentType != "" {
			headers = append(headers, "Content-Type", c.contentType)
		}
		if st, _, b := pgtest.Send(t, ctx, "POST", srv.URL+"/default", c.body, headers...); st != http.StatusCreated {
			t.Fatalf("%q as %q: %d %s", c.body, c.contentType, st, b)
		}
		req := httptest.NewRequest("POST", "/default", strings.NewReader(c.body))
		if c.contentType != "" {
			req.Header.Set("Content-Type", c.contentType)
		}
		fp := idem.RequestFingerprint(req, []byte(c.body))
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		d, err := idem.Begin(ctx, tx, idem.Claim{Principal: "alice", Key: key, Action: "POST /default", Fingerprint: fp.Sum, Fields: fp.Fields})
		_ = tx.Rollback(ctx)
		if err != nil || d.Outcome != idem.Replay {
			t.Errorf("%q as %q: a claim with RequestFingerprint of the same request: %v, %v; want the middleware's answer replayed",
				c.body, c.contentType, d.Outcome, err)
		}
	}
	st1, _, b1 := pgtest.Send(t, ctx, "POST", srv.URL+"/custom", "1.10", "Content-Type", "text/plain", "Idempotency-Key", "rf-custom")
	st2, h2, b2 := pgtest.Send(t, ctx, "POST", srv.URL+"/custom", "1.1", "Content-Type", "text/plain", "Idempotency-Key", "rf-custom")
	if st1 != http.StatusCreated || st2 != http.StatusUnprocessableEntity {
		t.Errorf("text/plain 1.10, then 1.1 under one key on a route built on RequestFingerprint: %d %s, then %d %s (replayed %q); want 201, then 422",
			st1, b1, st2, b2, h2.Get("Idempotent-Replayed"))
	}
}

package idem_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestHeadRepeatKeepsContentLength: D184's sendTo keeps "a HEAD's Content-Length with no
// body" on the first answer, but a repeat of that keyed HEAD is replayed without it
// (Content-Length was not stored, and the replay has no body to compute it from): the first
// answer said 10 bytes, its repeat nothing ("byte for byte", docs/http.md). A HEAD's
// Content-Length is stored now.
func TestHeadRepeatKeepsContentLength(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 8)
	m, err := idem.New(context.Background(), idem.Options{DB: pool, Principal: alice, Logger: auditQuiet})
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("HEAD /h", m.Route(idem.Route{})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", "10") // the GET body's length; a HEAD writes none
		w.WriteHeader(http.StatusOK)
	})))
	srv := httptest.NewServer(mux)
	defer srv.Close()
	var got []string
	for range 2 {
		req, _ := http.NewRequest("HEAD", srv.URL+"/h", nil)
		req.Header.Set("Idempotency-Key", "hd-1")
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		res.Body.Close()
		got = append(got, res.Header.Get("Content-Length"))
	}
	if got[0] != got[1] {
		t.Errorf("keyed HEAD with Content-Length 10: first answer Content-Length %q, its repeat %q", got[0], got[1])
	}
}

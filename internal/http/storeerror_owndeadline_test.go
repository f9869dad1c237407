package idemhttp_test

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/gorilla/mux"

	idemhttp "github.com/pgidem/pgidem/internal/http"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestHandlersOwnDeadlineIsNotStoreError: a handler that runs a statement under a shorter
// context of its own and answers 504 when it ends: pgx closes the connection of a statement
// whose context ended, and the middleware took the closed connection for the database
// dropping it, counting store_error (a review of D274). Only a statement that failed because
// the database dropped the connection (a FATAL, a network error) counts.
func TestHandlersOwnDeadlineIsNotStoreError(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 8)
	obs := newObserver()
	m, err := idemhttp.New(idemhttp.Options{DB: pool, Metrics: obs,
		Principal: func(*http.Request) (string, bool) { return "alice", true },
		Logger:    slog.New(slog.NewTextHandler(io.Discard, nil)), RouteTemplate: muxTemplate})
	if err != nil {
		t.Fatal(err)
	}
	r := mux.NewRouter()
	r.Handle("/slow", m.Route(idemhttp.Route{})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx := idemhttp.Tx(r.Context())
		ctx, cancel := context.WithTimeout(r.Context(), 100*time.Millisecond)
		defer cancel()
		if _, err := tx.Exec(ctx, `SELECT pg_sleep(2)`); err != nil {
			http.Error(w, "the report took too long: "+err.Error(), http.StatusGatewayTimeout)
			return
		}
		w.WriteHeader(201)
	}))).Methods("POST")
	srv := httptest.NewServer(r)
	defer srv.Close()
	req, _ := http.NewRequest("POST", srv.URL+"/slow", strings.NewReader(`{}`))
	req.Header.Set("Idempotency-Key", "own-deadline")
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusGatewayTimeout {
		t.Fatalf("status %d %s, want the handler's 504", resp.StatusCode, b)
	}
	if obs.counts()["store_error"] != 0 || obs.counts()["acquired"] != 1 {
		t.Errorf("a handler's own statement deadline counted store_error: %v", obs.counts())
	}
}

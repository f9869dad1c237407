package idem_test

import (
	"context"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strconv"
	"testing"
	"time"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestTransactionalRetryAfterEstimatesTheRestOfTheWork: a duplicate of a request still running
// on a transactional route gets, past its DuplicateWait, 409 request_in_progress with a
// Retry-After that estimates the rest of the work (docs/http.md), as on a lease route. It was
// always 1 there: only a lease's work was timed. The route's work takes 4 s here, measured
// once; a duplicate that came 0.2 s after the holder and waited 1 s is told about 3 s.
func TestTransactionalRetryAfterEstimatesTheRestOfTheWork(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 8)
	m, err := idem.New(context.Background(), idem.Options{DB: pool, DuplicateWait: time.Second,
		Principal: func(*http.Request) (string, bool) { return "alice", true },
		Logger:    slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("POST /slow", m.Route(idem.Route{Required: true})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		time.Sleep(4 * time.Second)
		w.WriteHeader(http.StatusCreated)
	})))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	if st, _, body := pgtest.Send(t, ctx, "POST", srv.URL+"/slow", `{}`, "Idempotency-Key", "first", "Content-Type", "application/json"); st != http.StatusCreated {
		t.Fatalf("the first request: %d %s", st, body)
	}
	held := make(chan int, 1)
	go func() {
		st, _, _ := pgtest.Send(t, ctx, "POST", srv.URL+"/slow", `{}`, "Idempotency-Key", "second", "Content-Type", "application/json")
		held <- st
	}()
	time.Sleep(200 * time.Millisecond)
	st, h, body := pgtest.Send(t, ctx, "POST", srv.URL+"/slow", `{}`, "Idempotency-Key", "second", "Content-Type", "application/json")
	if st != http.StatusConflict {
		t.Fatalf("the duplicate: %d %s; want 409 request_in_progress", st, body)
	}
	after, err := strconv.Atoi(h.Get("Retry-After"))
	if err != nil || after < 2 || after > 4 {
		t.Fatalf("the duplicate's Retry-After %q: want the rest of 4 s of work after 1.2 s, about 3 s", h.Get("Retry-After"))
	}
	if st := <-held; st != http.StatusCreated {
		t.Fatalf("the holder: %d", st)
	}
}

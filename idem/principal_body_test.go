package idem_test

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestPrincipalThatBoundsTheBodyBeforeItsForm: Options.Principal "may read the body (a
// form's access_token through r.FormValue): what it reads is kept and fingerprinted with the
// rest". A principal function that bounds the body before it parses the form (the usual
// r.Body = http.MaxBytesReader(...) then r.FormValue) reads the form through a reader of its
// own that wraps the middleware's. The middleware took any r.Body other than its wrapper as
// "a body put back, the whole body", dropped what its wrapper kept, and read the exhausted
// MaxBytesReader: the body was empty, the form parsed, and every keyed form request was 500
// idempotency_misconfigured ("its form was parsed" before the middleware), although nothing
// ran before the middleware: so D178's second build did. Every byte read from the connection's
// body is kept now, whatever reader the principal function leaves.
func TestPrincipalThatBoundsTheBodyBeforeItsForm(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 8)
	m, err := idem.New(context.Background(), idem.Options{DB: pool,
		Principal: func(r *http.Request) (string, bool) {
			r.Body = http.MaxBytesReader(nil, r.Body, 64<<10)
			tok := r.FormValue("access_token")
			return tok, tok != ""
		},
		Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("POST /pay", m.Route(idem.Route{})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "paid %s", r.PostFormValue("amount"))
	})))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	form := "access_token=alice&amount=5"
	st, _, got := pgtest.Send(t, ctx, "POST", srv.URL+"/pay", form, "Content-Type", "application/x-www-form-urlencoded")
	if st != http.StatusCreated || got != "paid 5" {
		t.Fatalf("without a key: %d %s", st, got)
	}
	st, _, got = pgtest.Send(t, ctx, "POST", srv.URL+"/pay", form, "Content-Type", "application/x-www-form-urlencoded", "Idempotency-Key", "bounded-form")
	if st != http.StatusCreated || got != "paid 5" {
		t.Errorf("with a key: %d %s; want 201 paid 5, the form fingerprinted", st, got)
	}
	// And the form is what is fingerprinted: another amount under the key is another request.
	st, _, got = pgtest.Send(t, ctx, "POST", srv.URL+"/pay", "access_token=alice&amount=500", "Content-Type", "application/x-www-form-urlencoded", "Idempotency-Key", "bounded-form")
	if st != http.StatusUnprocessableEntity {
		t.Errorf("another amount under the key: %d %s; want 422", st, got)
	}
}

package idem_test

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestWriteAfterTheHandlerReturnedGoesNowhere: a handler that goes on writing from a goroutine
// of its own after it returned (which a ResponseWriter forbids) had its late bytes reach the
// first client, not the stored answer, racing with the send (go test -race reported it): the
// repeat got less than the first answer. They now go nowhere (the late Write returns an
// error), and the first answer and its repeat are the same. D259.
func TestWriteAfterTheHandlerReturnedGoesNowhere(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 4)
	m := quietMiddleware(t, idem.Options{DB: pool})
	lateErr := make(chan error, 1)
	mux := http.NewServeMux()
	mux.Handle("POST /a", m.Route(idem.Route{Required: true})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		returned := make(chan struct{})
		defer close(returned)
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte("A"))
		go func() {
			<-returned
			time.Sleep(20 * time.Millisecond) // past the middleware's end of the handler, which follows its return
			var err error
			for end := time.Now().Add(300 * time.Millisecond); time.Now().Before(end); time.Sleep(time.Millisecond) {
				w.Header().Set("X-Late", "1")
				if _, e := w.Write([]byte("X")); e != nil && err == nil {
					err = e
				}
			}
			lateErr <- err
		}()
	})))
	srv := httptest.NewServer(mux)
	defer srv.Close()
	post := func() (string, string) {
		req, _ := http.NewRequest(http.MethodPost, srv.URL+"/a", strings.NewReader(`{}`))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", "late-1")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return string(b), resp.Header.Get("X-Late")
	}
	first, firstLate := post()
	if err := <-lateErr; err == nil {
		t.Errorf("the handler's writes after it returned: no error; want one (the response is no longer its)")
	}
	again, _ := post()
	if first != "A" || again != "A" || firstLate != "" {
		t.Fatalf("first answer %q (X-Late %q), repeat %q; want \"A\" both times, nothing written after the handler returned", first, firstLate, again)
	}
}

// TestLowerCaseHeaderNamesAreStored: a handler that sets w.Header()["location"] and
// w.Header()["content-type"] (net/http sends a name as it is in the map) had both sent on the
// first answer and dropped from the stored one, whose allowlist names are canonical: the
// repeat came without Location, and with a sniffed text/plain. The names are taken canonical
// when the status is written: both answers carry Location and application/json. D259.
func TestLowerCaseHeaderNamesAreStored(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 4)
	m := quietMiddleware(t, idem.Options{DB: pool})
	mux := http.NewServeMux()
	mux.Handle("POST /o", m.Route(idem.Route{Required: true})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header()["location"] = []string{"/orders/1"}
		w.Header()["content-type"] = []string{"application/json"}
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte(`{"id":1}`))
	})))
	srv := httptest.NewServer(mux)
	defer srv.Close()
	for i := range 2 {
		req, _ := http.NewRequest(http.MethodPost, srv.URL+"/o", strings.NewReader(`{}`))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", "lower-1")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.Header.Get("Location") != "/orders/1" || len(resp.Header.Values("Content-Type")) != 1 || resp.Header.Get("Content-Type") != "application/json" {
			t.Errorf("answer %d: Location %q, Content-Type %q; want /orders/1 and application/json alone", i, resp.Header.Get("Location"), resp.Header.Values("Content-Type"))
		}
	}
}

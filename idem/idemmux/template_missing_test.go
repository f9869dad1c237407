package idemmux_test

import (
	"bytes"
	"context"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"github.com/gorilla/mux"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/idem/idemmux"
	"github.com/pgidem/pgidem/internal/pgtest"
)

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// Declare with a {variable} and r.Use(m.Handler) without Options.RouteTemplate: the template is
// the URL path, which the declaration never matches, and every request passed through without
// a key's protection, silently (a black-box review). Handler now logs a warning, once; with
// idemmux.RouteTemplate there is none, and the route is served. A RouteTemplate that returns ""
// (a router's function that does not know the route) leaves the URL path too, and is warned
// about in its own words.
func TestHandlerWarnsWithoutARouteTemplate(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 4)
	for _, c := range []struct {
		name     string
		template func(*http.Request) string
		warning  string
	}{
		{"none", nil, "Options.RouteTemplate is not set"},
		{"idemmux", idemmux.RouteTemplate, ""},
		{"empty", func(*http.Request) string { return "" }, `Options.RouteTemplate returned \"\"`},
	} {
		withTemplate := c.warning == ""
		var logs syncBuffer
		o := idem.Options{DB: pool, Principal: func(*http.Request) (string, bool) { return "alice", true },
			Logger: slog.New(slog.NewTextHandler(&logs, nil)), RouteTemplate: c.template}
		m, err := idem.New(context.Background(), o)
		if err != nil {
			t.Fatal(err)
		}
		m.Declare("POST", "/v1/items/{id}", idem.Route{Required: true})
		r := mux.NewRouter()
		r.Use(m.Handler)
		r.HandleFunc("/v1/items/{id:[0-9]+}", func(w http.ResponseWriter, r *http.Request) {
			w.WriteHeader(http.StatusCreated)
		}).Methods("POST")
		// A route without a path template (CORS preflight), which idemmux.RouteTemplate gives
		// "" for: not a declared route's request, no reason to warn (a review found the
		// warning sent an operator whose Handler was installed right to the wrong fix).
		r.Methods("OPTIONS").HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusNoContent) })
		srv := httptest.NewServer(r)
		t.Cleanup(srv.Close)
		if status, _, _ := pgtest.Send(t, context.Background(), "OPTIONS", srv.URL+"/v1/items/7", ""); status != http.StatusNoContent {
			t.Fatalf("RouteTemplate %s: OPTIONS got %d", c.name, status)
		}
		if n := strings.Count(logs.String(), "without a route template"); n != 0 {
			t.Errorf("RouteTemplate %s: a request to a route that is not declared logged %d warnings; log:\n%s", c.name, n, logs.String())
		}
		for range 2 {
			status, _, _ := pgtest.Send(t, context.Background(), "POST", srv.URL+"/v1/items/7", `{}`)
			if want := map[bool]int{false: http.StatusCreated, true: http.StatusBadRequest}[withTemplate]; status != want {
				t.Errorf("RouteTemplate %s: a request without a key to a Required route got %d, want %d", c.name, status, want)
			}
		}
		n := strings.Count(logs.String(), "without a route template")
		if withTemplate && n != 0 || !withTemplate && (n != 1 || !strings.Contains(logs.String(), c.warning)) {
			t.Errorf("RouteTemplate %s: %d warnings, want %d saying %q; log:\n%s", c.name, n, map[bool]int{false: 1, true: 0}[withTemplate], c.warning, logs.String())
		}
	}
}

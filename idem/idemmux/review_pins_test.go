package idemmux_test

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/gorilla/mux"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/idem/idemmux"
)

// TestRouteTemplateOutsideAndWithoutAPath: RouteTemplate is "the path template of
// gorilla/mux's current route ..., or "" outside a gorilla route"; "The template is gorilla/mux's,
// a variable's pattern included". Pinned without a database: outside a route ""; a route on a
// host-templated subrouter gives its path template alone; a variable's pattern is kept.
func TestRouteTemplateOutsideAndWithoutAPath(t *testing.T) {
	if got := idemmux.RouteTemplate(httptest.NewRequest("POST", "/x", nil)); got != "" {
		t.Errorf("outside a gorilla route: %q, want \"\"", got)
	}
	var got []string
	rec := func(w http.ResponseWriter, r *http.Request) { got = append(got, idemmux.RouteTemplate(r)) }
	r := mux.NewRouter()
	tenant := r.Host("{tenant}.example.test").Subrouter()
	tenant.HandleFunc("/v1/orders/{id:[0-9]+}", rec).Methods("PATCH")
	r.HandleFunc("/v1/q", rec).Queries("mode", "{mode}").Methods("POST")
	r.Host("nopath.example.test").HandlerFunc(rec)
	for _, req := range []*http.Request{
		httptest.NewRequest("PATCH", "http://a.example.test/v1/orders/12", nil),
		httptest.NewRequest("POST", "http://x.test/v1/q?mode=fast", nil),
		httptest.NewRequest("POST", "http://nopath.example.test/anything/7", nil),
	} {
		r.ServeHTTP(httptest.NewRecorder(), req)
	}
	want := []string{"/v1/orders/{id:[0-9]+}", "/v1/q", ""}
	if strings.Join(got, "|") != strings.Join(want, "|") {
		t.Errorf("templates %q, want %q", got, want)
	}
}

// TestDeclaredPatchAndDeleteOnHostSubrouter: Declare (without the pattern) finds PATCH
// and DELETE routes with patterns on a host-templated subrouter, r.Use(m.Handler) on the root;
// each keyed request runs once and replays.
func TestDeclaredPatchAndDeleteOnHostSubrouter(t *testing.T) {
	e := routesNew(t)
	r := mux.NewRouter()
	r.Use(e.m.Handler)
	e.m.Declare("PATCH", "/v1/orders/{id}", idem.Route{Required: true})
	e.m.Declare("delete", "/v1/orders/{id}", idem.Route{})
	tenant := r.Host("{tenant}.example.test").Subrouter()
	tenant.Handle("/v1/orders/{id:[0-9]+}", e.effect("patch")).Methods("PATCH")
	tenant.Handle("/v1/orders/{id:[0-9]+}", e.effect("delete")).Methods("DELETE")
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		req.Host = "acme.example.test" // the tenant's host name
		r.ServeHTTP(w, req)
	}))
	defer srv.Close()
	for i := 0; i < 2; i++ {
		for _, c := range []struct{ method, key string }{{"PATCH", "p1"}, {"DELETE", "d1"}} {
			st, h, b := send(t, c.method, srv.URL+"/v1/orders/42", `{}`, "Idempotency-Key", c.key)
			if st != 201 {
				t.Fatalf("%s %d: %d %s", c.method, i, st, b)
			}
			if (i == 1) != (h.Get("Idempotent-Replayed") == "true") {
				t.Errorf("%s %d: replayed %q", c.method, i, h.Get("Idempotent-Replayed"))
			}
		}
	}
	if st, _, b := send(t, "PATCH", srv.URL+"/v1/orders/42", `{}`); st != 400 || !strings.Contains(b, idem.CodeKeyMissing) {
		t.Errorf("PATCH without a key (Required): %d %s", st, b)
	}
	for _, route := range []string{"patch", "delete"} {
		if n := e.count(t, route); n != 1 {
			t.Errorf("%s: %d effects, want 1", route, n)
		}
	}
}

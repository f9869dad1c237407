package idemmux_test

// idemmux, from a review of it (gorilla/mux's route templates) with Route and Declare+Handler.

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"testing"

	"github.com/gorilla/mux"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/idem/idemmux"
	"github.com/pgidem/pgidem/idem/idemtest"
	"github.com/pgidem/pgidem/internal/pgtest"
)

func TestMain(m *testing.M) { os.Exit(idemtest.Main(m)) }

type routesMux struct {
	pool *pgxpool.Pool
	m    *idem.Middleware
}

func routesNew(t *testing.T) *routesMux {
	t.Helper()
	pool, _ := pgtest.NewPool(t, 6)
	pgtest.Exec(t, pool, `CREATE TABLE routes_effects (id serial PRIMARY KEY, route text, path text)`)
	m, err := idem.New(context.Background(), idem.Options{DB: pool, RouteTemplate: idemmux.RouteTemplate,
		Principal: func(*http.Request) (string, bool) { return "alice", true },
		Logger:    slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	return &routesMux{pool: pool, m: m}
}

func (e *routesMux) effect(name string) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		ctx := r.Context()
		var id int
		var err error
		if tx := idem.TxFrom(ctx); tx != nil {
			err = tx.QueryRow(ctx, `INSERT INTO routes_effects (route, path) VALUES ($1, $2) RETURNING id`, name, r.URL.Path).Scan(&id)
		} else {
			err = e.pool.QueryRow(ctx, `INSERT INTO routes_effects (route, path) VALUES ($1, $2) RETURNING id`, name, r.URL.Path).Scan(&id)
		}
		if err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(201)
		fmt.Fprintf(w, `{"id":%d}`, id)
	}
}

func (e *routesMux) count(t *testing.T, route string) int {
	return pgtest.Count(t, e.pool, `SELECT count(*) FROM routes_effects WHERE route = $1`, route)
}

func (e *routesMux) actions(t *testing.T) []string {
	rows, err := e.pool.Query(context.Background(), `SELECT DISTINCT key FROM idem.idempotency_keys ORDER BY 1`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var out []string
	for rows.Next() {
		var k string
		_ = rows.Scan(&k)
		out = append(out, k)
	}
	return out
}

func send(t *testing.T, method, url, body string, headers ...string) (int, http.Header, string) {
	t.Helper()
	return pgtest.Send(t, context.Background(), method, url, body, headers...)
}

// TestRoutesSubrouterAndLateRoutes: Declare with the full template (prefix included) finds a
// route on a subrouter with a PathPrefix, r.Use(m.Handler) installed before the routes are
// registered; a route with the same template and another method is its own declaration (PUT
// required, POST optional); a variable with a regex holding braces ({id:[0-9]{2,4}}) is found
// by a declaration without the pattern. Asserted: each keyed request runs once and replays.
func TestRoutesSubrouterAndLateRoutes(t *testing.T) {
	e := routesNew(t)
	r := mux.NewRouter()
	api := r.PathPrefix("/v1").Subrouter()
	api.Use(e.m.Handler) // before any route
	e.m.Declare("POST", "/v1/accounts/{id}/deposits", idem.Route{})
	e.m.Declare("PUT", "/v1/accounts/{id}/deposits", idem.Route{Required: true})
	e.m.Declare("POST", "/v1/orders/{n}", idem.Route{Required: true})
	api.Handle("/accounts/{id}/deposits", e.effect("post-deposit")).Methods("POST")
	api.Handle("/accounts/{id}/deposits", e.effect("put-deposit")).Methods("PUT")
	api.Handle("/orders/{n:[0-9]{2,4}}", e.effect("order")).Methods("POST")
	srv := httptest.NewServer(r)
	defer srv.Close()

	for i := 0; i < 2; i++ {
		if st, _, b := send(t, "POST", srv.URL+"/v1/accounts/7/deposits", `{}`, "Idempotency-Key", "d1"); st != 201 {
			t.Fatalf("POST deposit %d: %d %s", i, st, b)
		}
		if st, _, b := send(t, "PUT", srv.URL+"/v1/accounts/7/deposits", `{}`, "Idempotency-Key", "d2"); st != 201 {
			t.Fatalf("PUT deposit %d: %d %s", i, st, b)
		}
		if st, _, b := send(t, "POST", srv.URL+"/v1/orders/123", `{}`, "Idempotency-Key", "o1"); st != 201 {
			t.Fatalf("POST order %d: %d %s", i, st, b)
		}
	}
	if st, _, b := send(t, "PUT", srv.URL+"/v1/accounts/7/deposits", `{}`); st != 400 || !strings.Contains(b, idem.CodeKeyMissing) {
		t.Errorf("PUT without a key (Required): %d %s", st, b)
	}
	if st, _, b := send(t, "POST", srv.URL+"/v1/orders/12", `{}`); st != 400 || !strings.Contains(b, idem.CodeKeyMissing) {
		t.Errorf("POST order without a key (Required, regex with braces): %d %s", st, b)
	}
	for _, c := range []struct {
		route string
		want  int
	}{{"post-deposit", 1}, {"put-deposit", 1}, {"order", 1}} {
		if n := e.count(t, c.route); n != c.want {
			t.Errorf("%s: %d effects, want %d", c.route, n, c.want)
		}
	}
	// The same key on the same template with the other method is another request: 422.
	if st, _, b := send(t, "PUT", srv.URL+"/v1/accounts/7/deposits", `{}`, "Idempotency-Key", "d1"); st != 422 {
		t.Errorf("PUT under POST's key: %d %s", st, b)
	}
}

// TestRoutesPrefixRouteKeepsPathsApart: a gorilla PathPrefix route has one template for every
// path under it; the same key on two paths under it must not replay one path's answer for the
// other (the fingerprint covers the path). Asserted: the second path gets 422, not a replay.
func TestRoutesPrefixRouteKeepsPathsApart(t *testing.T) {
	e := routesNew(t)
	r := mux.NewRouter()
	r.PathPrefix("/files/").Handler(e.m.Route(idem.Route{})(e.effect("files"))).Methods("POST")
	srv := httptest.NewServer(r)
	defer srv.Close()
	if st, _, b := send(t, "POST", srv.URL+"/files/a", `{}`, "Idempotency-Key", "f1"); st != 201 {
		t.Fatalf("first: %d %s", st, b)
	}
	st, h, b := send(t, "POST", srv.URL+"/files/b", `{}`, "Idempotency-Key", "f1")
	if st != 422 || h.Get("Idempotent-Replayed") == "true" {
		t.Fatalf("other path under the prefix, same key: %d replayed=%q %s", st, h.Get("Idempotent-Replayed"), b)
	}
}

// TestRoutesNonPostMethodsOnDeclaredRoutes: with Declare("POST", ...) and r.Use(m.Handler), a
// GET, HEAD or OPTIONS with a key on the same path is not declared: it passes through
// untouched (docs: "all others pass through untouched, header or not"), and stores nothing.
// Asserted: no key row for them, and the handler runs each time.
func TestRoutesNonPostMethodsOnDeclaredRoutes(t *testing.T) {
	e := routesNew(t)
	r := mux.NewRouter()
	r.Use(e.m.Handler)
	e.m.Declare("POST", "/v1/things", idem.Route{Required: true})
	r.Handle("/v1/things", e.effect("things")).Methods("POST", "GET", "HEAD", "OPTIONS")
	srv := httptest.NewServer(r)
	defer srv.Close()
	for _, method := range []string{"GET", "HEAD", "OPTIONS", "GET"} {
		if st, _, b := send(t, method, srv.URL+"/v1/things", "", "Idempotency-Key", "g1"); st != 201 {
			t.Errorf("%s with a key: %d %s", method, st, b)
		}
	}
	if n := e.count(t, "things"); n != 4 {
		t.Errorf("%d effects, want 4 (each undeclared request runs)", n)
	}
	if keys := e.actions(t); len(keys) != 0 {
		t.Errorf("keys stored for undeclared methods: %v", keys)
	}
}

// TestRoutesUndeclaredRouteIgnoresTheKey: a keyed POST to a gorilla route that is not declared
// (Handler installed) runs every time, as docs/http.md "Which requests take part" says. This
// is the documented limitation; asserted to pin it.
func TestRoutesUndeclaredRouteIgnoresTheKey(t *testing.T) {
	e := routesNew(t)
	r := mux.NewRouter()
	r.Use(e.m.Handler)
	r.Handle("/v1/other", e.effect("other")).Methods("POST")
	srv := httptest.NewServer(r)
	defer srv.Close()
	for i := 0; i < 2; i++ {
		send(t, "POST", srv.URL+"/v1/other", `{}`, "Idempotency-Key", "u1")
	}
	if n := e.count(t, "other"); n != 2 {
		t.Errorf("%d effects", n)
	}
}

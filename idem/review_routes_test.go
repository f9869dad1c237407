package idem_test

// A review of how requests are matched to idempotent routes: each test asserts a documented
// promise. A lowercase method, a declared template without a variable's pattern and nested
// middlewares failed before D159.

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/gorilla/mux"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/idem/idemmux"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// routingEnv is a pool with an effects table and a middleware (gorilla-aware RouteTemplate).
type routingEnv struct {
	pool *pgxpool.Pool
	m    *idem.Middleware
}

func routingNew(t *testing.T) *routingEnv {
	t.Helper()
	pool, _ := pgtest.NewPool(t, 6)
	pgtest.Exec(t, pool, `CREATE TABLE effects (id serial PRIMARY KEY, route text NOT NULL, amount int)`)
	m, err := idem.New(context.Background(), idem.Options{DB: pool, LockTimeout: 200 * time.Millisecond,
		Principal:     func(*http.Request) (string, bool) { return "alice", true },
		RouteTemplate: idemmux.RouteTemplate,
		Logger:        slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	return &routingEnv{pool: pool, m: m}
}

// effect is a handler that records one effect for route name: through the request's
// transaction on a declared route, through the pool elsewhere. A body is optional.
func (e *routingEnv) effect(name string) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		var in struct {
			Amount int `json:"amount"`
		}
		if r.ContentLength != 0 {
			if !idem.DecodeJSON(w, r, &in) {
				return
			}
		}
		ctx := r.Context()
		var id int
		var err error
		if tx := idem.TxFrom(ctx); tx != nil {
			err = tx.QueryRow(ctx, `INSERT INTO effects (route, amount) VALUES ($1, $2) RETURNING id`, name, in.Amount).Scan(&id)
		} else {
			err = e.pool.QueryRow(ctx, `INSERT INTO effects (route, amount) VALUES ($1, $2) RETURNING id`, name, in.Amount).Scan(&id)
		}
		if err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(201)
		fmt.Fprintf(w, `{"id":%d,"route":%q,"amount":%d}`, id, name, in.Amount)
	}
}

func (e *routingEnv) count(t *testing.T, route string) int {
	return pgtest.Count(t, e.pool, `SELECT count(*) FROM effects WHERE route = $1`, route)
}

// routingSend sends one request with a Host of its own (host "" keeps the server's).
func routingSend(t *testing.T, method, url, host, body string, headers ...string) (int, http.Header, string) {
	t.Helper()
	req, err := http.NewRequest(method, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if host != "" {
		req.Host = host
	}
	for i := 0; i+1 < len(headers); i += 2 {
		if headers[i+1] != "" {
			req.Header.Add(headers[i], headers[i+1])
		}
	}
	c := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	res, err := c.Do(req)
	if err != nil {
		return -1, nil, err.Error()
	}
	defer res.Body.Close()
	b, _ := io.ReadAll(res.Body)
	return res.StatusCode, res.Header, string(b)
}

// routingRaw sends a raw request line (for paths a client would clean) and returns the status.
func routingRaw(t *testing.T, srv *httptest.Server, method, target, body string, headers ...string) (int, string) {
	t.Helper()
	conn, err := net.Dial("tcp", strings.TrimPrefix(srv.URL, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	var b strings.Builder
	fmt.Fprintf(&b, "%s %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: %d\r\n", method, target, len(body))
	for i := 0; i+1 < len(headers); i += 2 {
		fmt.Fprintf(&b, "%s: %s\r\n", headers[i], headers[i+1])
	}
	b.WriteString("\r\n" + body)
	if _, err := conn.Write([]byte(b.String())); err != nil {
		t.Fatal(err)
	}
	res, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	rb, _ := io.ReadAll(res.Body)
	return res.StatusCode, string(rb)
}

const routingJSON = "application/json"

// ---------------------------------------------------------------------------------------------
// Findings (these fail on the current code)
// ---------------------------------------------------------------------------------------------

// TestHostRoutesNeedAnActionEach: the default action is the method and the path template,
// without the host (nor the query): two ServeMux routes that differ only by host
// ("POST a.example/orders", "POST b.example/orders") would share the action "POST /orders" and
// the fingerprint, and host b would get host a's stored answer under the same key. The docs
// ("Wiring") say to give such routes an Action each; then the same key on the other host's
// route is a mismatch, and b's handler does not run.
func TestHostRoutesNeedAnActionEach(t *testing.T) {
	t.Parallel()
	e := routingNew(t)
	mx := http.NewServeMux()
	mx.Handle("POST a.example/orders", e.m.Route(idem.Route{Required: true, Action: "POST a.example/orders"})(e.effect("a")))
	mx.Handle("POST b.example/orders", e.m.Route(idem.Route{Required: true, Action: "POST b.example/orders"})(e.effect("b")))
	srv := httptest.NewServer(mx)
	defer srv.Close()

	st1, _, b1 := routingSend(t, "POST", srv.URL+"/orders", "a.example", `{"amount":5}`, "Idempotency-Key", "k1", "Content-Type", routingJSON)
	st2, h2, b2 := routingSend(t, "POST", srv.URL+"/orders", "b.example", `{"amount":5}`, "Idempotency-Key", "k1", "Content-Type", routingJSON)
	if st1 != 201 {
		t.Fatalf("host a: %d %s", st1, b1)
	}
	if st2 != 422 || !strings.Contains(b2, idem.CodeKeyReuse) || e.count(t, "b") != 0 {
		t.Errorf("host b's route under host a's key: %d %s replayed=%q; want 422 %s; b ran %d times",
			st2, b2, h2.Get("Idempotent-Replayed"), idem.CodeKeyReuse, e.count(t, "b"))
	}
}

// TestRoutingLowercaseMethodSkipsDeclaredRoute: a gorilla route registered without a method matcher
// and declared with Declare("POST", ..., Required). A request whose method is "post" reaches
// the same route and handler (net/http passes the method through as sent), but Handler looked
// up "post /orders" and passed it through untouched: the effect ran without a key, and a keyed
// "post" ran its effect on every retry. Declare upper-cases the declared method; the lookup
// now upper-cases the request's too.
func TestRoutingLowercaseMethodSkipsDeclaredRoute(t *testing.T) {
	t.Parallel()
	e := routingNew(t)
	r := mux.NewRouter()
	r.Handle("/orders", e.effect("orders"))
	e.m.Declare("POST", "/orders", idem.Route{Required: true})
	r.Use(e.m.Handler)
	srv := httptest.NewServer(r)
	defer srv.Close()

	if st, _, body := routingSend(t, "POST", srv.URL+"/orders", "", `{"amount":1}`, "Content-Type", routingJSON); st != 400 {
		t.Fatalf("POST without a key: %d %s, want 400 (the route is declared Required)", st, body)
	}
	st, _, body := routingSend(t, "post", srv.URL+"/orders", "", `{"amount":1}`, "Content-Type", routingJSON)
	t.Logf("post without a key: %d %s", st, body)
	st1, _, b1 := routingSend(t, "post", srv.URL+"/orders", "", `{"amount":2}`, "Idempotency-Key", "k1", "Content-Type", routingJSON)
	st2, h2, b2 := routingSend(t, "post", srv.URL+"/orders", "", `{"amount":2}`, "Idempotency-Key", "k1", "Content-Type", routingJSON)
	t.Logf("post k1: %d %s; again: %d %s replayed=%q", st1, b1, st2, b2, h2.Get("Idempotent-Replayed"))
	if st != 400 {
		t.Errorf("method \"post\" without a key on a Required route: %d %s, want 400 %s", st, body, idem.CodeKeyMissing)
	}
	if n := e.count(t, "orders"); n != 1 {
		t.Errorf("%d effects, want 1 (the keyed post once, replayed)", n)
	}
}

// TestRoutingRegexTemplateDeclareNeverMatches: gorilla's template keeps a variable's pattern
// ("/accounts/{id:[0-9]+}/deposits"); a Declare with the template as the docs write it
// ("/accounts/{id}/deposits") never matched, silently: the Required route ran without a key
// and a keyed request ran on every retry. Both sides of the lookup now leave the patterns out.
func TestRoutingRegexTemplateDeclareNeverMatches(t *testing.T) {
	t.Parallel()
	e := routingNew(t)
	r := mux.NewRouter()
	r.Handle("/accounts/{id:[0-9]+}/deposits", e.effect("deposits")).Methods("POST")
	e.m.Declare("POST", "/accounts/{id}/deposits", idem.Route{Required: true})
	r.Use(e.m.Handler)
	srv := httptest.NewServer(r)
	defer srv.Close()
	st, _, body := routingSend(t, "POST", srv.URL+"/accounts/7/deposits", "", `{"amount":1}`, "Content-Type", routingJSON)
	routingSend(t, "POST", srv.URL+"/accounts/7/deposits", "", `{"amount":2}`, "Idempotency-Key", "k1", "Content-Type", routingJSON)
	routingSend(t, "POST", srv.URL+"/accounts/7/deposits", "", `{"amount":2}`, "Idempotency-Key", "k1", "Content-Type", routingJSON)
	t.Logf("no key: %d %s; effects %d", st, body, e.count(t, "deposits"))
	if st != 400 || e.count(t, "deposits") != 1 {
		t.Errorf("declared Required route with a regexp variable: no key gave %d, %d effects (want 400 and 1)", st, e.count(t, "deposits"))
	}
}

// TestRoutingGorillaVariantsHold: gorilla/mux with Declare + Use(m.Handler).
func TestRoutingGorillaVariantsHold(t *testing.T) {
	t.Parallel()
	e := routingNew(t)
	r := mux.NewRouter()
	r.Use(e.m.Handler) // Use before the routes and the declarations
	r.Handle("/orders", e.effect("orders-post")).Methods("POST")
	r.Handle("/orders", e.effect("orders-put")).Methods("PUT")
	r.Handle("/multi", e.effect("multi")).Methods("POST", "PUT")
	v1 := r.PathPrefix("/v1").Subrouter()
	v1.Handle("/items/{id}", e.effect("items")).Methods("POST")
	r.PathPrefix("/files/").Handler(e.effect("files")).Methods("POST")
	r.Handle("/other", e.effect("other")).Methods("POST")
	e.m.Declare("POST", "/orders", idem.Route{Required: true})
	e.m.Declare("put", "/orders", idem.Route{Required: true})
	e.m.Declare("POST", "/multi", idem.Route{Required: true})
	e.m.Declare("POST", "/v1/items/{id}", idem.Route{Required: true})
	e.m.Declare("POST", "/files/", idem.Route{Required: true})
	e.m.Declare("POST", "/never", idem.Route{Required: true}) // no such route: harmless
	srv := httptest.NewServer(r)
	defer srv.Close()
	post := func(method, path, key, body string) (int, http.Header, string) {
		return routingSend(t, method, srv.URL+path, "", body, "Idempotency-Key", key, "Content-Type", routingJSON)
	}
	// Required on each declared route.
	for _, c := range [][2]string{{"POST", "/orders"}, {"PUT", "/orders"}, {"POST", "/multi"}, {"POST", "/v1/items/3"}, {"POST", "/files/a/b"}} {
		if st, _, b := post(c[0], c[1], "", `{"amount":1}`); st != 400 || !strings.Contains(b, idem.CodeKeyMissing) {
			t.Errorf("%s %s without a key: %d %s", c[0], c[1], st, b)
		}
	}
	// PUT on the multi route is not declared: passes through (documented).
	if st, _, _ := post("PUT", "/multi", "", `{"amount":1}`); st != 201 {
		t.Errorf("PUT /multi: %d", st)
	}
	// The same key on POST then PUT of one template: 422 with changed_fields [].
	if st, _, b := post("POST", "/orders", "same", `{"amount":1}`); st != 201 {
		t.Fatalf("%d %s", st, b)
	}
	st, _, b := post("PUT", "/orders", "same", `{"amount":1}`)
	var p idem.Problem
	_ = json.Unmarshal([]byte(b), &p)
	if st != 422 || p.Code != idem.CodeKeyReuse || p.ChangedFields == nil || len(*p.ChangedFields) != 0 {
		t.Errorf("PUT under POST's key: %d %s", st, b)
	}
	// The same key across two different templates: 422 with [].
	if st, _, b := post("POST", "/v1/items/3", "same", `{"amount":1}`); st != 422 || !strings.Contains(b, `"changed_fields":[]`) {
		t.Errorf("another route under the key: %d %s", st, b)
	}
	// A percent-encoded letter reaches the declared route and is a declared request.
	if st, b := routingRaw(t, srv, "POST", "/%6Frders", `{"amount":1}`, "Content-Type", routingJSON); st != 400 || !strings.Contains(b, idem.CodeKeyMissing) {
		t.Errorf("/%%6Frders without a key: %d %s", st, b)
	}
	// Dot segments and double slashes: gorilla's clean redirect, before any handler.
	for _, target := range []string{"//orders", "/./orders", "/v1/../orders", "/orders/"} {
		if st, _ := routingRaw(t, srv, "POST", target, `{"amount":1}`, "Content-Type", routingJSON); st == 201 {
			t.Errorf("%s ran the handler", target)
		}
	}
	// HEAD and OPTIONS on a POST route: 405, no effect.
	for _, m := range []string{"HEAD", "OPTIONS", "GET"} {
		if st, _, _ := post(m, "/orders", "", ""); st != 405 {
			t.Errorf("%s /orders: %d", m, st)
		}
	}
	// A keyed request to an undeclared route runs every time (documented).
	post("POST", "/other", "u", `{"amount":1}`)
	post("POST", "/other", "u", `{"amount":1}`)
	if n := e.count(t, "other"); n != 2 {
		t.Errorf("undeclared route: %d effects", n)
	}
	// Body-less POSTs replay; another body under the key is 422.
	st1, _, b1 := post("POST", "/files/x", "nobody", "")
	st2, h2, b2 := post("POST", "/files/x", "nobody", "")
	if st1 != 201 || st2 != 201 || b1 != b2 || h2.Get("Idempotent-Replayed") != "true" {
		t.Errorf("body-less: %d %s then %d %s", st1, b1, st2, b2)
	}
	if st, _, _ := post("POST", "/files/x", "nobody", `{"amount":1}`); st != 422 {
		t.Errorf("a body under a body-less key: %d", st)
	}
	if n := e.count(t, "orders-post") + e.count(t, "orders-put") + e.count(t, "items") + e.count(t, "files"); n != 2 {
		t.Errorf("%d effects on declared routes, want 2", n)
	}
}

// TestRoutingServeMuxVariantsHold: ServeMux patterns with m.Route.
func TestRoutingServeMuxVariantsHold(t *testing.T) {
	t.Parallel()
	e := routingNew(t)
	mx := http.NewServeMux()
	mx.Handle("POST /orders/{$}", e.m.Route(idem.Route{Required: true})(e.effect("orders")))
	mx.Handle("POST /files/{rest...}", e.m.Route(idem.Route{Required: true})(e.effect("files")))
	mx.Handle("/any", e.m.Route(idem.Route{Required: true})(e.effect("any")))
	srv := httptest.NewServer(mx)
	defer srv.Close()
	// Missing trailing slash: ServeMux's redirect (307 for a POST in this Go) before the
	// handler, nothing claimed; the followed POST with the same key runs once.
	if st, _, _ := routingSend(t, "POST", srv.URL+"/orders", "", `{"amount":1}`, "Idempotency-Key", "r1", "Content-Type", routingJSON); st != 307 {
		t.Errorf("POST /orders: %d", st)
	}
	if st, _, b := routingSend(t, "POST", srv.URL+"/orders/", "", `{"amount":1}`, "Idempotency-Key", "r1", "Content-Type", routingJSON); st != 201 {
		t.Errorf("the followed POST /orders/ with the key: %d %s", st, b)
	}
	for _, target := range []string{"//orders/", "/./orders/", "/x/../orders/"} {
		if st, _ := routingRaw(t, srv, "POST", target, `{"amount":1}`, "Content-Type", routingJSON); st == 201 {
			t.Errorf("%s ran the handler", target)
		}
	}
	if st, _, _ := routingSend(t, "POST", srv.URL+"/files/a/b", "", `{"amount":1}`, "Content-Type", routingJSON); st != 400 {
		t.Errorf("files without a key: %d", st)
	}
	// Wildcard: another path under the key is 422 (one action, another path).
	routingSend(t, "POST", srv.URL+"/files/a/b", "", `{"amount":1}`, "Idempotency-Key", "f", "Content-Type", routingJSON)
	if st, _, b := routingSend(t, "POST", srv.URL+"/files/a/c", "", `{"amount":1}`, "Idempotency-Key", "f", "Content-Type", routingJSON); st != 422 || !strings.Contains(b, `"changed_fields":[]`) {
		t.Errorf("another wildcard path: %d %s", st, b)
	}
	// Method-less pattern: lower-case "post" takes part (action OTHER), and is 422 against POST.
	if st, _, _ := routingSend(t, "post", srv.URL+"/any", "", `{"amount":1}`, "Content-Type", routingJSON); st != 400 {
		t.Errorf("post /any without a key: %d", st)
	}
	routingSend(t, "POST", srv.URL+"/any", "", `{"amount":1}`, "Idempotency-Key", "m", "Content-Type", routingJSON)
	if st, _, _ := routingSend(t, "post", srv.URL+"/any", "", `{"amount":1}`, "Idempotency-Key", "m", "Content-Type", routingJSON); st != 422 {
		t.Errorf("post under POST's key: %d", st)
	}
	// Content-Type variants: text/plain JSON is hashed raw and 415 from DecodeJSON (stored);
	// Application/JSON with parameters is JSON; a bad JSON body without Content-Type is 400
	// before any claim.
	if st, _, _ := routingSend(t, "POST", srv.URL+"/any", "", `{"amount":1}`, "Idempotency-Key", "c1", "Content-Type", "text/plain"); st != 415 {
		t.Errorf("text/plain: %d", st)
	}
	if st, _, _ := routingSend(t, "POST", srv.URL+"/any", "", `{"amount":1}`, "Idempotency-Key", "c1", "Content-Type", routingJSON); st != 422 {
		t.Errorf("the body sent as JSON under the key of its text/plain form: %d (documented: another request, 422; D178)", st)
	}
	if st, _, _ := routingSend(t, "POST", srv.URL+"/any", "", `{"amount":1}`, "Idempotency-Key", "c2", "Content-Type", "Application/JSON; charset=utf-8"); st != 201 {
		t.Errorf("Application/JSON: %d", st)
	}
	if st, _, b := routingSend(t, "POST", srv.URL+"/any", "", `{"amount":1,"amount":2}`, "Idempotency-Key", "c3"); st != 400 || !strings.Contains(b, idem.CodeMalformedBody) {
		t.Errorf("duplicate members, no Content-Type: %d %s", st, b)
	}
	if n := pgtest.Count(t, e.pool, `SELECT count(*) FROM effects`); n != 4 {
		t.Errorf("%d effects, want 4", n)
	}
}

// TestRoutingStrictSlashTransactionalHolds: on a transactional route the StrictSlash 301 rolls the
// claim back, so the followed request with the same key runs.
func TestRoutingStrictSlashTransactionalHolds(t *testing.T) {
	t.Parallel()
	e := routingNew(t)
	r := mux.NewRouter().StrictSlash(true)
	r.Handle("/orders/", e.effect("orders")).Methods("POST")
	e.m.Declare("POST", "/orders/", idem.Route{Required: true})
	r.Use(e.m.Handler)
	srv := httptest.NewServer(r)
	defer srv.Close()
	st1, _, _ := routingSend(t, "POST", srv.URL+"/orders", "", `{"amount":1}`, "Idempotency-Key", "k1", "Content-Type", routingJSON)
	st2, _, b2 := routingSend(t, "POST", srv.URL+"/orders/", "", `{"amount":1}`, "Idempotency-Key", "k1", "Content-Type", routingJSON)
	if st1 != 301 || st2 != 201 || e.count(t, "orders") != 1 {
		t.Fatalf("%d then %d %s", st1, st2, b2)
	}
}

// TestRoutingDoubleHandlerNesting: m.Handler installed on a router and on its subrouter (or
// Declare plus m.Route on the same route) served one request twice, nested: the inner claim
// waited for the outer one, which waited for the inner, and the inner's 409 was stored as the
// answer. The inner one now passes the request on.
func TestRoutingDoubleHandlerNesting(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 6)
	pgtest.Exec(t, pool, `CREATE TABLE effects (id serial PRIMARY KEY, route text NOT NULL, amount int)`)
	m, err := idem.New(context.Background(), idem.Options{DB: pool, LockTimeout: 200 * time.Millisecond, DuplicateWait: time.Second,
		Principal:     func(*http.Request) (string, bool) { return "alice", true },
		RouteTemplate: idemmux.RouteTemplate,
		Logger:        slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	e := &routingEnv{pool: pool, m: m}
	r := mux.NewRouter()
	r.Use(m.Handler)
	v1 := r.PathPrefix("/v1").Subrouter()
	v1.Use(m.Handler)
	v1.Handle("/orders", e.effect("orders")).Methods("POST")
	m.Declare("POST", "/v1/orders", idem.Route{})
	srv := httptest.NewServer(r)
	defer srv.Close()
	st1, h1, b1 := routingSend(t, "POST", srv.URL+"/v1/orders", "", `{"amount":1}`, "Idempotency-Key", "k1", "Content-Type", routingJSON)
	st2, h2, b2 := routingSend(t, "POST", srv.URL+"/v1/orders", "", `{"amount":1}`, "Idempotency-Key", "k1", "Content-Type", routingJSON)
	t.Logf("first: %d %s %v; retry: %d %s replayed=%q", st1, b1, h1.Get("Retry-After"), st2, b2, h2.Get("Idempotent-Replayed"))
	if st2 != 201 {
		t.Errorf("nested middleware: the retry gets %d, %d effects", st2, e.count(t, "orders"))
	}
}

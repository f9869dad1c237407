package idem_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/gorilla/mux"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/idem/idemmux"
	"github.com/pgidem/pgidem/idem/idemtest"
	"github.com/pgidem/pgidem/internal/pgtest"
)

func TestMain(m *testing.M) { os.Exit(idemtest.Main(m)) }

// deposits is the handler of every router below: it writes a deposit through the request's
// transaction, and waits on hold when the body asks it to.
func deposits(hold chan struct{}) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		var in struct {
			Amount int  `json:"amount"`
			Hold   bool `json:"hold"`
		}
		if !idem.DecodeJSON(w, r, &in) {
			return
		}
		if in.Hold {
			<-hold
		}
		var id int
		if err := idem.TxFrom(r.Context()).QueryRow(r.Context(),
			`INSERT INTO deposits (account, amount) VALUES ($1, $2) RETURNING id`, r.PathValue("id"), in.Amount).Scan(&id); err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"id":%d,"amount":%d}`, id, in.Amount)
	}
}

// prefixRouter is a router of one's own: it knows /accounts/{id}/deposits and tells the
// middleware its template through the request's context.
type prefixRouter struct{ next http.Handler }

type templateKey struct{}

func (p prefixRouter) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	parts := strings.Split(strings.Trim(r.URL.Path, "/"), "/")
	if r.Method != "POST" || len(parts) != 3 || parts[0] != "accounts" || parts[2] != "deposits" {
		http.NotFound(w, r)
		return
	}
	r.SetPathValue("id", parts[1])
	p.next.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), templateKey{}, "/accounts/{id}/deposits")))
}

// TestSameAnswersOnEveryRouter: the same middleware and handler on net/http's ServeMux (a Go
// 1.22 pattern), on gorilla/mux (Route and Declare with Handler), and on a router of one's own
// (Options.RouteTemplate) give the same answers: a replay, 422 naming the changed field, 409
// while the first request runs, 400 for a malformed key. The action comes from the route
// template, so two accounts' deposits are different routes of one action.
func TestSameAnswersOnEveryRouter(t *testing.T) {
	t.Parallel()
	routers := map[string]func(m *idem.Middleware, h http.Handler) http.Handler{
		"ServeMux": func(m *idem.Middleware, h http.Handler) http.Handler {
			mux := http.NewServeMux()
			mux.Handle("POST /accounts/{id}/deposits", m.Route(idem.Route{Required: true})(h))
			return mux
		},
		"gorilla/mux Route": func(m *idem.Middleware, h http.Handler) http.Handler {
			r := mux.NewRouter()
			r.Handle("/accounts/{id}/deposits", m.Route(idem.Route{Required: true})(withMuxVars(h))).Methods("POST")
			return r
		},
		"gorilla/mux Declare": func(m *idem.Middleware, h http.Handler) http.Handler {
			r := mux.NewRouter()
			r.Handle("/accounts/{id}/deposits", withMuxVars(h)).Methods("POST")
			m.Declare("POST", "/accounts/{id}/deposits", idem.Route{Required: true})
			r.Use(m.Handler)
			return r
		},
		"a router of one's own": func(m *idem.Middleware, h http.Handler) http.Handler {
			return prefixRouter{m.Route(idem.Route{Required: true})(h)}
		},
	}
	for name, build := range routers {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			pool, _ := pgtest.NewPool(t, 8)
			pgtest.Exec(t, pool, `CREATE TABLE deposits (id serial PRIMARY KEY, account text, amount int)`)
			m, err := idem.New(context.Background(), idem.Options{DB: pool, LockTimeout: 200 * time.Millisecond,
				Principal: func(*http.Request) (string, bool) { return "alice", true },
				RouteTemplate: func(r *http.Request) string {
					if s, _ := r.Context().Value(templateKey{}).(string); s != "" {
						return s // the router of one's own
					}
					return idemmux.RouteTemplate(r) // gorilla/mux; "" elsewhere: ServeMux's pattern
				},
				Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
			if err != nil {
				t.Fatal(err)
			}
			hold := make(chan struct{})
			srv := httptest.NewServer(build(m, deposits(hold)))
			defer srv.Close()
			post := func(path, key, body string) (int, http.Header, string) {
				return pgtest.Send(t, context.Background(), "POST", srv.URL+path, body, "Idempotency-Key", key,
					"Content-Type", "application/json")
			}

			st, _, first := post("/accounts/7/deposits", "k1", `{"amount":5}`)
			st2, h2, again := post("/accounts/7/deposits", "k1", `{"amount":5}`)
			if st != 201 || st2 != 201 || again != first || h2.Get("Idempotent-Replayed") != "true" {
				t.Fatalf("replay: %d %s, then %d %s %v", st, first, st2, again, h2)
			}
			st, _, body := post("/accounts/7/deposits", "k1", `{"amount":6}`)
			var p idem.Problem
			_ = json.Unmarshal([]byte(body), &p)
			if st != 422 || p.Code != idem.CodeKeyReuse || p.ChangedFields == nil || fmt.Sprint(*p.ChangedFields) != "[amount]" {
				t.Fatalf("another amount: %d %s", st, body)
			}
			if st, _, body := post("/accounts/8/deposits", "k1", `{"amount":5}`); st != 422 || !strings.Contains(body, `"changed_fields":[]`) {
				t.Fatalf("the same key on another account's route (another path, one action): %d %s", st, body)
			}
			if st, _, body := post("/accounts/7/deposits", "a b", `{"amount":5}`); st != 400 || !strings.Contains(body, idem.CodeKeyInvalid) {
				t.Fatalf("a malformed key: %d %s", st, body)
			}
			done := make(chan int, 1)
			go func() { st, _, _ := post("/accounts/7/deposits", "k2", `{"amount":1,"hold":true}`); done <- st }()
			pgtest.WaitFor(t, pool, `SELECT count(*) FROM pg_stat_activity WHERE state = 'idle in transaction' AND datname = current_database()`)
			st, h, body := post("/accounts/7/deposits", "k2", `{"amount":1,"hold":true}`)
			if st != 409 || h.Get("Retry-After") == "" || !strings.Contains(body, idem.CodeInProgress) {
				t.Fatalf("while the first runs: %d %s", st, body)
			}
			close(hold)
			if st := <-done; st != 201 {
				t.Fatalf("the held request: %d", st)
			}
			var action string
			if err := pool.QueryRow(context.Background(), `SELECT count(DISTINCT action_hash)::text FROM idem.idempotency_keys`).Scan(&action); err != nil || action != "1" {
				t.Fatalf("%s distinct actions, want 1 (POST /accounts/{id}/deposits): %v", action, err)
			}
			if n := pgtest.Count(t, pool, `SELECT count(*) FROM deposits`); n != 2 {
				t.Fatalf("%d deposits, want 2", n)
			}
		})
	}
}

// withMuxVars copies gorilla/mux's path variables to the request's PathValue, as ServeMux
// sets them, so the one handler reads both.
func withMuxVars(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		for k, v := range mux.Vars(r) {
			r.SetPathValue(k, v)
		}
		h.ServeHTTP(w, r)
	})
}

package idem_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"testing"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestChangedFieldsOfAnEmptyObject: docs/http.md, idempotency_key_reuse: "changed_fields
// names the top-level JSON members that differ (added and removed ones too); it is [] when
// only the action changed, and absent when that is unknown (a body that is not a JSON object,
// one of more than 64 members, or one whose member names take more than 4,096 bytes
// together)", and "a request to another path of the same route (another {id}) is refused as
// well, but changed_fields names only the body's members that differ, [] when none does".
// {} is a JSON object (a DELETE or PUT with an empty object body is common): a member added
// to it, or all members removed, must be named; the same {} on another path of the route is [].
// changed_fields was absent in all three cases: the SQL API stored an empty object's fields as
// NULL, "unknown" (D184).
func TestChangedFieldsOfAnEmptyObject(t *testing.T) {
	t.Parallel()
	srv, m := auditServer(t, idem.Options{}, idem.Route{}, func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusCreated)
	})
	mux := http.NewServeMux()
	mux.Handle("POST /things", m.Route(idem.Route{})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(201) })))
	mux.Handle("POST /things/{id}", m.Route(idem.Route{})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(201) })))
	srv.Config.Handler = mux
	for _, c := range []struct{ key, path1, first, path2, second, want string }{
		{"ef-1", "/things", `{}`, "/things", `{"amount":1}`, "[amount]"},
		{"ef-2", "/things", `{"amount":1}`, "/things", `{}`, "[amount]"},
		{"ef-3", "/things/1", `{}`, "/things/2", `{}`, "[]"},
	} {
		send := func(path, body string) (int, string) {
			s, _, b := pgtest.Send(t, context.Background(), "POST", srv.URL+path, body, "Idempotency-Key", c.key, "Content-Type", "application/json")
			return s, b
		}
		if s, b := send(c.path1, c.first); s != 201 {
			t.Fatalf("%s: first %d %s", c.key, s, b)
		}
		s, b := send(c.path2, c.second)
		var p idem.Problem
		if err := json.Unmarshal([]byte(b), &p); err != nil || s != 422 || p.Code != idem.CodeKeyReuse {
			t.Fatalf("%s: %d %s", c.key, s, b)
		}
		if p.ChangedFields == nil {
			t.Errorf("%s %s then %s %s: 422 without changed_fields, want %s: %s", c.path1, c.first, c.path2, c.second, c.want, b)
		} else if got := fmt.Sprint(*p.ChangedFields); got != c.want {
			t.Errorf("%s %s then %s %s: changed_fields %s, want %s", c.path1, c.first, c.path2, c.second, got, c.want)
		}
	}
}

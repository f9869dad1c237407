package idem_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/canon"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// actionPathServer serves POST /things/{id} (transactional) and POST /jobs/{id} (a lease route)
// through m, with pool as its database.
func actionPathServer(t *testing.T, opts idem.Options) *httptest.Server {
	t.Helper()
	opts.Principal, opts.Logger = alice, auditQuiet
	m, err := idem.New(context.Background(), opts)
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	created := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"id":%q}`, r.PathValue("id"))
	})
	mux.Handle("POST /things/{id}", m.Route(idem.Route{})(created))
	mux.Handle("POST /jobs/{id}", m.Route(idem.Route{Lease: time.Minute})(created))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return srv
}

func changedFields(t *testing.T, status int, body string) string {
	t.Helper()
	var p idem.Problem
	if err := json.Unmarshal([]byte(body), &p); err != nil || status != 422 || p.Code != idem.CodeKeyReuse {
		t.Fatalf("want 422 %s: %d %s", idem.CodeKeyReuse, status, body)
	}
	if p.ChangedFields == nil {
		return "absent"
	}
	return fmt.Sprint(*p.ChangedFields)
}

// TestAnotherPathOfTheRouteIsAnotherAction: the SQL API's changed_fields is [] when the method
// or the path changed, and names the body's members only for the same method and path. The
// middleware's action was the route's template (POST /things/{id}), so a key reused on
// another path of the route (another {id}) with another body named the body's members
// (["amount"]), as if only the amount had changed. Another path is another action now (D218):
// [], as for another method; the same path with another body still names the members.
func TestAnotherPathOfTheRouteIsAnotherAction(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 4)
	srv := actionPathServer(t, idem.Options{DB: pool})
	send := func(path, key, body string) (int, string) {
		s, _, b := pgtest.Send(t, context.Background(), "POST", srv.URL+path, body, "Idempotency-Key", key, "Content-Type", "application/json")
		return s, b
	}
	for _, route := range []string{"/things/", "/jobs/"} {
		key := "ap" + route
		if s, b := send(route+"1", key, `{"amount":1}`); s != 201 {
			t.Fatalf("%s: first %d %s", route, s, b)
		}
		for _, c := range []struct{ path, body, want string }{
			{route + "2", `{"amount":2}`, "[]"},
			{route + "2", `{"amount":1}`, "[]"},
			{route + "1", `{"amount":2}`, "[amount]"},
		} {
			s, b := send(c.path, key, c.body)
			if got := changedFields(t, s, b); got != c.want {
				t.Errorf("%s1 {amount:1}, then %s %s: changed_fields %s, want %s", route, c.path, c.body, got, c.want)
			}
		}
		if s, b := send(route+"1", key, `{"amount":1}`); s != 201 || b != `{"id":"1"}` {
			t.Errorf("%s: the repeat: %d %s", route, s, b)
		}
	}
}

// TestKeyStoredUnderTheRouteActionStillAnswers: releases before D218 stored a key of a route
// with parameters under the route's action alone (POST /things/{id}); this one asks under the
// action and the path's digest, which is another action to those rows. Their repeats still
// replay, a changed body still names its members, and a lease they hold is still in progress
// (a 409 request_in_progress, not a 422): the middleware asks again under the route's action.
func TestKeyStoredUnderTheRouteActionStillAnswers(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 4)
	ctx := context.Background()
	srv := actionPathServer(t, idem.Options{DB: pool, DuplicateWait: 300 * time.Millisecond})
	send := func(path, key, body string) (int, http.Header, string) {
		return pgtest.Send(t, ctx, "POST", srv.URL+path, body, "Idempotency-Key", key, "Content-Type", "application/json")
	}
	// A completed key of the transactional route, as the earlier release stored it.
	fp := canon.Compute("POST", "/things/1", []byte(`{"amount":1}`))
	err := idem.RunTx(ctx, pool, idem.TxOptions{}, func(tx *idem.Tx) error {
		d, err := tx.Claim(ctx, idem.Claim{Principal: "alice", Key: "old-thing", Action: "POST /things/{id}", Fingerprint: fp.Sum, Fields: fp.Fields})
		if err != nil || d.Outcome != idem.Claimed {
			return fmt.Errorf("%+v %v", d, err)
		}
		tx.CompleteOnCommit(idem.Response{Status: 201, Header: http.Header{"Content-Type": {"application/json"}}, Body: []byte(`{"id":"old"}`)})
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if s, h, b := send("/things/1", "old-thing", `{"amount":1}`); s != 201 || b != `{"id":"old"}` || h.Get("Idempotent-Replayed") != "true" {
		t.Errorf("the repeat of a key stored under the route's action: %d %s replayed %q", s, b, h.Get("Idempotent-Replayed"))
	}
	if s, _, b := send("/things/1", "old-thing", `{"amount":2}`); changedFields(t, s, b) != "[amount]" {
		t.Errorf("a changed body under a key stored under the route's action: %d %s", s, b)
	}
	// A lease of the lease route in progress, as the earlier release claimed it.
	fpJob := canon.Compute("POST", "/jobs/1", []byte(`{"amount":1}`))
	d, err := idem.Begin(ctx, pool, idem.Claim{Principal: "alice", Key: "old-job", Action: "POST /jobs/{id}",
		Fingerprint: fpJob.Sum, Fields: fpJob.Fields, Lease: time.Minute})
	if err != nil || d.Outcome != idem.Claimed {
		t.Fatalf("the earlier release's lease: %+v %v", d, err)
	}
	s, h, b := send("/jobs/1", "old-job", `{"amount":1}`)
	var p idem.Problem
	_ = json.Unmarshal([]byte(b), &p)
	if s != http.StatusConflict || p.Code != idem.CodeInProgress || h.Get("Retry-After") == "" {
		t.Errorf("the repeat of a lease held under the route's action: %d %s, want 409 %s with Retry-After", s, b, idem.CodeInProgress)
	}
}

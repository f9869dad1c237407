package main

// Black-box probes of docs/http.md, docs/operations.md and docs/ledger.md against the reference server,
// written from the docs alone.

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"github.com/pgidem/pgidem/internal/pgtest"
)

func outsideCode(r resp) string {
	var p struct {
		Code string `json:"code"`
	}
	_ = json.Unmarshal([]byte(r.body), &p)
	return p.Code
}

// TestOutsideServerErrorNotStored: docs/http.md, the table, "handler 401, 408, 428, 429, 3xx, 5xx,
// panic | the handler's response; effect rolled back | no", and docs/http.md: "PostgreSQL
// refuses the handler's own work (a constraint ...) | 500 internal_error ... nothing changed (a
// retry meets it again ...)". A deposit that a constraint of the DBA's refuses is 500 and not
// stored; once the constraint is gone the retry with the same key runs and is 201.
func TestOutsideServerErrorNotStored(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	pid, token := s.principal("fivexx")
	acc := reviewAccount(t, s, token, "EUR")
	ctx := context.Background()
	pgtest.Exec(t, s.pool, `ALTER TABLE ledger.deposits ADD CONSTRAINT no_13 CHECK (amount <> 13)`)
	path := fmt.Sprintf("/v1/accounts/%d/deposits", acc)
	r := s.call("POST", path, token, "d13", `{"amount":13}`, "Content-Type", "application/json")
	if r.status != 500 || outsideCode(r) != "internal_error" {
		t.Fatalf("a deposit refused by a constraint: %d %s; want 500 internal_error", r.status, r.body)
	}
	if n := ctKeys(s, pid); n != 0 {
		t.Errorf("%d keys stored after a 500; want none", n)
	}
	if n := s.count(`SELECT balance FROM ledger.accounts WHERE id = $1`, acc); n != 0 {
		t.Errorf("balance %d after a 500; want 0", n)
	}
	if _, err := s.pool.Exec(ctx, `ALTER TABLE ledger.deposits DROP CONSTRAINT no_13`); err != nil {
		t.Fatal(err)
	}
	r = s.call("POST", path, token, "d13", `{"amount":13}`, "Content-Type", "application/json")
	if r.status != 201 || r.header.Get("Idempotent-Replayed") != "" {
		t.Fatalf("the retry after the 500: %d %s (replayed %q); want 201, run", r.status, r.body, r.header.Get("Idempotent-Replayed"))
	}
	if n := s.count(`SELECT balance FROM ledger.accounts WHERE id = $1`, acc); n != 13 {
		t.Errorf("balance %d, want 13", n)
	}
}

// TestOutsideLedgerFinalErrors: docs/ledger.md's table of final errors, "stored and replayed":
// each refusal is answered with its code, and the retry under the same key gets the same answer
// byte for byte with Idempotent-Replayed: true, even once the cause is gone.
func TestOutsideLedgerFinalErrors(t *testing.T) {
	t.Parallel()
	s := startServer(t, map[string]string{"PAYOUT_PROVIDER_DELAY": "0"})
	_, token := s.principal("finals")
	_, other := s.principal("other")
	eur, eur2, usd := reviewAccount(t, s, token, "EUR"), reviewAccount(t, s, token, "EUR"), reviewAccount(t, s, token, "USD")
	foreign := reviewAccount(t, s, other, "EUR")
	r := s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", eur), token, "", `{"amount":100}`, "Content-Type", "application/json")
	if r.status != 201 {
		t.Fatal(r)
	}
	json := []string{"Content-Type", "application/json"}
	for i, c := range []struct {
		path, body string
		status     int
		code       string
		extra      []string
	}{
		{"/v1/transfers", fmt.Sprintf(`{"from":%d,"to":%d,"amount":10}`, eur, usd), 422, "currency_mismatch", json},
		{"/v1/transfers", fmt.Sprintf(`{"from":%d,"to":%d,"amount":10}`, eur, eur), 422, "validation_failed", json},
		{"/v1/transfers", fmt.Sprintf(`{"from":%d,"to":%d,"amount":10}`, eur, foreign), 404, "account_not_found", json},
		{"/v1/transfers", fmt.Sprintf(`{"from":%d,"to":%d,"amount":10}`, foreign, eur), 404, "account_not_found", json},
		{"/v1/transfers", fmt.Sprintf(`{"from":%d,"to":%d,"amount":0}`, eur, eur2), 422, "validation_failed", json},
		{"/v1/transfers", fmt.Sprintf(`{"from":%d,"to":%d,"amount":1000}`, eur, eur2), 422, "insufficient_funds", json},
		{"/v1/transfers", fmt.Sprintf(`{"from":%d,"to":%d,"amount":10}`, eur, eur2), 415, "unsupported_media_type", []string{"Content-Type", "text/plain"}},
		{"/v1/transfers", fmt.Sprintf(`{"from":%d,"to":%d}`, eur, eur2), 400, "malformed_body", json},
		{fmt.Sprintf("/v1/accounts/%d/deposits", foreign), `{"amount":10}`, 404, "account_not_found", json},
		{"/v1/accounts/999999/deposits", `{"amount":10}`, 404, "account_not_found", json},
		{fmt.Sprintf("/v1/accounts/%d/deposits", eur), `{"amount":-1}`, 422, "validation_failed", json},
		{fmt.Sprintf("/v1/accounts/%d/deposits", eur), `{"amount":9223372036854775807}`, 422, "balance_limit", json},
		{"/v1/accounts", `{"name":"","currency":"EUR"}`, 422, "validation_failed", json},
		{"/v1/accounts", `{"name":"x","currency":"eur"}`, 422, "validation_failed", json},
		{"/v1/accounts", `{"name":"x","currency":"EURO"}`, 422, "validation_failed", json},
		{"/v1/api-tokens", `{"name":""}`, 422, "validation_failed", json},
		{"/v1/payouts", fmt.Sprintf(`{"account":%d,"amount":9223372036854775808}`, eur), 422, "validation_failed", json},
		{"/v1/payouts", fmt.Sprintf(`{"account":%d,"amount":5}`, foreign), 404, "account_not_found", json},
		{"/v1/payouts", `{"account":999999,"amount":5}`, 404, "account_not_found", json},
		{"/v1/stepped-payouts", fmt.Sprintf(`{"account":%d,"amount":100000}`, eur), 422, "insufficient_funds", json},
		{"/v1/stepped-payouts", fmt.Sprintf(`{"account":%d,"amount":5}`, foreign), 404, "account_not_found", json},
	} {
		key := fmt.Sprintf("fe-%d", i)
		first := s.call("POST", c.path, token, key, c.body, c.extra...)
		if first.status != c.status || outsideCode(first) != c.code {
			t.Errorf("%s %s: %d %s; want %d %s", c.path, c.body, first.status, first.body, c.status, c.code)
			continue
		}
		if c.code == "insufficient_funds" && c.path == "/v1/transfers" {
			s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", eur), token, "", `{"amount":5000}`, "Content-Type", "application/json")
		}
		again := s.call("POST", c.path, token, key, c.body, c.extra...)
		if again.status != first.status || again.body != first.body || again.header.Get("Idempotent-Replayed") != "true" {
			t.Errorf("%s %s: the repeat got %d %q (replayed %q); want the stored %d %q", c.path, c.body,
				again.status, again.body, again.header.Get("Idempotent-Replayed"), first.status, first.body)
		}
	}
}

// TestOutsideGetRoutes: docs/ledger.md: a deposit of another account is 404 deposit_not_found;
// the Location of a creation is where a GET finds it, a replay carries the same Location; every
// route that takes GET takes HEAD with the same status and headers, no body.
func TestOutsideGetRoutes(t *testing.T) {
	t.Parallel()
	s := startServer(t, map[string]string{"PAYOUT_PROVIDER_DELAY": "0"})
	_, token := s.principal("gets")
	a, b := reviewAccount(t, s, token, "EUR"), reviewAccount(t, s, token, "EUR")
	dep := s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", a), token, "gd", `{"amount":100}`, "Content-Type", "application/json")
	depAgain := s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", a), token, "gd", `{"amount":100}`, "Content-Type", "application/json")
	tr := s.call("POST", "/v1/transfers", token, "gt", fmt.Sprintf(`{"from":%d,"to":%d,"amount":10}`, a, b), "Content-Type", "application/json")
	po := s.call("POST", "/v1/payouts", token, "gp", fmt.Sprintf(`{"account":%d,"amount":1}`, a), "Content-Type", "application/json")
	for _, r := range []resp{dep, tr, po} {
		if r.status != 201 || r.header.Get("Location") == "" {
			t.Fatalf("creation: %+v", r)
		}
	}
	if depAgain.header.Get("Location") != dep.header.Get("Location") {
		t.Errorf("replayed deposit Location %q, first %q", depAgain.header.Get("Location"), dep.header.Get("Location"))
	}
	depID := int(dep.json(t)["id"].(float64))
	if r := s.call("GET", fmt.Sprintf("/v1/accounts/%d/deposits/%d", b, depID), token, "", ""); r.status != 404 || outsideCode(r) != "deposit_not_found" {
		t.Errorf("a deposit through another account of the principal: %d %s; want 404 deposit_not_found", r.status, r.body)
	}
	pk, _ := po.json(t)["provider_key"].(string)
	paths := []string{dep.header.Get("Location"), tr.header.Get("Location"), po.header.Get("Location"),
		fmt.Sprintf("/v1/accounts/%d", a), "/v1/provider/calls/" + pk, "/healthz", "/version", "/openapi.json"}
	for _, p := range paths {
		g := s.call("GET", p, token, "", "")
		if g.status != 200 {
			t.Errorf("GET %s: %d %s", p, g.status, g.body)
			continue
		}
		h := s.call("HEAD", p, token, "", "")
		if h.status != g.status || h.body != "" {
			t.Errorf("HEAD %s: %d %q; want %d and no body", p, h.status, h.body, g.status)
		}
		for _, name := range []string{"Content-Type", "ETag", "Cache-Control"} {
			if h.header.Get(name) != g.header.Get(name) {
				t.Errorf("HEAD %s: %s %q, GET's %q", p, name, h.header.Get(name), g.header.Get(name))
			}
		}
	}
	calls := s.call("GET", "/v1/provider/calls/"+pk, token, "", "").json(t)
	if calls["calls"] != float64(1) || calls["repeats"] != float64(0) {
		t.Errorf("provider calls of one payout: %v; want calls 1, repeats 0", calls)
	}
	if !strings.HasPrefix(fmt.Sprint(calls["provider_ref"]), "po_") {
		t.Errorf("provider_ref %v", calls["provider_ref"])
	}
}

// TestOutsideReplayedProblemKeepsNosniff: docs/http.md "Problems": "Every error this package
// writes is application/problem+json (RFC 9457) with X-Content-Type-Options: nosniff"; a stored
// final error is replayed "byte for byte" with its Content-Type. The replay of a stored problem
// (and the 409s the package writes for a withheld body) keep both headers.
func TestOutsideReplayedProblemKeepsNosniff(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	_, token := s.principal("nosniff")
	for i, c := range []struct{ path, body string }{
		{"/v1/accounts/999999/deposits", `{"amount":1}`},
		{"/v1/accounts", `{"name":"x","currency":"eur"}`},
		{"/v1/api-tokens", `{"name":"t"}`},
	} {
		key := fmt.Sprintf("ns-%d", i)
		first := s.call("POST", c.path, token, key, c.body, "Content-Type", "application/json")
		again := s.call("POST", c.path, token, key, c.body, "Content-Type", "application/json")
		if again.header.Get("Idempotent-Replayed") != "true" {
			t.Errorf("%s: not a replay: %+v", c.path, again)
			continue
		}
		for _, r := range []resp{first, again} {
			if r.status < 400 {
				continue
			}
			if r.header.Get("Content-Type") != "application/problem+json" || r.header.Get("X-Content-Type-Options") != "nosniff" {
				t.Errorf("%s %d (replayed %q): Content-Type %q, X-Content-Type-Options %q; want application/problem+json and nosniff",
					c.path, r.status, r.header.Get("Idempotent-Replayed"), r.header.Get("Content-Type"), r.header.Get("X-Content-Type-Options"))
			}
		}
	}
}

// TestOutsideNotModifiedCarriesETag: docs/ledger.md: GET /v1/accounts/{id} answers "304 for a
// matching If-None-Match ... as RFC 9110 says"; RFC 9110 15.4.5: a 304 carries the ETag the 200
// would have, and no body; HEAD answers the same status and headers.
func TestOutsideNotModifiedCarriesETag(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	_, token := s.principal("etag")
	a := reviewAccount(t, s, token, "EUR")
	path := fmt.Sprintf("/v1/accounts/%d", a)
	g := s.call("GET", path, token, "", "")
	etag := g.header.Get("ETag")
	if g.status != 200 || etag == "" {
		t.Fatalf("GET: %+v", g)
	}
	weak := "W/" + strings.TrimPrefix(etag, "W/")
	for _, m := range []string{"GET", "HEAD"} {
		for _, inm := range []string{etag, "*", `"nope", ` + weak} {
			r := s.call(m, path, token, "", "", "If-None-Match", inm)
			if r.status != 304 || r.body != "" || r.header.Get("ETag") != etag {
				t.Errorf("%s If-None-Match %s: %d ETag %q body %q; want 304, ETag %s, no body", m, inm, r.status, r.header.Get("ETag"), r.body, etag)
			}
		}
		if r := s.call(m, path, token, "", "", "If-None-Match", `"nope"`); r.status != 200 {
			t.Errorf("%s If-None-Match \"nope\": %d", m, r.status)
		}
	}
}

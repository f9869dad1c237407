package main

// The reference server's promises from outside (docs/http.md, docs/operations.md), started as
// the real program and driven over HTTP.

import (
	"fmt"
	"testing"
	"time"
)

// TestOutsideLeaseAnswerLivesTheTTLAfterIt: every TTL counts from the answer, whatever path
// claimed the key (D200); docs/http.md "How long a key lives": "Once the answer
// is stored, the key lives the TTL after the answer, as above, not the rest of the lease"; "After
// that, a repeat runs again as a new request, and another request under the key is no longer
// refused". With IDEMPOTENCY_TTL=1s and PAYOUTS_LEASE=10s, a payout answered at once: 1.5 s
// later another payout under the key is a new request (201), on both lease routes, and so is
// the same body again (a new generation: another provider key).
func TestOutsideLeaseAnswerLivesTheTTLAfterIt(t *testing.T) {
	t.Parallel()
	s := startServer(t, map[string]string{"IDEMPOTENCY_TTL": "1s", "PAYOUTS_LEASE": "10s", "PAYOUT_PROVIDER_DELAY": "0"})
	_, token := s.principal("o3-lease-ttl")
	id := int(s.call("POST", "/v1/accounts", token, "", `{"name":"a","currency":"EUR"}`).json(t)["id"].(float64))
	if r := s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", id), token, "", `{"amount":1000}`); r.status != 201 {
		t.Fatalf("deposit: %d %s", r.status, r.body)
	}
	for _, route := range []string{"/v1/payouts", "/v1/stepped-payouts"} {
		key := "o3" + route
		first := s.call("POST", route, token, key, fmt.Sprintf(`{"account":%d,"amount":3}`, id))
		if first.status != 201 {
			t.Fatalf("%s: first %d %s", route, first.status, first.body)
		}
		if again := s.call("POST", route, token, key, fmt.Sprintf(`{"account":%d,"amount":3}`, id)); again.status != 201 ||
			again.header.Get("Idempotent-Replayed") != "true" {
			t.Fatalf("%s: replay within the TTL: %d %q", route, again.status, again.header.Get("Idempotent-Replayed"))
		}
		time.Sleep(1500 * time.Millisecond)
		other := s.call("POST", route, token, key, fmt.Sprintf(`{"account":%d,"amount":4}`, id))
		if other.status != 201 || other.header.Get("Idempotent-Replayed") != "" {
			t.Errorf("%s: another request under the key 1.5 s after the answer (TTL 1 s, lease 10 s): %d %s, want a new 201",
				route, other.status, other.body)
		}
	}
}

// TestOutsideRequiredKeyAnonymousIs401: a key counts on a route that declares idempotency, for
// a request that carries it and an authenticated principal; otherwise the header is ignored,
// and a route may require the key. docs/http.md: "A
// route declared with Required: true answers 400 idempotency_key_missing to an authenticated
// request without the key". An anonymous request to a route that requires the key, without a
// key or with a malformed one, is 401 unauthorized, not a key problem; nothing is stored.
func TestOutsideRequiredKeyAnonymousIs401(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	for _, route := range []string{"/v1/transfers", "/v1/payouts", "/v1/stepped-payouts"} {
		for _, key := range []string{"", `"a b"`} {
			r := s.call("POST", route, "", key, `{"from":1,"to":2,"amount":1}`)
			if r.status != 401 {
				t.Errorf("anonymous POST %s with key %q: %d %s, want 401", route, key, r.status, r.body)
				continue
			}
			ctProblem(t, r, 401, "unauthorized", ctLedgerDoc, "Authentication required")
		}
	}
	if n := s.count(`SELECT count(*) FROM idem.idempotency_keys`); n != 0 {
		t.Errorf("%d keys stored", n)
	}
}

// TestOutsideSfStringAndBareNameOneKey: the header value is taken as an RFC 8941 sf-string
// ("k1") and as a bare value (k1), both naming the same key (docs/http.md, "The key").
// An sf-string with escapes (`"a\"b\\c"`) names the key a"b\c, which a bare value sends as is:
// the second is a replay of the first, and a 255-character key fits in either form.
func TestOutsideSfStringAndBareNameOneKey(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	_, token := s.principal("o3-sf")
	body := `{"name":"a","currency":"EUR"}`
	long := ""
	for len(long) < 255 {
		long += "k"
	}
	for _, c := range []struct{ sf, bare string }{
		{`"a\"b\\c"`, `a"b\c`},
		{`"` + long + `"`, long},
	} {
		first := s.call("POST", "/v1/accounts", token, c.sf, body)
		if first.status != 201 {
			t.Fatalf("sf-string %q: %d %s", c.sf[:min(len(c.sf), 12)], first.status, first.body)
		}
		again := s.call("POST", "/v1/accounts", token, c.bare, body)
		if again.status != 201 || again.header.Get("Idempotent-Replayed") != "true" || again.body != first.body {
			t.Errorf("bare %q after sf-string %q: %d replayed=%q, want the replay", c.bare[:min(len(c.bare), 12)],
				c.sf[:min(len(c.sf), 12)], again.status, again.header.Get("Idempotent-Replayed"))
		}
	}
}

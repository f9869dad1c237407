package main

// A review (helper session; secrets and sensitive data, no broken promise found): what the reference server's log and metrics hold,
// and what one principal can learn of another's keys and accounts.

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/pgidem/pgidem/internal/pgtest"
)

func secretsJSON(t *testing.T, r resp) map[string]any {
	t.Helper()
	var v map[string]any
	if err := json.Unmarshal([]byte(r.body), &v); err != nil {
		t.Fatalf("not JSON: %d %q", r.status, r.body)
	}
	return v
}

// TestSecretsServerLogAndMetricsHoldNoSecret: docs/operations.md, "Logs": "Keys, tokens and
// bodies are never logged" (a request line, and a keyed request's line with its key_hash); a
// metric's action label is the route's. The server, at LOG_LEVEL=debug, is fed good and bad
// requests (a wrong bearer token, a mismatch, a malformed body, an invalid key, a one-time
// secret and its repeat, another principal's account, a payout and its provider lookup): no
// bearer token, created API token, idempotency key, cookie or request body value may be in the
// log, and no key, token or principal id in /metrics.
func TestSecretsServerLogAndMetricsHoldNoSecret(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	var log bytes.Buffer
	srv := serveWith(t, s.db, s.db, map[string]string{"LOG_LEVEL": "debug", "PAYOUT_PROVIDER_DELAY": "0"}, &log)
	aliceID, alice := srv.principal("zz-alice")
	bobID, bob := srv.principal("zz-bob")
	cookie := []string{"Cookie", "sid=ZZSRVCOOKIE"}
	var keys []string
	call := func(method, path, token, key, body string) resp {
		if key != "" {
			keys = append(keys, key)
		}
		return srv.call(method, path, token, key, body, cookie...)
	}
	answers := map[string]int{}
	answers["bad token"] = call("POST", "/v1/accounts", "idem_ZZBADTOKEN", "zzk-badtoken", `{"name":"ZZBODY1","currency":"EUR"}`).status
	acc := call("POST", "/v1/accounts", alice, "zzk-acc", `{"name":"ZZBODY2","currency":"EUR"}`)
	answers["account"] = acc.status
	id := secretsJSON(t, acc)["id"]
	answers["mismatch"] = call("POST", "/v1/accounts", alice, "zzk-acc", `{"name":"ZZBODY3","currency":"EUR"}`).status
	answers["malformed"] = call("POST", "/v1/accounts", alice, "zzk-malformed", `{"name":"ZZBODY4",}`).status
	answers["invalid key"] = call("POST", "/v1/accounts", alice, "zzk invalid", `{"name":"ZZBODY5","currency":"EUR"}`).status
	tok := call("POST", "/v1/api-tokens", alice, "zzk-token", `{"name":"ZZBODY6"}`)
	answers["token"] = tok.status
	created, _ := secretsJSON(t, tok)["token"].(string)
	answers["token repeat"] = call("POST", "/v1/api-tokens", alice, "zzk-token", `{"name":"ZZBODY6"}`).status
	answers["bob deposits to alice"] = call("POST", fmt.Sprintf("/v1/accounts/%v/deposits", id), bob, "zzk-dep", `{"amount":77}`).status
	answers["deposit"] = call("POST", fmt.Sprintf("/v1/accounts/%v/deposits", id), alice, "zzk-dep2", `{"amount":500}`).status
	po := call("POST", "/v1/payouts", alice, "zzk-payout", fmt.Sprintf(`{"account":%v,"amount":5}`, id))
	answers["payout"] = po.status
	pk, _ := secretsJSON(t, po)["provider_key"].(string)
	answers["provider lookup"] = call("GET", "/v1/provider/calls/"+pk, alice, "", "").status
	metrics := call("GET", "/metrics", "", "", "")
	t.Logf("answers: %v", answers)
	if err := srv.shutdown(); err != nil {
		t.Fatal(err)
	}
	if answers["mismatch"] != 422 || answers["token repeat"] != 409 || created == "" || pk == "" {
		t.Fatalf("the requests did not go as planned: %v", answers)
	}
	out := log.String()
	if !strings.Contains(out, "key_hash") {
		t.Fatalf("no keyed request's line in the log; the test shows nothing:\n%s", out)
	}
	secrets := append([]string{alice, bob, created, "ZZBADTOKEN", "ZZSRVCOOKIE", "ZZBODY", pk}, keys...)
	for _, sec := range secrets {
		if strings.Contains(out, sec) {
			t.Errorf("the server's log holds %q", sec)
		}
	}
	for _, sec := range append(secrets, aliceID, bobID) {
		if strings.Contains(metrics.body, sec) {
			t.Errorf("/metrics holds %q", sec)
		}
	}
}

// TestSecretsLedgerPrincipalsLearnNothingOfEachOther: docs/ledger.md: "a principal sees only
// its own accounts (another principal's account is 404)", "A principal is told of its own
// payouts' keys only: another principal's key reads as a key never used"; docs/sql-api.md:
// another principal's use of the same key is another request. Bob, under the keys Alice used,
// gets his own answers (not replays, not 422, not one_time_secret); Alice's account reads to
// Bob as an id that does not exist, in its answer and its timing (a row lock Alice's side
// holds on it does not hold Bob up); Alice's provider key reads to Bob as unused.
func TestSecretsLedgerPrincipalsLearnNothingOfEachOther(t *testing.T) {
	t.Parallel()
	s := startServer(t, map[string]string{"PAYOUT_PROVIDER_DELAY": "0"})
	_, alice := s.principal("zz-alice")
	_, bob := s.principal("zz-bob")

	a1 := s.call("POST", "/v1/accounts", alice, "zz-shared", `{"name":"main","currency":"USD"}`)
	b1 := s.call("POST", "/v1/accounts", bob, "zz-shared", `{"name":"main","currency":"USD"}`)
	if a1.status != 201 || b1.status != 201 || b1.header.Get("Idempotent-Replayed") != "" ||
		secretsJSON(t, a1)["id"] == secretsJSON(t, b1)["id"] {
		t.Fatalf("one key, two principals: alice %d %s; bob %d %v %s", a1.status, a1.body, b1.status, b1.header, b1.body)
	}
	b2 := s.call("POST", "/v1/accounts", bob, "zz-shared2", `{"name":"eur","currency":"EUR"}`)
	aliceAcc, bobAcc, bobEUR := secretsJSON(t, a1)["id"], secretsJSON(t, b1)["id"], secretsJSON(t, b2)["id"]
	if b3 := s.call("POST", "/v1/accounts", bob, "zz-shared", `{"name":"other","currency":"USD"}`); b3.status != 422 {
		t.Errorf("bob's own mismatch: %d %s", b3.status, b3.body)
	}
	at := s.call("POST", "/v1/api-tokens", alice, "zz-tok", `{"name":"ci"}`)
	bt := s.call("POST", "/v1/api-tokens", bob, "zz-tok", `{"name":"ci"}`)
	if at.status != 201 || bt.status != 201 || secretsJSON(t, at)["token"] == secretsJSON(t, bt)["token"] {
		t.Errorf("one-time secrets under one key, two principals: %d %s / %d %s", at.status, at.body, bt.status, bt.body)
	}

	// Alice's account next to an id nobody has, as Bob sees them, while a transaction of
	// Alice's side holds her account's row.
	holder := pgtest.Connect(t, s.db)
	pgtest.Exec(t, holder, `BEGIN`)
	pgtest.Exec(t, holder, `SELECT * FROM ledger.accounts WHERE id = $1 FOR UPDATE`, aliceAcc)
	defer func() { _, _ = holder.Exec(context.Background(), `ROLLBACK`) }()
	const missing = 987654321
	type probe struct{ name, method, path, key, body string }
	for _, p := range []probe{
		{"get", "GET", "/v1/accounts/%v", "", ""},
		{"deposit", "POST", "/v1/accounts/%v/deposits", "zz-dep-%v", `{"amount":5}`},
		{"transfer to", "POST", "/v1/transfers", "zz-tr-%v", `{"from":` + fmt.Sprint(bobEUR) + `,"to":%v,"amount":1}`},
		{"transfer from", "POST", "/v1/transfers", "zz-trf-%v", `{"from":%v,"to":` + fmt.Sprint(bobAcc) + `,"amount":1}`},
		{"payout", "POST", "/v1/payouts", "zz-po-%v", `{"account":%v,"amount":1}`},
	} {
		var got [2]resp
		var took [2]time.Duration
		for i, target := range []any{aliceAcc, missing} {
			path := p.path
			if strings.Contains(path, "%v") {
				path = fmt.Sprintf(path, target)
			}
			key := p.key
			if key != "" {
				key = fmt.Sprintf(key, i)
			}
			body := p.body
			if strings.Contains(body, "%v") {
				body = fmt.Sprintf(body, target)
			}
			start := time.Now()
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			status, header, b := pgtest.Send(t, ctx, p.method, s.url+path, body,
				"Authorization", "Bearer "+bob, "Idempotency-Key", key, "Content-Type", "application/json")
			cancel()
			got[i], took[i] = resp{status, header, b}, time.Since(start)
		}
		code := func(r resp) string { c, _ := secretsJSON(t, r)["code"].(string); return c }
		if got[0].status != got[1].status || code(got[0]) != code(got[1]) || got[0].status != 404 {
			t.Errorf("%s: alice's account reads to bob as %d %s, an id nobody has as %d %s", p.name,
				got[0].status, got[0].body, got[1].status, got[1].body)
		}
		if took[0] > time.Second {
			t.Errorf("%s: bob's request on alice's (row-locked) account took %s, on a missing id %s", p.name, took[0], took[1])
		}
	}
	pgtest.Exec(t, holder, `ROLLBACK`)

	// Payouts under one key: two provider keys; each sees only its own at the provider.
	dep := s.call("POST", fmt.Sprintf("/v1/accounts/%v/deposits", aliceAcc), alice, "zz-dep-a", `{"amount":100}`)
	if dep.status != 201 {
		t.Fatalf("deposit: %d %s", dep.status, dep.body)
	}
	pa := s.call("POST", "/v1/payouts", alice, "zz-po", fmt.Sprintf(`{"account":%v,"amount":5}`, aliceAcc))
	pb := s.call("POST", "/v1/payouts", bob, "zz-po", fmt.Sprintf(`{"account":%v,"amount":5}`, bobAcc))
	if pa.status != 201 || pb.status != 201 || pb.header.Get("Idempotent-Replayed") != "" {
		t.Fatalf("payouts: %d %s / %d %s", pa.status, pa.body, pb.status, pb.body)
	}
	ka, kb := secretsJSON(t, pa)["provider_key"].(string), secretsJSON(t, pb)["provider_key"].(string)
	if ka == kb {
		t.Errorf("one provider key for two principals: %s", ka)
	}
	seen := secretsJSON(t, s.call("GET", "/v1/provider/calls/"+ka, bob, "", ""))
	if seen["calls"] != float64(0) || seen["provider_ref"] != "" {
		t.Errorf("bob's look at alice's provider key: %v", seen)
	}
	if own := secretsJSON(t, s.call("GET", "/v1/provider/calls/"+ka, alice, "", "")); own["calls"] != float64(1) {
		t.Errorf("alice's look at her own provider key: %v", own)
	}
}

package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/pgidem/pgidem/internal/pgtest"
)

// ctRaw sends one request with exact header lines (name, value pairs; an empty value IS sent),
// so that an empty Idempotency-Key line can be tested. Chunked when chunked is true.
func ctRaw(t *testing.T, s *testServer, method, path, token, body string, chunked bool, headers ...string) resp {
	t.Helper()
	var rd io.Reader = strings.NewReader(body)
	if chunked {
		rd = io.MultiReader(strings.NewReader(body)) // unknown length: sent chunked
	}
	req, err := http.NewRequestWithContext(context.Background(), method, s.url+path, rd)
	if err != nil {
		t.Fatal(err)
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header[headers[i]] = append(req.Header[headers[i]], headers[i+1])
	}
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	b, _ := io.ReadAll(res.Body)
	return resp{res.StatusCode, res.Header, string(b)}
}

func ctKeys(s *testServer, principal string) int {
	return s.count(`SELECT count(*) FROM idem.idempotency_keys WHERE principal_id = $1`, principal)
}

// ctProblem checks the RFC 9457 shape docs/http.md "Problems" promises.
func ctProblem(t *testing.T, r resp, status int, code, base, title string) map[string]any {
	t.Helper()
	if r.status != status {
		t.Fatalf("status %d, want %d (%s): %s", r.status, status, code, r.body)
	}
	if ct := r.header.Get("Content-Type"); ct != "application/problem+json" {
		t.Errorf("%s: Content-Type %q, want application/problem+json", code, ct)
	}
	if r.header.Get("X-Content-Type-Options") != "nosniff" {
		t.Errorf("%s: no X-Content-Type-Options: nosniff", code)
	}
	p := r.json(t)
	if p["code"] != code {
		t.Fatalf("code %v, want %s: %s", p["code"], code, r.body)
	}
	if p["type"] != base+code {
		t.Errorf("%s: type %v, want %s", code, p["type"], base+code)
	}
	if title != "" && p["title"] != title {
		t.Errorf("%s: title %v, want %q", code, p["title"], title)
	}
	if st, _ := p["status"].(float64); int(st) != status {
		t.Errorf("%s: status member %v, want %d", code, p["status"], status)
	}
	if d, _ := p["detail"].(string); d == "" {
		t.Errorf("%s: no detail", code)
	}
	return p
}

const ctHTTPDoc = "https://github.com/pgidem/pgidem/blob/main/docs/http.md#"
const ctLedgerDoc = "https://github.com/pgidem/pgidem/blob/main/docs/ledger.md#"

// TestContractKeyForms: docs/http.md "The key": `"k1"` and `k1` name the same key; after unquoting
// 1 to 255 visible ASCII; empty, over 255, non-ASCII, two lines: 400 idempotency_key_invalid,
// nothing stored, nothing run (also on a route where the key is optional).
func TestContractKeyForms(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	pid, token := s.principal("keys")
	accounts := func() int {
		return s.count(`SELECT count(*) FROM ledger.accounts WHERE principal_id = $1`, pid)
	}
	body := `{"name":"a","currency":"EUR"}`
	long := strings.Repeat("x", 256)
	for _, c := range []struct {
		name   string
		values []string
	}{
		{"an empty header line", []string{""}},
		{"an empty sf-string", []string{`""`}},
		{"256 bytes", []string{long}},
		{"256 bytes quoted", []string{`"` + long + `"`}},
		{"non-ASCII", []string{"cl\u00e9"}},
		{"non-ASCII quoted", []string{"\"cl\u00e9\""}},
		{"a space inside quotes", []string{`"a b"`}},
		{"an unterminated sf-string", []string{`"k1`}},
		{"a bad escape", []string{`"a\nb"`}},
		{"two header lines", []string{"k1", "k2"}},
		{"two equal header lines", []string{"k1", "k1"}},
	} {
		var h []string
		for _, v := range c.values {
			h = append(h, "Idempotency-Key", v)
		}
		h = append(h, "Content-Type", "application/json", "X-Request-Id", ""+strings.ReplaceAll(c.name, " ", "-"))
		r := ctRaw(t, s, "POST", "/v1/accounts", token, body, false, h...)
		if r.status != 400 {
			t.Errorf("%s: %d %s, want 400 idempotency_key_invalid", c.name, r.status, r.body)
			continue
		}
		p := ctProblem(t, r, 400, "idempotency_key_invalid", ctHTTPDoc, "Idempotency-Key malformed")
		if p["header"] != "Idempotency-Key" {
			t.Errorf("%s: header member %v", c.name, p["header"])
		}
		if p["correlation_id"] != ""+strings.ReplaceAll(c.name, " ", "-") {
			t.Errorf("%s: correlation_id %v", c.name, p["correlation_id"])
		}
	}
	if n := accounts(); n != 0 {
		t.Fatalf("%d accounts created by requests with a malformed key, want 0", n)
	}
	if n := ctKeys(s, pid); n != 0 {
		t.Fatalf("%d keys stored for malformed keys, want 0", n)
	}

	// "k1" and k1 name the same key, in either order; an escaped sf-string too.
	max := strings.Repeat("y", 255)
	for _, pair := range [][2]string{{`"k1"`, `k1`}, {`k2`, `"k2"`}, {`"a\"b\\c"`, `a"b\c`}, {`"` + max + `"`, max}, {" \tk3\t ", "k3"}} {
		first := ctRaw(t, s, "POST", "/v1/accounts", token, body, false, "Idempotency-Key", pair[0], "Content-Type", "application/json")
		again := ctRaw(t, s, "POST", "/v1/accounts", token, body, false, "Idempotency-Key", pair[1], "Content-Type", "application/json")
		if first.status != 201 || again.status != 201 || again.header.Get("Idempotent-Replayed") != "true" || again.body != first.body {
			t.Errorf("%s then %s: %d %q / %d replayed=%q %q", pair[0], pair[1], first.status, first.body, again.status,
				again.header.Get("Idempotent-Replayed"), again.body)
		}
	}
	if n := accounts(); n != 5 {
		t.Fatalf("%d accounts, want 5 (one per key)", n)
	}
}

// TestContractKeyMissing: a route that requires the key answers 400 idempotency_key_missing, runs
// nothing, stores nothing; the problem names the header and links the docs.
func TestContractKeyMissing(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	pid, token := s.principal("missing")
	a := int(s.call("POST", "/v1/accounts", token, "", `{"name":"a","currency":"EUR"}`).json(t)["id"].(float64))
	b := int(s.call("POST", "/v1/accounts", token, "", `{"name":"b","currency":"EUR"}`).json(t)["id"].(float64))
	s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", a), token, "", `{"amount":10}`)
	r := s.call("POST", "/v1/transfers", token, "", fmt.Sprintf(`{"from":%d,"to":%d,"amount":1}`, a, b), "X-Request-Id", "miss")
	p := ctProblem(t, r, 400, "idempotency_key_missing", ctHTTPDoc, "Idempotency-Key required")
	if p["header"] != "Idempotency-Key" || p["correlation_id"] != "miss" {
		t.Errorf("problem %v", p)
	}
	if n := s.count(`SELECT count(*) FROM ledger.transfers WHERE principal_id = $1`, pid); n != 0 {
		t.Fatalf("%d transfers without a key", n)
	}
	if n := ctKeys(s, pid); n != 0 {
		t.Fatalf("%d keys", n)
	}
	// The payouts too.
	r = s.call("POST", "/v1/payouts", token, "", fmt.Sprintf(`{"account":%d,"amount":1}`, a))
	ctProblem(t, r, 400, "idempotency_key_missing", ctHTTPDoc, "Idempotency-Key required")
}

// TestContractBodyTooLarge: a body over MAX_BODY_BYTES is 413 request_too_large before any
// fingerprint or database work: nothing stored, the key is free for the fixed request, and
// a stored key is not answered (no replay, no 422) for an oversized body.
func TestContractBodyTooLarge(t *testing.T) {
	t.Parallel()
	s := startServer(t, map[string]string{"MAX_BODY_BYTES": "64"})
	pid, token := s.principal("413")
	big := `{"name":"` + strings.Repeat("n", 60) + `","currency":"EUR"}`
	for _, chunked := range []bool{false, true} {
		key := fmt.Sprintf("413-%v", chunked)
		r := ctRaw(t, s, "POST", "/v1/accounts", token, big, chunked, "Idempotency-Key", key, "Content-Type", "application/json", "X-Request-Id", "big")
		p := ctProblem(t, r, 413, "request_too_large", ctHTTPDoc, "Request body too large")
		if p["correlation_id"] != "big" {
			t.Errorf("correlation_id %v", p["correlation_id"])
		}
		if n := s.count(`SELECT count(*) FROM idem.idempotency_keys WHERE principal_id = $1 AND key = $2`, pid, key); n != 0 {
			t.Fatalf("chunked=%v: %d keys after a 413, want 0", chunked, n)
		}
		ok := ctRaw(t, s, "POST", "/v1/accounts", token, `{"name":"a","currency":"EUR"}`, chunked, "Idempotency-Key", key, "Content-Type", "application/json")
		if ok.status != 201 || ok.header.Get("Idempotent-Replayed") != "" {
			t.Fatalf("chunked=%v: the fixed request under the same key: %d %s", chunked, ok.status, ok.body)
		}
		// The key is stored now: an oversized body with it is still 413, not a replay or 422.
		again := ctRaw(t, s, "POST", "/v1/accounts", token, big, chunked, "Idempotency-Key", key, "Content-Type", "application/json")
		ctProblem(t, again, 413, "request_too_large", ctHTTPDoc, "")
	}
	// Exactly at the limit is taken.
	at := `{"name":"` + strings.Repeat("m", 64-len(`{"name":"","currency":"EUR"}`)) + `","currency":"EUR"}`
	if len(at) != 64 {
		t.Fatalf("len %d", len(at))
	}
	if r := s.call("POST", "/v1/accounts", token, "at", at, "Content-Type", "application/json"); r.status != 201 {
		t.Fatalf("a body of exactly MAX_BODY_BYTES: %d %s", r.status, r.body)
	}
	// Without a key, 413 too (the route is declared: the middleware reads the body).
	r := s.call("POST", "/v1/accounts", token, "", big, "Content-Type", "application/json")
	if r.status != 413 {
		t.Fatalf("an oversized body without a key: %d %s", r.status, r.body)
	}
}

// TestContractCorrelation: docs/http.md: "correlation_id is the request's X-Request-Id ...; a
// replayed stored problem keeps the first request's"; the replay carries the current request's
// correlation id (X-Request-Id header).
func TestContractCorrelation(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	_, token := s.principal("corr")
	body := `{"name":"a","currency":"EUR"}`
	first := s.call("POST", "/v1/accounts", token, "c1", body, "X-Request-Id", "r-1")
	again := s.call("POST", "/v1/accounts", token, "c1", body, "X-Request-Id", "r-2")
	if first.status != 201 || again.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("%+v / %+v", first, again)
	}
	if got := again.header.Values("X-Request-Id"); len(got) != 1 || got[0] != "r-2" {
		t.Errorf("replay's X-Request-Id %v, want [r-2]", got)
	}
	// No X-Request-Id on the repeat: a fresh one, not the first request's.
	third := s.call("POST", "/v1/accounts", token, "c1", body)
	if got := third.header.Values("X-Request-Id"); len(got) != 1 || got[0] == "r-1" || got[0] == "" {
		t.Errorf("replay without X-Request-Id: header %v", got)
	}

	// A stored problem keeps its own correlation id in its body; the header is the repeat's.
	p1 := s.call("POST", "/v1/accounts/999999/deposits", token, "c2", `{"amount":1}`, "X-Request-Id", "r-3")
	p2 := s.call("POST", "/v1/accounts/999999/deposits", token, "c2", `{"amount":1}`, "X-Request-Id", "r-4")
	ctProblem(t, p1, 404, "account_not_found", ctLedgerDoc, "Account not found")
	ctProblem(t, p2, 404, "account_not_found", ctLedgerDoc, "Account not found")
	if p2.header.Get("Idempotent-Replayed") != "true" || p2.body != p1.body {
		t.Fatalf("not replayed byte for byte: %q / %q", p1.body, p2.body)
	}
	if p1.json(t)["correlation_id"] != "r-3" || p2.json(t)["correlation_id"] != "r-3" {
		t.Errorf("stored problem's correlation_id: %q / %q", p1.body, p2.body)
	}
	if got := p2.header.Values("X-Request-Id"); len(got) != 1 || got[0] != "r-4" {
		t.Errorf("replayed problem's X-Request-Id %v, want [r-4]", got)
	}
	// A fresh problem (reuse) carries the current id.
	reuse := s.call("POST", "/v1/accounts/999999/deposits", token, "c2", `{"amount":2}`, "X-Request-Id", "r-5")
	rp := ctProblem(t, reuse, 422, "idempotency_key_reuse", ctHTTPDoc, "Idempotency key reused for another request")
	if rp["correlation_id"] != "r-5" || reuse.header.Get("X-Request-Id") != "r-5" {
		t.Errorf("reuse: %v %v", rp["correlation_id"], reuse.header.Get("X-Request-Id"))
	}
	if cf, ok := rp["changed_fields"].([]any); !ok || len(cf) != 1 || cf[0] != "amount" {
		t.Errorf("changed_fields %v, want [amount]", rp["changed_fields"])
	}
	if strings.Contains(reuse.body, `"2"`) || strings.Contains(reuse.body, ":2") {
		t.Errorf("the reuse problem shows a value: %s", reuse.body)
	}
}

// TestContractNoRawKeysOrBodiesInLogs: "Keys and bodies are never logged raw" (docs/http.md,
// Options.Logger), at debug level, over every kind of answer the server gives.
func TestContractNoRawKeysOrBodiesInLogs(t *testing.T) {
	t.Parallel()
	base := startServer(t, nil)
	s, log := serveLogged(t, base.db, base.db, map[string]string{"LOG_LEVEL": "debug", "MAX_BODY_BYTES": "256", "IDEMPOTENCY_DUPLICATE_WAIT": "200ms"})
	_, token := s.principal("logs")
	const secretKey = "SECRETKEYzz1"
	const secretName = "SECRETNAMEzz2"
	a := s.call("POST", "/v1/accounts", token, secretKey+"a", `{"name":"`+secretName+`","currency":"EUR"}`)
	if a.status != 201 {
		t.Fatalf("%+v", a)
	}
	id := int(a.json(t)["id"].(float64))
	s.call("POST", "/v1/accounts", token, secretKey+"a", `{"name":"`+secretName+`","currency":"EUR"}`)                               // replay
	s.call("POST", "/v1/accounts", token, secretKey+"a", `{"name":"`+secretName+`X","currency":"EUR"}`)                              // reuse
	s.call("POST", "/v1/accounts", token, secretKey+" b", `{"name":"`+secretName+`","currency":"EUR"}`)                              // invalid key
	s.call("POST", "/v1/accounts", token, secretKey+"c", `{"name":"`+strings.Repeat(secretName, 30)+`","currency":"EUR"}`)           // 413
	s.call("POST", "/v1/accounts", token, secretKey+"d", `{"name":"`+secretName+`","currency":"EUR","`+secretName+`":1}`)            // malformed (unknown member)
	s.call("POST", "/v1/accounts", token, secretKey+"e", `{"name":"`+secretName+`","Name":"x","currency":"EUR"}`)                    // ambiguous
	s.call("POST", "/v1/accounts", token, secretKey+"f", `{"name":"`+secretName+`","currency":"EURO"}`)                              // 422
	s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", id+1000), token, secretKey+"g", `{"amount":1}`)                           // 404
	s.call("POST", "/v1/accounts", token, secretKey+"h", `{"name":"`+secretName+`","currency":"EUR"}`, "Content-Type", "text/plain") // 415
	tok := s.call("POST", "/v1/api-tokens", token, secretKey+"i", `{"name":"`+secretName+`"}`)
	s.call("POST", "/v1/api-tokens", token, secretKey+"i", `{"name":"`+secretName+`"}`) // one_time_secret
	s.call("POST", "/v1/transfers", token, secretKey+"j", fmt.Sprintf(`{"from":%d,"to":%d,"amount":5}`, id, id+1000))
	s.call("POST", "/v1/accounts", "bogus-"+secretName, secretKey+"k", `{}`) // 401
	s.call("POST", "/v1/accounts", token, `"`+secretKey+`l"`, `{"name":"`+secretName+`","currency":"EUR"}`)

	// A duplicate that waits and gets 409 while the first is held on a row lock.
	ctx := context.Background()
	holder, err := s.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := holder.Exec(ctx, `SELECT 1 FROM ledger.accounts WHERE id = $1 FOR UPDATE`, id); err != nil {
		t.Fatal(err)
	}
	done := make(chan resp, 1)
	go func() {
		done <- s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", id), token, secretKey+"m", `{"amount":77}`)
	}()
	for i := 0; i < 500 && s.count(`SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()`) == 0; i++ {
		time.Sleep(10 * time.Millisecond)
	}
	dup := s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", id), token, secretKey+"m", `{"amount":77}`)
	_ = holder.Rollback(ctx)
	<-done
	if dup.status != 409 {
		t.Logf("duplicate: %d %s", dup.status, dup.body)
	}
	time.Sleep(100 * time.Millisecond)
	out := log.String()
	if !strings.Contains(out, `"request"`) && !strings.Contains(out, "request_id") {
		t.Fatalf("the log holds no request lines; the capture is broken:\n%s", out)
	}
	newToken := ""
	if tok.status == 201 {
		newToken, _ = tok.json(t)["token"].(string)
	}
	for _, secret := range []string{secretKey, secretName, token, newToken, "bogus-"} {
		if secret == "" {
			continue
		}
		for _, line := range strings.Split(out, "\n") {
			if strings.Contains(line, secret) {
				t.Errorf("the log holds %q raw: %s", secret, line)
				break
			}
		}
	}
}

// TestContractOneTimeSecretToken: POST /v1/api-tokens: 201 {"id","token"}, the token works, a repeat
// is 409 one_time_secret with resource_id and Idempotent-Replayed, and the body is not stored
// (status only); a new key gives a new token.
func TestContractOneTimeSecretToken(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	pid, token := s.principal("tok")
	first := s.call("POST", "/v1/api-tokens", token, "t1", `{"name":"ci"}`)
	if first.status != 201 {
		t.Fatalf("%+v", first)
	}
	v := first.json(t)
	newTok, _ := v["token"].(string)
	id, _ := v["id"].(float64)
	if newTok == "" || id == 0 || len(v) != 2 {
		t.Fatalf("body %s, want exactly {id, token}", first.body)
	}
	if r := s.call("GET", "/v1/accounts/1", newTok, "", ""); r.status != 404 {
		t.Fatalf("the new token does not authenticate: %d %s", r.status, r.body)
	}
	again := s.call("POST", "/v1/api-tokens", token, "t1", `{"name":"ci"}`, "X-Request-Id", "r-ots")
	p := ctProblem(t, again, 409, "one_time_secret", ctHTTPDoc, "The response was a one-time secret")
	if p["resource_id"] != fmt.Sprint(int64(id)) || again.header.Get("Idempotent-Replayed") != "true" {
		t.Errorf("repeat: %s replayed=%q", again.body, again.header.Get("Idempotent-Replayed"))
	}
	if strings.Contains(again.body, newTok) {
		t.Fatal("the repeat shows the token")
	}
	if n := s.count(`SELECT count(*) FROM idem.idempotency_keys WHERE principal_id = $1 AND key = 't1'
		AND position(convert_to($2, 'UTF8') in coalesce(response_body, ''::bytea)) > 0`, pid, newTok); n != 0 {
		t.Fatal("the token is stored in the key row")
	}
	if n := s.count(`SELECT count(*) FROM ledger.api_tokens WHERE principal_id = $1`, pid); n != 2 {
		t.Fatalf("%d tokens, want 2 (initial + one)", n)
	}
	other := s.call("POST", "/v1/api-tokens", token, "t2", `{"name":"ci"}`)
	if other.status != 201 || other.json(t)["token"] == newTok {
		t.Fatalf("a new key: %+v", other)
	}
	// A stored final error of the route: 422 replayed.
	e1 := s.call("POST", "/v1/api-tokens", token, "t3", `{"name":""}`)
	e2 := s.call("POST", "/v1/api-tokens", token, "t3", `{"name":""}`)
	if e1.status != 422 || e2.status != 422 || e2.header.Get("Idempotent-Replayed") != "true" || e1.body != e2.body {
		t.Fatalf("422 not stored: %+v / %+v", e1, e2)
	}
}

// TestContractDeletedPrincipalMidRequest: docs/ledger.md: "A deleted principal's keys go with it,
// and a claim for an unknown principal fails with 23503 on the key table, which the middleware
// answers 401 principal_unknown." A principal deleted after its token was checked and before
// its claim: 401 principal_unknown (problem shape), nothing stored, no account. The claim meets
// the uncommitted DELETE's lock on the principal's row: if the DELETE commits within the claim's
// probes, the claim learns the principal is gone (401); if not, the table is busy for all the
// claim can tell (503 store_unavailable, nothing changed: a loaded machine), and the client's
// retry, with the principal gone, gets 401.
func TestContractDeletedPrincipalMidRequest(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	pid, token := s.principal("gone")
	ctx := context.Background()
	del, err := s.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = del.Rollback(ctx) }()
	if _, err := del.Exec(ctx, `DELETE FROM ledger.principals WHERE id = $1`, pid); err != nil {
		t.Fatal(err)
	}
	done := make(chan resp, 1)
	go func() {
		done <- s.call("POST", "/v1/accounts", token, "gone-1", `{"name":"a","currency":"EUR"}`, "X-Request-Id", "r-gone")
	}()
	// Commit as soon as the claim is seen waiting on the lock, or once the request was answered
	// (its probes may all have ended before a look saw one).
	var r resp
	answered := false
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
		select {
		case r = <-done:
			answered = true
		default:
		}
		if answered || s.count(`SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
			AND wait_event_type = 'Lock' AND query LIKE '%idem_begin%'`) > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the request neither waited on the principal's row nor was answered in 10 s")
		}
	}
	if err := del.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if !answered {
		r = <-done
	}
	if r.status == http.StatusServiceUnavailable {
		ctProblem(t, r, 503, "store_unavailable", ctHTTPDoc, "Idempotency store unavailable")
		// The retry, with the principal gone: its token no longer authenticates (401).
		if r = s.call("POST", "/v1/accounts", token, "gone-1", `{"name":"a","currency":"EUR"}`, "X-Request-Id", "r-gone"); r.status != 401 {
			t.Fatalf("the retry after the principal was deleted: %d %s, want 401", r.status, r.body)
		}
	} else {
		p := ctProblem(t, r, 401, "principal_unknown", ctHTTPDoc, "Unknown principal")
		if p["correlation_id"] != "r-gone" {
			t.Errorf("correlation_id %v", p["correlation_id"])
		}
	}
	if n := ctKeys(s, pid); n != 0 {
		t.Fatalf("%d keys of a deleted principal", n)
	}
	if n := s.count(`SELECT count(*) FROM ledger.accounts WHERE principal_id = $1`, pid); n != 0 {
		t.Fatalf("%d accounts of a deleted principal", n)
	}
}

// TestContractInProgressRetryAfter: a duplicate of a transactional request still running waits up to
// IDEMPOTENCY_DUPLICATE_WAIT, then 409 request_in_progress with Retry-After (seconds >= 1),
// problem+json; a retry after the first committed replays it.
func TestContractInProgressRetryAfter(t *testing.T) {
	t.Parallel()
	s := startServer(t, map[string]string{"IDEMPOTENCY_DUPLICATE_WAIT": "300ms"})
	_, token := s.principal("409")
	id := int(s.call("POST", "/v1/accounts", token, "", `{"name":"a","currency":"EUR"}`).json(t)["id"].(float64))
	ctx := context.Background()
	holder, err := s.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = holder.Rollback(ctx) }()
	if _, err := holder.Exec(ctx, `SELECT 1 FROM ledger.accounts WHERE id = $1 FOR UPDATE`, id); err != nil {
		t.Fatal(err)
	}
	path := fmt.Sprintf("/v1/accounts/%d/deposits", id)
	first := make(chan resp, 1)
	go func() { first <- s.call("POST", path, token, "409-k", `{"amount":5}`) }()
	pgtest.WaitFor(t, s.pool, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE '%UPDATE ledger.accounts%'`)
	began := time.Now()
	dup := s.call("POST", path, token, "409-k", `{"amount":5}`, "X-Request-Id", "r-dup")
	waited := time.Since(began)
	p := ctProblem(t, dup, 409, "request_in_progress", ctHTTPDoc, "A request with this idempotency key is in progress")
	if p["correlation_id"] != "r-dup" {
		t.Errorf("correlation_id %v", p["correlation_id"])
	}
	ra := dup.header.Get("Retry-After")
	var secs int
	if _, err := fmt.Sscanf(ra, "%d", &secs); err != nil || secs < 1 || fmt.Sprint(secs) != ra {
		t.Errorf("Retry-After %q, want a positive number of seconds", ra)
	}
	if waited < 250*time.Millisecond {
		t.Errorf("the duplicate answered after %v, before IDEMPOTENCY_DUPLICATE_WAIT (300ms)", waited)
	}
	_ = holder.Rollback(ctx)
	f := <-first
	if f.status != 201 {
		t.Fatalf("first: %+v", f)
	}
	again := s.call("POST", path, token, "409-k", `{"amount":5}`)
	if again.status != 201 || again.body != f.body || again.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("retry after the first: %+v", again)
	}
	if n := s.count(`SELECT balance FROM ledger.accounts WHERE id = $1`, id); n != 5 {
		t.Fatalf("balance %d, want 5", n)
	}
}

// TestContractDuplicateAnsweredWithinHalfASecond: "a duplicate has the answer within half a second
// of it being stored" (docs/http.md), on a lease route (payouts) with the duplicate on another
// process of the same service, and on a transactional route (deposits).
func TestContractDuplicateAnsweredWithinHalfASecond(t *testing.T) {
	t.Parallel()
	env := map[string]string{"PAYOUT_PROVIDER_DELAY": "1500ms", "PAYOUTS_LEASE": "10s"}
	a := startServer(t, env)
	b := serveOn(t, a.db, env)
	_, token := a.principal("half")
	id := int(a.call("POST", "/v1/accounts", token, "", `{"name":"a","currency":"EUR"}`).json(t)["id"].(float64))
	a.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", id), token, "", `{"amount":100}`)
	for _, dupOn := range []*testServer{a, b} {
		key := fmt.Sprintf("half-%p", dupOn)
		body := fmt.Sprintf(`{"account":%d,"amount":3}`, id)
		type timed struct {
			r  resp
			at time.Time
		}
		first := make(chan timed, 1)
		go func() {
			r := a.call("POST", "/v1/payouts", token, key, body)
			first <- timed{r, time.Now()}
		}()
		time.Sleep(300 * time.Millisecond)
		d := dupOn.call("POST", "/v1/payouts", token, key, body)
		dAt := time.Now()
		f := <-first
		if f.r.status != 201 || d.status != 201 || d.body != f.r.body {
			t.Fatalf("dup on %s: first %d %s, duplicate %d %s", dupOn.url, f.r.status, f.r.body, d.status, d.body)
		}
		if lag := dAt.Sub(f.at); lag > 500*time.Millisecond {
			t.Errorf("dup on the %s process: answered %v after the first's answer, want <= 0.5 s",
				map[bool]string{true: "same", false: "other"}[dupOn == a], lag)
		}
	}
}

// TestContractHeaderIgnoredOutsideDeclaredRoutes: "Otherwise the header is ignored": a GET route
// (undeclared) and the routes outside /v1 take any Idempotency-Key, even a malformed one; an
// unauthenticated keyed request is 401 (not stored), a wrong method 405.
func TestContractHeaderIgnoredOutsideDeclaredRoutes(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	pid, token := s.principal("ignored")
	id := int(s.call("POST", "/v1/accounts", token, "", `{"name":"a","currency":"EUR"}`).json(t)["id"].(float64))
	for _, key := range []string{`"a b"`, "k1", strings.Repeat("z", 300)} {
		if r := s.call("GET", fmt.Sprintf("/v1/accounts/%d", id), token, key, ""); r.status != 200 {
			t.Errorf("GET account with key %q: %d %s", key[:min(len(key), 10)], r.status, r.body)
		}
		if r := s.call("GET", "/healthz", "", key, ""); r.status != 200 {
			t.Errorf("GET /healthz with key: %d %s", r.status, r.body)
		}
		r := s.call("POST", "/v1/accounts", "", key, `{"name":"a","currency":"EUR"}`, "X-Request-Id", "r-401")
		p := ctProblem(t, r, 401, "unauthorized", ctLedgerDoc, "Authentication required")
		if p["correlation_id"] != "r-401" || r.header.Get("WWW-Authenticate") == "" {
			t.Errorf("401: %v %v", p, r.header)
		}
		r = s.call("DELETE", "/v1/accounts", token, key, "")
		ctProblem(t, r, 405, "method_not_allowed", ctLedgerDoc, "Method not allowed")
		if r.header.Get("Allow") != "POST" {
			t.Errorf("Allow %q", r.header.Get("Allow"))
		}
	}
	if n := ctKeys(s, pid); n != 0 {
		t.Fatalf("%d keys stored", n)
	}
}

// TestContractOversizedSuccess: "response larger than the storage limit: sent once; stored without
// the body; a repeat gets 409 response_not_replayable with the resource id" (resource_id: what
// SetResourceID named, else the top-level id of the first response's body, else Location).
func TestContractOversizedSuccess(t *testing.T) {
	t.Parallel()
	s := startServer(t, map[string]string{"MAX_STORED_RESPONSE_BYTES": "16"})
	pid, token := s.principal("big")
	first := s.call("POST", "/v1/accounts", token, "big-a", `{"name":"a","currency":"EUR"}`)
	if first.status != 201 {
		t.Fatalf("%+v", first)
	}
	id := int64(first.json(t)["id"].(float64))
	again := s.call("POST", "/v1/accounts", token, "big-a", `{"name":"a","currency":"EUR"}`, "X-Request-Id", "r-big")
	p := ctProblem(t, again, 409, "response_not_replayable", ctHTTPDoc, "The response cannot be replayed")
	if p["resource_id"] != fmt.Sprint(id) || again.header.Get("Idempotent-Replayed") != "true" || p["correlation_id"] != "r-big" {
		t.Errorf("account repeat: %s %v", again.body, again.header)
	}
	dep := s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", id), token, "big-d", `{"amount":4}`)
	if dep.status != 201 {
		t.Fatalf("%+v", dep)
	}
	depID := int64(dep.json(t)["id"].(float64))
	again = s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", id), token, "big-d", `{"amount":4}`)
	p = ctProblem(t, again, 409, "response_not_replayable", ctHTTPDoc, "")
	if p["resource_id"] != fmt.Sprint(depID) {
		t.Errorf("deposit repeat: resource_id %v, want %d", p["resource_id"], depID)
	}
	if n := s.count(`SELECT count(*) FROM idem.idempotency_keys WHERE principal_id = $1 AND response_body IS NOT NULL`, pid); n != 0 {
		t.Errorf("%d oversized bodies stored", n)
	}
	if n := s.count(`SELECT balance FROM ledger.accounts WHERE id = $1`, id); n != 4 {
		t.Fatalf("balance %d, want 4 (one deposit)", n)
	}
}

// TestContractDeadlockRetried: "deadlock or serialization failure: the unit of work is retried
// (bounded), with a fresh body reader and response buffer": a transfer chosen as a deadlock's
// victim runs again and answers 201, once.
func TestContractDeadlockRetried(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	pid, token := s.principal("dead")
	acct := func(n string) int64 {
		return int64(s.call("POST", "/v1/accounts", token, "", `{"name":"`+n+`","currency":"EUR"}`).json(t)["id"].(float64))
	}
	a, b := acct("a"), acct("b")
	s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", a), token, "", `{"amount":100}`)
	r := transferInADeadlock(t, s, token, "dead-1", a, b)
	if r.status != 201 {
		t.Fatalf("the transfer after a deadlock: %d %s, want 201 (the unit of work retried)", r.status, r.body)
	}
	again := s.call("POST", "/v1/transfers", token, "dead-1", fmt.Sprintf(`{"from":%d,"to":%d,"amount":7}`, a, b))
	if again.status != 201 || again.body != r.body {
		t.Fatalf("replay: %+v", again)
	}
	if n := s.count(`SELECT count(*) FROM ledger.transfers WHERE principal_id = $1`, pid); n != 1 {
		t.Fatalf("%d transfers, want 1", n)
	}
	if x, y := s.count(`SELECT balance FROM ledger.accounts WHERE id = $1`, a), s.count(`SELECT balance FROM ledger.accounts WHERE id = $1`, b); x != 93 || y != 7 {
		t.Fatalf("balances %d/%d, want 93/7", x, y)
	}
}

// transferInADeadlock sends a keyed transfer of 7 from account a to b (with headers) and makes it
// a deadlock's victim: a transaction of the test holds b, the transfer holds a and waits for b,
// and the test's transaction then waits for a (with a deadlock_timeout longer than the
// server's, so that the transfer's backend finds the cycle). It returns the transfer's answer.
func transferInADeadlock(t *testing.T, s *testServer, token, key string, a, b int64, headers ...string) resp {
	t.Helper()
	ctx := context.Background()
	ext, err := s.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = ext.Rollback(ctx) }()
	if _, err := ext.Exec(ctx, `SET LOCAL deadlock_timeout = '2s'`); err != nil {
		t.Fatal(err)
	}
	if _, err := ext.Exec(ctx, `SELECT 1 FROM ledger.accounts WHERE id = $1 FOR UPDATE`, b); err != nil {
		t.Fatal(err)
	}
	done := make(chan resp, 1)
	go func() {
		done <- s.call("POST", "/v1/transfers", token, key, fmt.Sprintf(`{"from":%d,"to":%d,"amount":7}`, a, b), headers...)
	}()
	pgtest.WaitFor(t, s.pool, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE '%FOR NO KEY UPDATE%'`)
	// Now close the cycle: the transfer holds a and waits for b; this waits for a.
	if _, err := ext.Exec(ctx, `SELECT 1 FROM ledger.accounts WHERE id = $1 FOR UPDATE`, a); err != nil {
		t.Fatalf("the test's transaction was the deadlock's victim: %v", err)
	}
	_ = ext.Rollback(ctx)
	return <-done
}

// TestContractReuse: "repeat, other method, path or body: 422 idempotency_key_reuse, naming changed
// top-level fields (added and removed ones too), never their values"; "[] when only the action
// changed"; "a body first sent as text/plain, refused 415 by its handler, and then sent as
// application/json under the same key is another request (422)".
func TestContractReuse(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	pid, token := s.principal("reuse")
	a := int(s.call("POST", "/v1/accounts", token, "r-acct", `{"name":"secretvalue","currency":"EUR"}`).json(t)["id"].(float64))
	b := int(s.call("POST", "/v1/accounts", token, "", `{"name":"b","currency":"EUR"}`).json(t)["id"].(float64))
	changed := func(r resp) []string {
		t.Helper()
		p := ctProblem(t, r, 422, "idempotency_key_reuse", ctHTTPDoc, "Idempotency key reused for another request")
		raw, ok := p["changed_fields"].([]any)
		if !ok {
			t.Fatalf("no changed_fields: %s", r.body)
		}
		var out []string
		for _, f := range raw {
			out = append(out, f.(string))
		}
		return out
	}
	// Another route (another body too): 422, never values.
	r := s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", a), token, "r-acct", `{"amount":1}`)
	changed(r)
	if strings.Contains(r.body, "secretvalue") || strings.Contains(r.body, "EUR") {
		t.Errorf("values in the problem: %s", r.body)
	}
	// Same route, a member's value changed: names it.
	r = s.call("POST", "/v1/accounts", token, "r-acct", `{"name":"secretvalue","currency":"USD"}`)
	if got := strings.Join(changed(r), ","); got != "currency" {
		t.Errorf("a changed member: %q", got)
	}
	// Same route, a removed member and an added one.
	r = s.call("POST", "/v1/accounts", token, "r-acct", `{"name":"secretvalue","cur":"EUR"}`)
	if got := strings.Join(changed(r), ","); got != "cur,currency" {
		t.Errorf("a renamed member: %q", got)
	}
	// Same route, another path, same body: [].
	if f := s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", a), token, "r-dep", `{"amount":1}`); f.status != 201 {
		t.Fatalf("%+v", f)
	}
	r = s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", b), token, "r-dep", `{"amount":1}`)
	if got := changed(r); len(got) != 0 {
		t.Errorf("another path of the route: changed_fields %v, want []", got)
	}
	// The query is not part of the fingerprint.
	r = s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits?x=1", a), token, "r-dep", `{"amount":1}`)
	if r.status != 201 || r.header.Get("Idempotent-Replayed") != "true" {
		t.Errorf("a query string: %d %s", r.status, r.body)
	}
	// Added member.
	r = s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", a), token, "r-dep", `{"amount":1,"memo":"x"}`)
	if got := strings.Join(changed(r), ","); got != "memo" {
		t.Errorf("an added member: %q", got)
	}
	// text/plain refused 415 and stored; then JSON under the same key: 422.
	r1 := s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", a), token, "r-415", `{"amount":2}`, "Content-Type", "text/plain")
	ctProblem(t, r1, 415, "unsupported_media_type", ctHTTPDoc, "Unsupported media type")
	r2 := s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", a), token, "r-415", `{"amount":2}`, "Content-Type", "text/plain")
	if r2.status != 415 || r2.header.Get("Idempotent-Replayed") != "true" || r2.body != r1.body {
		t.Errorf("415 not replayed: %+v", r2)
	}
	r3 := s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", a), token, "r-415", `{"amount":2}`, "Content-Type", "application/json")
	if r3.status != 422 {
		t.Errorf("JSON after a stored text/plain 415: %d %s, want 422 idempotency_key_reuse", r3.status, r3.body)
	}
	if n := s.count(`SELECT balance FROM ledger.accounts WHERE id = $1`, a); n != 1 {
		t.Fatalf("balance %d, want 1", n)
	}
	_ = pid
}

// TestContractReuseAnotherRouteNamesNoFields: docs/http.md, idempotency_key_reuse:
// changed_fields "is [] whenever the action changed (another method or route: the body is then
// not compared, whatever it holds)". The doc had promised the body's members named too.
func TestContractReuseAnotherRouteNamesNoFields(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	_, token := s.principal("reuse2")
	a := int(s.call("POST", "/v1/accounts", token, "r2", `{"name":"a","currency":"EUR"}`).json(t)["id"].(float64))
	r := s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", a), token, "r2", `{"amount":1}`)
	p := ctProblem(t, r, 422, "idempotency_key_reuse", ctHTTPDoc, "")
	raw, ok := p["changed_fields"].([]any)
	if !ok || len(raw) != 0 {
		t.Fatalf("changed_fields for another route with another body: %v, want []: %s", p["changed_fields"], r.body)
	}
}

// TestContractClientGoneWorkCommits: "the client of a keyed request goes away (disconnect, its
// attempt timeout): the work runs to its end under a server-side deadline and commits with its
// answer; the client's retry waits for it or replays it".
func TestContractClientGoneWorkCommits(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	_, token := s.principal("gone-client")
	id := int(s.call("POST", "/v1/accounts", token, "", `{"name":"a","currency":"EUR"}`).json(t)["id"].(float64))
	path := fmt.Sprintf("/v1/accounts/%d/deposits", id)
	ctx := context.Background()
	holder, err := s.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = holder.Rollback(ctx) }()
	if _, err := holder.Exec(ctx, `SELECT 1 FROM ledger.accounts WHERE id = $1 FOR UPDATE`, id); err != nil {
		t.Fatal(err)
	}
	short, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	st, _, _ := pgtest.Send(t, short, "POST", s.url+path, `{"amount":9}`, "Authorization", "Bearer "+token, "Idempotency-Key", "gone-k")
	if st != -1 {
		t.Fatalf("the short attempt got an answer (%d) while the row was held", st)
	}
	// The retry, while the work still waits, waits for it.
	retry := make(chan resp, 1)
	go func() { retry <- s.call("POST", path, token, "gone-k", `{"amount":9}`) }()
	time.Sleep(300 * time.Millisecond)
	_ = holder.Rollback(ctx)
	r := <-retry
	if r.status != 201 || r.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("the retry: %d replayed=%q %s, want the first attempt's 201 replayed", r.status, r.header.Get("Idempotent-Replayed"), r.body)
	}
	if n := s.count(`SELECT balance FROM ledger.accounts WHERE id = $1`, id); n != 9 {
		t.Fatalf("balance %d, want 9", n)
	}
	if n := s.count(`SELECT count(*) FROM ledger.deposits WHERE account_id = $1`, id); n != 1 {
		t.Fatalf("%d deposits, want 1", n)
	}
}

// TestContractRequestIDBounds: docs/operations.md "Logs": request_id is "the client's X-Request-Id
// when it is 1 to 64 visible ASCII characters, else a new one, echoed in the response"; the
// problem's correlation_id is the same id.
func TestContractRequestIDBounds(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	_, token := s.principal("rid")
	for _, c := range []struct {
		sent string
		kept bool
	}{{strings.Repeat("a", 64), true}, {strings.Repeat("a", 65), false}, {"a b", false}, {"r-\u00e9", false}, {"~!", true}} {
		r := s.call("POST", "/v1/accounts/999999/deposits", token, "", `{"amount":1}`, "X-Request-Id", c.sent)
		got := r.header.Get("X-Request-Id")
		if (got == c.sent) != c.kept || got == "" || !validRequestID(got) {
			t.Errorf("sent %q: echoed %q, kept=%v", c.sent, got, c.kept)
		}
		if p := r.json(t); p["correlation_id"] != got {
			t.Errorf("sent %q: correlation_id %v, header %q", c.sent, p["correlation_id"], got)
		}
	}
}

// TestTwoAuthorizationHeadersAreRefused: a request with two Authorization fields acted as the
// principal of the first (a black-box review: bob's token first, alice's second, acted as bob),
// where a proxy in front may have checked the other. Neither counts: 401, nothing done.
func TestTwoAuthorizationHeadersAreRefused(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	_, alice := s.principal("alice")
	_, bob := s.principal("bob")
	r := s.call("POST", "/v1/accounts", "", "two-auth", `{"name":"x","currency":"EUR"}`,
		"Authorization", "Bearer "+bob, "Authorization", "Bearer "+alice, "Content-Type", "application/json")
	if r.status != http.StatusUnauthorized {
		t.Fatalf("two Authorization fields: %d %s; want 401", r.status, r.body)
	}
	if n := s.count(`SELECT count(*) FROM ledger.accounts`); n != 0 {
		t.Fatalf("%d accounts created by a request with two Authorization fields", n)
	}
	if r := s.call("POST", "/v1/accounts", alice, "one-auth", `{"name":"x","currency":"EUR"}`, "Content-Type", "application/json"); r.status != http.StatusCreated {
		t.Fatalf("one Authorization field: %d %s; want 201", r.status, r.body)
	}
}

// TestAnAccountHasOnePath: an account's id written with a sign, a leading zero or an escaped
// digit named the account (a black-box review: /v1/accounts/+2, /002 and /%32 deposited to
// account 2), while the fingerprint hashes the path as sent, so a retry through a proxy that
// rewrites it was another request under its key (422). Such a path names no account: 404,
// nothing done.
func TestAnAccountHasOnePath(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	_, tok := s.principal("paths")
	a := s.call("POST", "/v1/accounts", tok, "", `{"name":"x","currency":"EUR"}`, "Content-Type", "application/json")
	if a.status != http.StatusCreated {
		t.Fatalf("%+v", a)
	}
	id := int(a.json(t)["id"].(float64))
	if id > 9 {
		t.Fatalf("account id %d: the test escapes a one-digit id", id)
	}
	for i, p := range []string{fmt.Sprintf("+%d", id), fmt.Sprintf("0%d", id), fmt.Sprintf("%%3%d", id)} {
		if r := s.call("GET", "/v1/accounts/"+p, tok, "", ""); r.status != http.StatusNotFound || !strings.Contains(r.body, `"account_not_found"`) {
			t.Errorf("GET /v1/accounts/%s: %d %s; want 404 account_not_found", p, r.status, r.body)
		}
		r := s.call("POST", "/v1/accounts/"+p+"/deposits", tok, fmt.Sprintf("path-%d", i), `{"amount":5}`, "Content-Type", "application/json")
		if r.status != http.StatusNotFound || !strings.Contains(r.body, `"account_not_found"`) {
			t.Errorf("POST /v1/accounts/%s/deposits: %d %s; want 404 account_not_found", p, r.status, r.body)
		}
	}
	if n := s.count(`SELECT count(*) FROM ledger.deposits`); n != 0 {
		t.Fatalf("%d deposits through paths that name no account", n)
	}
	if r := s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", id), tok, "path-plain", `{"amount":5}`, "Content-Type", "application/json"); r.status != http.StatusCreated {
		t.Fatalf("the account's own path: %d %s", r.status, r.body)
	}
}

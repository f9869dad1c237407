package main

// An adversarial review of the reference ledger API (docs/ledger.md). The first tests are its
// findings, fixed in D162; those marked "checked, correct" pin behaviour that was probed and
// found to hold.

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pgidem/pgidem/internal/pgtest"
)

// reviewAccount creates an account of the principal and returns its id.
func reviewAccount(t *testing.T, s *testServer, token, currency string) int {
	t.Helper()
	r := s.call("POST", "/v1/accounts", token, "", `{"name":"zz","currency":"`+currency+`"}`)
	if r.status != 201 {
		t.Fatalf("create account: %+v", r)
	}
	return int(r.json(t)["id"].(float64))
}

func reviewDeposit(t *testing.T, s *testServer, token string, id int, amount int64) {
	t.Helper()
	if r := s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", id), token, "", fmt.Sprintf(`{"amount":%d}`, amount)); r.status != 201 {
		t.Fatalf("deposit: %+v", r)
	}
}

// reviewState is an account's balance and version, read from the database.
func reviewState(t *testing.T, s *testServer, id int) (balance int64, version int64) {
	t.Helper()
	if err := s.pool.QueryRow(context.Background(), `SELECT balance, `+accountVersion+` FROM ledger.accounts WHERE id = $1`, id).
		Scan(&balance, &version); err != nil {
		t.Fatal(err)
	}
	return balance, version
}

// TestLedgerReviewDepositPastInt64IsBalanceLimit (D162):
// docs/ledger.md "### balance_limit": "422. The deposit or transfer would take a balance past
// 9223372036854775807 minor units." docs/http.md "Bad input": "a deposit that would take a
// balance past 2^63 - 1 | 422 balance_limit". A deposit of 9223372036854775808 (2^63) into an
// empty account takes the balance past that limit, but was answered 422 validation_failed
// ("amount must be a positive integer"), though 2^63 is a positive integer; so were 1e19 and
// every integer of 20 digits or more. An integer written with an exponent (1e+25, which is
// the canonical form of integers from 1e21) is one too. A transfer of such an amount is
// insufficient_funds, as no balance covers it; a fraction with a large exponent's mantissa
// (1.5e-3) is still no amount.
func TestLedgerReviewDepositPastInt64IsBalanceLimit(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	_, token := s.principal("zz")
	a := reviewAccount(t, s, token, "EUR")
	for _, amt := range []string{"9223372036854775808", "10000000000000000000", "1e25", "1.5e+30"} {
		r := s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", a), token, "big-"+amt, `{"amount":`+amt+`}`)
		if r.status != 422 || !strings.Contains(r.body, `"code":"balance_limit"`) {
			t.Errorf("deposit of %s into an empty account: %d %s; want 422 balance_limit (docs/ledger.md ### balance_limit)", amt, r.status, r.body)
		}
	}
	if r := s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", a), token, "", `{"amount":1.5e-3}`); r.status != 422 ||
		!strings.Contains(r.body, `"code":"validation_failed"`) {
		t.Errorf("deposit of 1.5e-3: %d %s; want 422 validation_failed", r.status, r.body)
	}
	if b, _ := reviewState(t, s, a); b != 0 {
		t.Fatalf("balance %d, want 0", b)
	}
	reviewDeposit(t, s, token, a, 10)
	to := reviewAccount(t, s, token, "EUR")
	for _, amt := range []string{"9223372036854775808", "1e25"} {
		r := s.call("POST", "/v1/transfers", token, "tr-"+amt, fmt.Sprintf(`{"from":%d,"to":%d,"amount":%s}`, a, to, amt))
		if r.status != 422 || !strings.Contains(r.body, `"code":"insufficient_funds"`) {
			t.Errorf("transfer of %s: %d %s; want 422 insufficient_funds", amt, r.status, r.body)
		}
	}
}

// TestLedgerReviewVersionOverflowIsNotBalanceLimit (D162): ledger.accounts.version was an
// integer that every deposit, transfer and stepped-payout reservation increments. After
// 2^31 - 1 changes (25 days of a hot account at 1,000 changes a second) "version + 1" raised
// 22003: a deposit was answered 422 balance_limit, a final answer stored under its key, for an
// account whose balance was tiny, and a transfer 500; the account could never change again.
// The version is a bigint revision now, which goes on past 2^31 - 1 (the integer column goes
// on beside it, wrapped). While the previous release still serves (it adds 1 to the integer
// column only), its changes move the version too, and no ETag is shown twice.
func TestLedgerReviewVersionOverflowIsNotBalanceLimit(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	_, token := s.principal("zz")
	a, b := reviewAccount(t, s, token, "EUR"), reviewAccount(t, s, token, "EUR")
	reviewDeposit(t, s, token, a, 100)
	// Stand in for 2^31 - 3 earlier changes, the last ones by the previous release.
	pgtest.Exec(t, s.pool, `UPDATE ledger.accounts SET version = 2147483645 WHERE id = $1`, a)
	etag := func() string {
		t.Helper()
		g := s.call("GET", fmt.Sprintf("/v1/accounts/%d", a), token, "", "")
		if g.status != 200 || g.header.Get("ETag") != fmt.Sprintf(`"%d"`, int64(g.json(t)["version"].(float64))) {
			t.Fatalf("GET: %+v", g)
		}
		return g.header.Get("ETag")
	}
	seen := map[string]bool{etag(): true}
	step := func(what string) {
		t.Helper()
		e := etag()
		if seen[e] {
			t.Fatalf("after %s: ETag %s shown before", what, e)
		}
		seen[e] = true
	}
	for i := range 3 {
		r := s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", a), token, fmt.Sprintf("after-many-%d", i), `{"amount":1}`)
		if r.status != 201 {
			t.Fatalf("deposit %d of 1 into an account of balance 100 after 2^31 - 3 changes: %d %s; want 201", i, r.status, r.body)
		}
		step("a deposit")
		tr := s.call("POST", "/v1/transfers", token, fmt.Sprintf("tr-after-many-%d", i), fmt.Sprintf(`{"from":%d,"to":%d,"amount":1}`, a, b))
		if tr.status != 201 {
			t.Fatalf("transfer %d of 1 from that account: %d %s; want 201", i, tr.status, tr.body)
		}
		step("a transfer")
		// The previous release's deposit, as 0.2.0 writes it.
		pgtest.Exec(t, s.pool, `UPDATE ledger.accounts SET balance = balance + 1, version = version + 1 WHERE id = $1`, a)
		step("a change by the previous release")
	}
	if bal, ver := reviewState(t, s, a); bal != 103 || ver != 2147483645+9 {
		t.Errorf("balance %d, version %d; want 103 and %d", bal, ver, 2147483645+9)
	}
	if n := pgtest.Count(t, s.pool, `SELECT count(*) FROM ledger.accounts WHERE version >= 2147483647`); n != 0 {
		t.Errorf("%d accounts whose integer version the previous release cannot add 1 to", n)
	}
}

// TestLedgerReviewIfNoneMatchListAndWeak (D162): docs/ledger.md: "GET /v1/accounts/{id} ... 200 with ETag (304 for a matching If-None-Match)".
// RFC 9110 13.1.2: If-None-Match is a list of entity tags compared with the *weak* comparison,
// or "*", which matches any current representation. getAccount compared the raw header with
// `"N"` byte for byte, so `W/"1"`, `"0", "1"` and `*` (all matching the current ETag "1") got a
// full 200: caches and clients that send several validators never got their 304.
func TestLedgerReviewIfNoneMatchListAndWeak(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	_, token := s.principal("zz")
	a := reviewAccount(t, s, token, "EUR")
	path := fmt.Sprintf("/v1/accounts/%d", a)
	if r := s.call("GET", path, token, "", "", "If-None-Match", `"1"`); r.status != 304 {
		t.Fatalf("exact If-None-Match: %d", r.status)
	}
	for _, inm := range []string{`W/"1"`, `"0", "1"`, `"0","1"`, `*`, ` "1" `} {
		if r := s.call("GET", path, token, "", "", "If-None-Match", inm); r.status != 304 {
			t.Errorf("If-None-Match: %s against ETag \"1\": %d, want 304 (RFC 9110 13.1.2, weak comparison over a list)", inm, r.status)
		}
	}
	for _, inm := range []string{`"2"`, `"11"`, `W/"2", "0"`, `1`} {
		if r := s.call("GET", path, token, "", "", "If-None-Match", inm); r.status != 200 {
			t.Errorf("If-None-Match: %s against ETag \"1\": %d, want 200", inm, r.status)
		}
	}
}

// TestLedgerReviewProviderCallsArePrincipalScoped (D162): every /v1 route needs a bearer token and "a principal sees only its own accounts"
// (docs/ledger.md), and GET /v1/payouts/{id} is scoped to the principal. GET
// /v1/provider/calls/{key} (payouts.go:100-108, provider.stats) is not: any authenticated
// principal who learnt another's provider_key (it is in the payout's 201 body, in client logs,
// in receipts' Idempotency-Key) read that payout's provider reference and call counts. Another
// principal sees nothing now (calls 0, as for a key never used), the owner its payout, also
// for a call recorded before ledger migration 008 (no principal in the provider's row).
func TestLedgerReviewProviderCallsArePrincipalScoped(t *testing.T) {
	t.Parallel()
	s := startServer(t, map[string]string{"PAYOUT_PROVIDER_DELAY": "0"})
	_, alice := s.principal("alice")
	_, mallory := s.principal("mallory")
	a := reviewAccount(t, s, alice, "EUR")
	p := s.call("POST", "/v1/payouts", alice, "po-1", fmt.Sprintf(`{"account":%d,"amount":5}`, a))
	if p.status != 201 {
		t.Fatalf("payout: %+v", p)
	}
	key := p.json(t)["provider_key"].(string)
	r := s.call("GET", "/v1/provider/calls/"+key, mallory, "", "")
	if r.status != 200 || r.json(t)["provider_ref"] != "" || r.json(t)["calls"] != float64(0) {
		t.Errorf("mallory reads alice's payout through its provider key: %s; want nothing of alice's", r.body)
	}
	own := func(what string) {
		t.Helper()
		r := s.call("GET", "/v1/provider/calls/"+key, alice, "", "")
		if r.status != 200 || r.json(t)["provider_ref"] != p.json(t)["provider_ref"] || r.json(t)["calls"] != float64(1) {
			t.Errorf("alice reads her own payout's calls (%s): %s, want calls 1 and %v", what, r.body, p.json(t)["provider_ref"])
		}
	}
	own("recorded with her principal")
	pgtest.Exec(t, s.pool, `UPDATE provider.payouts SET principal_id = NULL WHERE idempotency_key = $1`, key)
	own("recorded before migration 008")
	if r := s.call("GET", "/v1/provider/calls/"+key, mallory, "", ""); r.json(t)["provider_ref"] != "" {
		t.Errorf("mallory reads alice's payout recorded before migration 008: %s", r.body)
	}
}

// TestLedgerReviewUncleanPathIsNotFound (D162): docs/ledger.md: "a path that is no route is 404 `not_found`", and every error is an RFC 9457
// problem ("## Problems"). gorilla/mux cleans paths by default, so POST //v1/accounts, POST
// /v1/./accounts and POST /v1/accounts/1%2F/deposits got a bodiless 301 to a different, real
// route instead. No money moved (Go's client and curl turn a redirected POST into a GET), but a
// client that keeps the method on 301 (curl --post301, some SDKs) landed on
// /v1/accounts/1/deposits: an account id the client never wrote ("1/" escaped).
func TestLedgerReviewUncleanPathIsNotFound(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	_, token := s.principal("zz")
	a := reviewAccount(t, s, token, "EUR")
	for i, path := range []string{"//v1/accounts", "/v1/./accounts", fmt.Sprintf("/v1/accounts/%d%%2F/deposits", a),
		fmt.Sprintf("/v1/accounts/%d%%2Fdeposits", a), fmt.Sprintf("/v1/accounts/%d%%2fdeposits", a)} {
		body := `{"name":"x","currency":"EUR"}`
		if strings.HasSuffix(path, "deposits") {
			body = `{"amount":5}`
		}
		r := s.call("POST", path, token, fmt.Sprintf("unclean-%d", i), body)
		if r.status != 404 || !strings.Contains(r.body, `"code":"not_found"`) {
			t.Errorf("POST %s: %d Location %q body %q, want 404 not_found", path, r.status, r.header.Get("Location"), r.body)
		}
		if r := s.call("GET", path, token, "", ""); r.status != 404 || !strings.Contains(r.body, `"code":"not_found"`) {
			t.Errorf("GET %s: %d body %q, want 404 not_found", path, r.status, r.body)
		}
	}
	// An escaped slash beside a byte that is no valid escape, sent as written (Go's client
	// would escape the path afresh, the %2F a slash): net/http's EscapedPath drops what the
	// client wrote then, and a check of it let these reach the deposits route.
	for i, raw := range []string{"/v1/accounts/{%2Fdeposits", "/v1/accounts/\u00e9%2Fdeposits", fmt.Sprintf("/v1/accounts/%d|%%2Fdeposits", a)} {
		for _, method := range []string{"POST", "GET"} {
			req, err := http.NewRequest(method, s.url, strings.NewReader(`{"amount":5}`))
			if err != nil {
				t.Fatal(err)
			}
			req.URL.Opaque = raw // the request line as written
			req.Header.Set("Authorization", "Bearer "+token)
			req.Header.Set("Content-Type", "application/json")
			req.Header.Set("Idempotency-Key", fmt.Sprintf("unclean-raw-%d", i))
			res, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatalf("%s %s: %v", method, raw, err)
			}
			b, _ := io.ReadAll(res.Body)
			res.Body.Close()
			if res.StatusCode != 404 || !strings.Contains(string(b), `"code":"not_found"`) {
				t.Errorf("%s %s (as written): %d %s, want 404 not_found", method, raw, res.StatusCode, b)
			}
		}
	}
	// Nothing was claimed: an unclean path is refused before the middleware.
	if n := pgtest.Count(t, s.pool, `SELECT count(*) FROM idem.idempotency_keys WHERE key LIKE 'unclean-%'`); n != 0 {
		t.Errorf("%d keys stored for paths that are no route", n)
	}
}

// TestLedgerReviewHeadOnGetRoutes (D162): RFC 9110 9.1: "All general-purpose servers MUST support the methods GET and HEAD." HEAD
// /v1/accounts/{id} was 405 with "Allow: GET" (/healthz alone took HEAD). HEAD answers as GET
// would now, without a body (200 with the ETag).
func TestLedgerReviewHeadOnGetRoutes(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	_, token := s.principal("zz")
	a := reviewAccount(t, s, token, "EUR")
	r := s.call("HEAD", fmt.Sprintf("/v1/accounts/%d", a), token, "", "")
	if r.status != 200 || r.header.Get("ETag") != `"1"` || r.body != "" {
		t.Errorf("HEAD /v1/accounts/%d: %d Allow %q ETag %q body %q, want 200 with the ETag and no body", a, r.status,
			r.header.Get("Allow"), r.header.Get("ETag"), r.body)
	}
	for _, path := range []string{"/version", "/openapi.json", "/metrics"} {
		if r := s.call("HEAD", path, "", "", ""); r.status != 200 {
			t.Errorf("HEAD %s: %d, want 200", path, r.status)
		}
	}
	if r := s.call("HEAD", fmt.Sprintf("/v1/accounts/%d/deposits", a), token, "", ""); r.status != 405 {
		t.Errorf("HEAD on a POST route: %d, want 405", r.status)
	}
}

// TestLedgerReviewHugeExponentSameAnswerWithOrWithoutKey (D162): `{"amount":1e99999999999999999999}` is valid JSON (RFC 8259 puts no bound on an exponent).
// Without a key it is 422 validation_failed ("amount must be a positive integer", as
// docs/ledger.md ### validation_failed says of an amount that is not a positive integer). With a
// key the canonicalizer refuses the exponent (internal/canon/number.go:59, maxExponentDigits =
// 15) and the middleware answered 400 malformed_body "the body is not strictly valid JSON": the
// same request got two answers, depending on whether a key was sent. DecodeJSON refuses what
// the fingerprint does not canonicalize now, with a key or without, and the detail names the
// bounds.
func TestLedgerReviewHugeExponentSameAnswerWithOrWithoutKey(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	_, token := s.principal("zz")
	a := reviewAccount(t, s, token, "EUR")
	path := fmt.Sprintf("/v1/accounts/%d/deposits", a)
	body := `{"amount":1e99999999999999999999}`
	plain := s.call("POST", path, token, "", body)
	keyed := s.call("POST", path, token, "exp", body)
	if plain.status != 400 || plain.status != keyed.status || plain.json(t)["code"] != keyed.json(t)["code"] ||
		!strings.Contains(plain.body, "exponents of at most 16 digits") {
		t.Errorf("without a key: %d %v; with a key: %d %v %q; want one answer", plain.status, plain.json(t)["code"],
			keyed.status, keyed.json(t)["code"], keyed.json(t)["detail"])
	}
}

// ---------------------------------------------------------------------------------------
// checked, correct
// ---------------------------------------------------------------------------------------

// TestLedgerReviewReplayFidelity (checked, correct): docs/http.md "What happens": a repeat gets "the
// stored status, headers and body, byte for byte, plus Idempotent-Replayed: true"; stored
// headers include Location and ETag (ledger.md: the replayed creation's ETag is its version).
func TestLedgerReviewReplayFidelity(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	_, token := s.principal("zz")
	same := func(what string, first, again resp, headers ...string) {
		t.Helper()
		if again.status != first.status || again.body != first.body || again.header.Get("Idempotent-Replayed") != "true" {
			t.Errorf("%s replay: %+v, want %+v", what, again, first)
		}
		for _, h := range headers {
			if first.header.Get(h) == "" || again.header.Get(h) != first.header.Get(h) {
				t.Errorf("%s replay: %s %q, first %q", what, h, again.header.Get(h), first.header.Get(h))
			}
		}
	}
	body := `{"name":"main","currency":"EUR"}`
	c1 := s.call("POST", "/v1/accounts", token, "acc", body)
	a := int(c1.json(t)["id"].(float64))
	b := reviewAccount(t, s, token, "EUR")
	dep := fmt.Sprintf("/v1/accounts/%d/deposits", a)
	d1 := s.call("POST", dep, token, "dep", `{"amount":500}`)
	tb := fmt.Sprintf(`{"from":%d,"to":%d,"amount":200}`, a, b)
	t1 := s.call("POST", "/v1/transfers", token, "tr", tb)
	n1 := s.call("POST", "/v1/accounts/999999/deposits", token, "dep404", `{"amount":1}`)
	same("account", c1, s.call("POST", "/v1/accounts", token, "acc", body), "Location", "ETag", "Content-Type")
	same("deposit", d1, s.call("POST", dep, token, "dep", `{"amount":500}`), "Location", "Content-Type")
	same("transfer", t1, s.call("POST", "/v1/transfers", token, "tr", tb), "Location", "Content-Type")
	same("stored 404", n1, s.call("POST", "/v1/accounts/999999/deposits", token, "dep404", `{"amount":1}`), "Content-Type")
	if c1.header.Get("ETag") != `"1"` {
		t.Errorf("creation ETag %q", c1.header.Get("ETag"))
	}
	g := s.call("GET", c1.header.Get("Location"), token, "", "")
	if bal, ver := reviewState(t, s, a); bal != 300 || ver != 3 || g.header.Get("ETag") != `"3"` || g.json(t)["version"] != float64(3) {
		t.Errorf("after a deposit and a transfer: balance %d version %d, GET %+v", bal, ver, g)
	}
}

// TestLedgerReviewSameKeyConcurrently (checked, correct): Twelve copies of one deposit under one key,
// sent at once through two server processes on one database, make one deposit and all get
// the same 201; copies of one key with different amounts make one deposit and the others get
// 422 idempotency_key_reuse (docs/http.md "What happens").
func TestLedgerReviewSameKeyConcurrently(t *testing.T) {
	t.Parallel()
	env := map[string]string{"IDEMPOTENCY_LOCK_TIMEOUT": "5s"}
	s := startServer(t, env)
	s2 := serveOn(t, s.db, env)
	_, token := s.principal("zz")
	a := reviewAccount(t, s, token, "EUR")
	path := fmt.Sprintf("/v1/accounts/%d/deposits", a)
	run := func(n int, body func(i int) string, key string) []resp {
		out := make([]resp, n)
		var wg sync.WaitGroup
		for i := range n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				srv := s
				if i%2 == 1 {
					srv = s2
				}
				out[i] = srv.call("POST", path, token, key, body(i))
			}()
		}
		wg.Wait()
		return out
	}
	rs := run(12, func(int) string { return `{"amount":7}` }, "same")
	for _, r := range rs {
		if r.status != 201 || r.body != rs[0].body {
			t.Errorf("same key, same body: %+v, want every copy the one 201 %s", r, rs[0].body)
		}
	}
	rs = run(8, func(i int) string { return fmt.Sprintf(`{"amount":%d}`, 100+i) }, "diff")
	ok := 0
	for _, r := range rs {
		switch {
		case r.status == 201:
			ok++
		case r.status == 422 && strings.Contains(r.body, "idempotency_key_reuse"):
		default:
			t.Errorf("same key, other bodies: %+v", r)
		}
	}
	if ok != 1 {
		t.Errorf("%d copies with different bodies succeeded, want 1", ok)
	}
	if n := s.count(`SELECT count(*) FROM ledger.deposits WHERE account_id = $1`, a); n != 2 {
		t.Errorf("%d deposits, want 2 (one per key)", n)
	}
	bal, _ := reviewState(t, s, a)
	if sum := int64(s.count(`SELECT sum(amount) FROM ledger.deposits WHERE account_id = $1`, a)); bal != sum {
		t.Errorf("balance %d, deposits say %d", bal, sum)
	}
}

// TestLedgerReviewKeyScope (checked, correct): docs/http.md "How long a key lives": "A key belongs to
// its principal alone, not to a route ... Two principals may use one key independently."
// A key reused on another account's path, another route, or the same account written
// `+N`/`0N` is refused (422), never a second effect; another principal's use of the same key
// is its own request (no replay of, or 409 about, the first principal's answer).
func TestLedgerReviewKeyScope(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	_, alice := s.principal("alice")
	_, bob := s.principal("bob")
	a, a2 := reviewAccount(t, s, alice, "EUR"), reviewAccount(t, s, alice, "EUR")
	b := reviewAccount(t, s, bob, "EUR")
	if r := s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", a), alice, "k", `{"amount":10}`); r.status != 201 {
		t.Fatalf("%+v", r)
	}
	for _, c := range []struct{ path, body string }{
		{fmt.Sprintf("/v1/accounts/%d/deposits", a2), `{"amount":10}`},
		{fmt.Sprintf("/v1/accounts/+%d/deposits", a), `{"amount":10}`},
		{fmt.Sprintf("/v1/accounts/0%d/deposits", a), `{"amount":10}`},
		{"/v1/transfers", fmt.Sprintf(`{"from":%d,"to":%d,"amount":10}`, a, a2)},
	} {
		if r := s.call("POST", c.path, alice, "k", c.body); r.status != 422 || !strings.Contains(r.body, "idempotency_key_reuse") {
			t.Errorf("key k again on %s: %d %s, want 422 idempotency_key_reuse", c.path, r.status, r.body)
		}
	}
	r := s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", b), bob, "k", `{"amount":10}`)
	if r.status != 201 || r.header.Get("Idempotent-Replayed") != "" {
		t.Errorf("bob's own deposit under alice's key: %+v", r)
	}
	tok := s.call("POST", "/v1/api-tokens", alice, "t", `{"name":"x"}`)
	tok2 := s.call("POST", "/v1/api-tokens", bob, "t", `{"name":"x"}`)
	if tok.status != 201 || tok2.status != 201 || tok2.json(t)["token"] == tok.json(t)["token"] {
		t.Errorf("tokens of two principals under one key: %+v / %+v", tok, tok2)
	}
	if n := s.count(`SELECT count(*) FROM ledger.deposits`); n != 2 {
		t.Errorf("%d deposits, want 2", n)
	}
	if bal, _ := reviewState(t, s, a); bal != 10 {
		t.Errorf("alice's balance %d, want 10", bal)
	}
}

// TestLedgerReviewOneTimeSecretUnderConcurrency (checked, correct): docs/ledger.md: POST /v1/api-tokens
// is "a one-time secret: a repeat gets 409 one_time_secret". Six copies under one key, at once,
// through two processes: one token made, exactly one answer carries it, the others are 409
// one_time_secret naming the token's id (duplicates waiting in Go claim again rather than
// receive the holder's in-memory answer).
func TestLedgerReviewOneTimeSecretUnderConcurrency(t *testing.T) {
	t.Parallel()
	env := map[string]string{"IDEMPOTENCY_LOCK_TIMEOUT": "5s"}
	s := startServer(t, env)
	s2 := serveOn(t, s.db, env)
	pid, token := s.principal("zz")
	out := make([]resp, 6)
	var wg sync.WaitGroup
	for i := range out {
		wg.Add(1)
		go func() {
			defer wg.Done()
			srv := s
			if i%2 == 1 {
				srv = s2
			}
			out[i] = srv.call("POST", "/v1/api-tokens", token, "secret", `{"name":"ci"}`)
		}()
	}
	wg.Wait()
	secrets, conflicts := 0, 0
	for _, r := range out {
		switch {
		case r.status == 201 && strings.Contains(r.body, `"token":"idem_`):
			secrets++
		case r.status == 409 && strings.Contains(r.body, "one_time_secret") && !strings.Contains(r.body, "idem_"):
			conflicts++
		default:
			t.Errorf("unexpected: %+v", r)
		}
	}
	if secrets != 1 || conflicts != 5 {
		t.Errorf("%d answers carried the secret and %d were 409, want 1 and 5", secrets, conflicts)
	}
	if n := s.count(`SELECT count(*) FROM ledger.api_tokens WHERE principal_id = $1`, pid); n != 2 {
		t.Errorf("%d tokens, want the initial one and one more", n)
	}
	if n := s.count(`SELECT count(*) FROM idem.idempotency_keys WHERE key = 'secret' AND (response_body IS NOT NULL OR response_headers::text LIKE '%idem_%')`); n != 0 {
		t.Errorf("the secret was stored with the key")
	}
}

// TestLedgerReviewCrossPrincipalIsIndistinguishable (checked, correct): "another principal's account
// is 404" (docs/ledger.md): on every route, an account of another principal gets the same
// status, code and detail as an id that does not exist, so existence does not leak; nothing
// moves.
func TestLedgerReviewCrossPrincipalIsIndistinguishable(t *testing.T) {
	t.Parallel()
	s := startServer(t, map[string]string{"PAYOUT_PROVIDER_DELAY": "0"})
	_, alice := s.principal("alice")
	_, bob := s.principal("bob")
	own := reviewAccount(t, s, alice, "EUR")
	reviewDeposit(t, s, alice, own, 1000)
	foreign := reviewAccount(t, s, bob, "EUR")
	reviewDeposit(t, s, bob, foreign, 1000)
	bd := s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", foreign), bob, "", `{"amount":1}`)
	depID := bd.json(t)["id"]
	const missing = 987654
	probe := func(id int) []string {
		depositPath := fmt.Sprintf("/v1/accounts/%d/deposits/%v", id, depID)
		var out []string
		for i, c := range []struct{ method, path, body string }{
			{"GET", fmt.Sprintf("/v1/accounts/%d", id), ""},
			{"POST", fmt.Sprintf("/v1/accounts/%d/deposits", id), `{"amount":5}`},
			{"POST", "/v1/transfers", fmt.Sprintf(`{"from":%d,"to":%d,"amount":5}`, own, id)},
			{"POST", "/v1/transfers", fmt.Sprintf(`{"from":%d,"to":%d,"amount":5}`, id, own)},
			{"POST", "/v1/transfers", fmt.Sprintf(`{"from":%d,"to":%d,"amount":999999999}`, own, id)},
			{"POST", "/v1/payouts", fmt.Sprintf(`{"account":%d,"amount":5}`, id)},
			{"POST", "/v1/stepped-payouts", fmt.Sprintf(`{"account":%d,"amount":5}`, id)},
			{"POST", "/v1/stepped-payouts", fmt.Sprintf(`{"account":%d,"amount":999999999}`, id)},
			{"GET", depositPath, ""},
		} {
			key := ""
			if c.method == "POST" {
				key = fmt.Sprintf("probe-%d-%d", id, i)
			}
			r := s.call(c.method, c.path, alice, key, c.body)
			p := r.json(t)
			out = append(out, fmt.Sprintf("%s %s: %d %v %v", c.method, strings.Replace(c.path, fmt.Sprint(id), "ID", 1), r.status, p["code"], p["detail"]))
		}
		return out
	}
	f, m := probe(foreign), probe(missing)
	for i := range f {
		if f[i] != m[i] || !strings.Contains(f[i], ": 404 ") {
			t.Errorf("another principal's account: %s\n        a missing account:   %s", f[i], m[i])
		}
	}
	if bal, _ := reviewState(t, s, foreign); bal != 1001 {
		t.Errorf("bob's balance %d, want 1001", bal)
	}
	if bal, _ := reviewState(t, s, own); bal != 1000 {
		t.Errorf("alice's balance %d, want 1000", bal)
	}
}

// TestLedgerReviewHostileAmounts (checked, correct): "Bad input gets a clear 4xx and nothing is stored"
// (docs/http.md "Bad input"): odd amounts, numbers and bodies are 400 or 422, no money moves,
// the account's version (ETag) does not change.
func TestLedgerReviewHostileAmounts(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	_, token := s.principal("zz")
	a, b, usd := reviewAccount(t, s, token, "EUR"), reviewAccount(t, s, token, "EUR"), reviewAccount(t, s, token, "USD")
	reviewDeposit(t, s, token, a, 1000)
	pgtest.Exec(t, s.pool, `UPDATE ledger.accounts SET balance = 9223372036854775800 WHERE id = $1`, b)
	deep := `{"amount":` + strings.Repeat("[", 200000) + strings.Repeat("]", 200000) + `}`
	dep := fmt.Sprintf("/v1/accounts/%d/deposits", a)
	tr := func(from, to int, amount string) string {
		return fmt.Sprintf(`{"from":%d,"to":%d,"amount":%s}`, from, to, amount)
	}
	for i, c := range []struct {
		path, body, ct string
		status         int
	}{
		{dep, `{"amount":0}`, "", 422},
		{dep, `{"amount":-0}`, "", 422},
		{dep, `{"amount":-5}`, "", 422},
		{dep, `{"amount":0.5}`, "", 422},
		{dep, `{"amount":1e400}`, "", 422},
		{dep, `{"amount":-9223372036854775808}`, "", 422},
		{dep, `{"amount":1e99999999999999999999}`, "", 400},
		{dep, `{"amount":"5"}`, "", 400},
		{dep, `{"amount":null}`, "", 400},
		{dep, `{"amount":true}`, "", 400},
		{dep, `{"amount":{"v":5}}`, "", 400},
		{dep, `{"amount":[5]}`, "", 400},
		{dep, deep, "", 400},
		{dep, `[{"amount":5}]`, "", 400},
		{dep, `"amount"`, "", 400},
		{dep, `{"amount":5}`, "text/json", 415},
		{"/v1/transfers", tr(a, a, "5"), "", 422},
		{"/v1/transfers", tr(a, usd, "5"), "", 422},
		{"/v1/transfers", tr(a, b, "1000"), "", 422}, // b would pass 2^63-1: balance_limit
		{"/v1/transfers", tr(a, b, "1001"), "", 422},
		{"/v1/transfers", tr(a, b, "9223372036854775807"), "", 422},
		{"/v1/transfers", tr(-a, b, "5"), "", 422},
		{"/v1/transfers", tr(0, b, "5"), "", 422},
		{"/v1/transfers", `{"from":1.5,"to":2,"amount":5}`, "", 422}, // read as an amount is (D263)
		{"/v1/transfers", `{"from":"1","to":2,"amount":5}`, "", 400},
		{"/v1/transfers", `{"from":99999999999999999999,"to":2,"amount":5}`, "", 422},
		{fmt.Sprintf("/v1/accounts/%d/deposits", b), `{"amount":8}`, "", 422},
	} {
		r := s.call("POST", c.path, token, fmt.Sprintf("h-%d", i), c.body, "Content-Type", c.ct)
		if r.status != c.status {
			body := c.body
			if len(body) > 80 {
				body = body[:80] + "..."
			}
			t.Errorf("%s %s: %d %s, want %d", c.path, body, r.status, r.body, c.status)
		}
	}
	if bal, ver := reviewState(t, s, a); bal != 1000 || ver != 2 {
		t.Errorf("account a: balance %d version %d, want 1000 and 2", bal, ver)
	}
	if bal, ver := reviewState(t, s, b); bal != 9223372036854775800 || ver != 1 {
		t.Errorf("account b: balance %d version %d, want unchanged", bal, ver)
	}
	if n := s.count(`SELECT count(*) FROM ledger.transfers`); n != 0 {
		t.Errorf("%d transfers, want 0", n)
	}
}

// TestLedgerReviewBearerEdges (checked, correct): docs/ledger.md ### unauthorized: no Bearer header or a
// token that is not valid is 401; the scheme is case-insensitive; a deleted principal's token
// is 401 (TestDeletedPrincipal covers that).
func TestLedgerReviewBearerEdges(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	_, token := s.principal("zz")
	for _, auth := range []string{"", "Bearer", "Bearer ", "Basic " + token, token, "Bearer " + token + "x",
		"Bearer " + token + " extra", "Bearer\t" + token, "Bearer " + strings.Repeat("a", 5000)} {
		status, _, body := pgtest.Send(t, context.Background(), "GET", s.url+"/v1/accounts/1", "", "Authorization", auth)
		if status != 401 || !strings.Contains(body, `"code":"unauthorized"`) {
			t.Errorf("Authorization %.40q: %d %s", auth, status, body)
		}
	}
	for _, auth := range []string{"bearer " + token, "BEARER   " + token + "  "} {
		if status, _, _ := pgtest.Send(t, context.Background(), "GET", s.url+"/v1/accounts/1", "", "Authorization", auth); status != 404 {
			t.Errorf("Authorization %.20q: %d, want 404 (authenticated)", auth, status)
		}
	}
}

// TestLedgerReviewLostResponse (checked, correct): A client whose attempt times out while the deposit
// waits on the account's row retries under the same key: it gets the one answer, and the
// money moved once (docs/http.md "A client that gives up early").
func TestLedgerReviewLostResponse(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	_, token := s.principal("zz")
	a := reviewAccount(t, s, token, "EUR")
	ctx := context.Background()
	holder, err := s.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, holder, `SELECT 1 FROM ledger.accounts WHERE id = $1 FOR UPDATE`, a)
	path := s.url + fmt.Sprintf("/v1/accounts/%d/deposits", a)
	short, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	status, _, _ := pgtest.Send(t, short, "POST", path, `{"amount":42}`, "Authorization", "Bearer "+token, "Idempotency-Key", "lost")
	cancel()
	if status != -1 {
		t.Fatalf("the first attempt was answered (%d); want it cut off", status)
	}
	_ = holder.Rollback(ctx)
	st, h, body := pgtest.Send(t, ctx, "POST", path, `{"amount":42}`, "Authorization", "Bearer "+token, "Idempotency-Key", "lost")
	if st != http.StatusCreated {
		t.Fatalf("the retry: %d %s", st, body)
	}
	_ = h
	if bal, _ := reviewState(t, s, a); bal != 42 {
		t.Fatalf("balance %d, want 42", bal)
	}
}

package main

// Hostile bodies on every POST route, cross-principal use, money races: what held up under a
// review of the reference server, kept.

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"

	"github.com/pgidem/pgidem/internal/pgtest"
)

// ledgerState is everything a refused request must leave alone.
func ledgerState(t *testing.T, s *testServer) string {
	t.Helper()
	var out string
	err := s.pool.QueryRow(context.Background(), `SELECT format('accounts=%s balances=%s versions=%s deposits=%s transfers=%s tokens=%s payouts=%s reservations=%s provider=%s',
		(SELECT count(*) FROM ledger.accounts), (SELECT coalesce(sum(balance),0) FROM ledger.accounts),
		(SELECT coalesce(sum(`+accountVersion+`),0) FROM ledger.accounts),
		(SELECT count(*) FROM ledger.deposits), (SELECT count(*) FROM ledger.transfers),
		(SELECT count(*) FROM ledger.api_tokens), (SELECT count(*) FROM ledger.payouts),
		(SELECT count(*) FROM ledger.payout_reservations), (SELECT count(*) FROM provider.payouts))`).Scan(&out)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// TestHostileBodiesEveryRoute: every POST route, a catalogue of hostile bodies. Each gets
// the documented 4xx with a problem code, the ledger is unchanged, and the key is stored
// exactly when docs/http.md "Bad input" says so (a stored one replays byte for byte).
func TestHostileBodiesEveryRoute(t *testing.T) {
	t.Parallel()
	s := startServer(t, map[string]string{"PAYOUT_PROVIDER_DELAY": "0", "MAX_BODY_BYTES": "1048576"})
	_, token := s.principal("hostile")
	a, b := reviewAccount(t, s, token, "EUR"), reviewAccount(t, s, token, "EUR")
	usd := reviewAccount(t, s, token, "USD")
	reviewDeposit(t, s, token, a, 1000)

	dep := fmt.Sprintf("/v1/accounts/%d/deposits", a)
	const acc, tr, tok, po, sp = "/v1/accounts", "/v1/transfers", "/v1/api-tokens", "/v1/payouts", "/v1/stepped-payouts"
	amountBody := func(route, amt string) string {
		switch route {
		case tr:
			return fmt.Sprintf(`{"from":%d,"to":%d,"amount":%s}`, a, b, amt)
		case po, sp:
			return fmt.Sprintf(`{"account":%d,"amount":%s}`, a, amt)
		}
		return `{"amount":` + amt + `}`
	}
	type tc struct {
		name, path, body, ct string
		status               int
		code                 string
		stored               bool
	}
	var cases []tc
	// amounts
	for _, route := range []string{dep, tr, po, sp} {
		big := map[string]string{dep: "balance_limit", tr: "insufficient_funds", po: "validation_failed", sp: "validation_failed"}[route]
		for _, c := range []struct {
			amt, code string
			status    int
		}{
			{"1e30", big, 422}, {"9223372036854775808", big, 422}, {"1E400", big, 422},
			{"12345678901234567890123", big, 422},
			{"-0", "validation_failed", 422}, {"0", "validation_failed", 422}, {"-1", "validation_failed", 422},
			{"1.5", "validation_failed", 422}, {"1e-7", "validation_failed", 422}, {"-9223372036854775809", "validation_failed", 422},
			{`"1"`, "malformed_body", 400}, {"null", "malformed_body", 400}, {"true", "malformed_body", 400},
			{"[1]", "malformed_body", 400}, {`{"v":1}`, "malformed_body", 400},
		} {
			cases = append(cases, tc{name: route + " amount " + c.amt, path: route, body: amountBody(route, c.amt), status: c.status, code: c.code, stored: true})
		}
		cases = append(cases,
			tc{name: route + " duplicate amount", path: route, body: strings.Replace(amountBody(route, "1"), `"amount":1`, `"amount":1,"amount":1000`, 1), status: 400, code: "malformed_body"},
			tc{name: route + " duplicate amount same value", path: route, body: strings.Replace(amountBody(route, "1"), `"amount":1`, `"amount":1,"amount":1`, 1), status: 400, code: "malformed_body"},
		)
	}
	// every route: shapes
	bodies := map[string]string{
		acc: `{"name":"n","currency":"EUR"}`, dep: `{"amount":1}`, tr: amountBody(tr, "1"),
		tok: `{"name":"n"}`, po: amountBody(po, "1"), sp: amountBody(sp, "1"),
	}
	for _, route := range []string{acc, dep, tr, tok, po, sp} {
		good := bodies[route]
		withMember := good[:len(good)-1] + `,"memo":"x"}`
		deep := good[:len(good)-1] + `,"x":` + strings.Repeat("[", 200) + strings.Repeat("]", 200) + `}`
		cases = append(cases,
			tc{name: route + " unknown member", path: route, body: withMember, status: 400, code: "malformed_body", stored: true},
			tc{name: route + " deep nesting", path: route, body: deep, status: 400, code: "malformed_body"},
			tc{name: route + " text/plain", path: route, body: good, ct: "text/plain", status: 415, code: "unsupported_media_type", stored: true},
			tc{name: route + " form type", path: route, body: good, ct: "application/x-www-form-urlencoded", status: 415, code: "unsupported_media_type", stored: true},
			tc{name: route + " empty", path: route, body: "", status: 400, code: "malformed_body", stored: true},
			tc{name: route + " array", path: route, body: "[" + good + "]", status: 400, code: "malformed_body", stored: true},
			tc{name: route + " null", path: route, body: "null", status: 400, code: "malformed_body", stored: true},
			tc{name: route + " string", path: route, body: `"x"`, status: 400, code: "malformed_body", stored: true},
			tc{name: route + " empty object", path: route, body: `{}`, status: 400, code: "malformed_body", stored: true},
			tc{name: route + " BOM", path: route, body: "\xef\xbb\xbf" + good, status: 400, code: "malformed_body"},
			tc{name: route + " invalid UTF-8 member", path: route, body: good[:len(good)-1] + `,"\xff":1}`, status: 400, code: "malformed_body"},
			tc{name: route + " trailing comma", path: route, body: good[:len(good)-1] + `,}`, status: 400, code: "malformed_body"},
			tc{name: route + " 2 MB", path: route, body: good[:len(good)-1] + `,"pad":"` + strings.Repeat("x", 2<<20) + `"}`, status: 413, code: "request_too_large"},
		)
	}
	// names and currencies
	for _, route := range []string{acc, tok} {
		nb := func(name string) string {
			if route == acc {
				return `{"name":` + name + `,"currency":"EUR"}`
			}
			return `{"name":` + name + `}`
		}
		cases = append(cases,
			tc{name: route + " name 101", path: route, body: nb(`"` + strings.Repeat("é", 101) + `"`), status: 422, code: "validation_failed", stored: true},
			tc{name: route + " name empty", path: route, body: nb(`""`), status: 422, code: "validation_failed", stored: true},
			tc{name: route + " name DEL", path: route, body: nb(`"a\u007fb"`), status: 422, code: "validation_failed", stored: true},
			tc{name: route + " name NEL", path: route, body: nb(`"a\u0085b"`), status: 422, code: "validation_failed", stored: true},
			tc{name: route + " name number", path: route, body: nb(`5`), status: 400, code: "malformed_body", stored: true},
			tc{name: route + " name null", path: route, body: nb(`null`), status: 400, code: "malformed_body", stored: true},
			tc{name: route + " name invalid UTF-8", path: route, body: nb("\"a\xffb\""), status: 400, code: "malformed_body"},
			tc{name: route + " name lone surrogate", path: route, body: nb(`"a\ud800b"`), status: 400, code: "malformed_body"},
			tc{name: route + " name NUL", path: route, body: nb(`"a\u0000b"`), status: 400, code: "malformed_body"},
			tc{name: route + " name 10 MB", path: route, body: nb(`"` + strings.Repeat("x", 10<<20) + `"`), status: 413, code: "request_too_large"},
		)
	}
	for _, cur := range []string{`"eur"`, `"EU"`, `"EURO"`, `"E1R"`, `"ÉUR"`, `""`, `" EUR"`, `"EUR "`, `"ＥＵＲ"`, `"E\u0301UR"`} {
		cases = append(cases, tc{name: "currency " + cur, path: acc, body: `{"name":"n","currency":` + cur + `}`, status: 422, code: "validation_failed", stored: true})
	}
	cases = append(cases,
		tc{name: "currency number", path: acc, body: `{"name":"n","currency":978}`, status: 400, code: "malformed_body", stored: true},
		tc{name: "currency NUL", path: acc, body: `{"name":"n","currency":"E\u0000R"}`, status: 400, code: "malformed_body"},
		tc{name: "transfer to self", path: tr, body: fmt.Sprintf(`{"from":%d,"to":%d,"amount":1}`, a, a), status: 422, code: "validation_failed", stored: true},
		tc{name: "transfer between currencies", path: tr, body: fmt.Sprintf(`{"from":%d,"to":%d,"amount":1}`, a, usd), status: 422, code: "currency_mismatch", stored: true},
		tc{name: "transfer overdraft", path: tr, body: fmt.Sprintf(`{"from":%d,"to":%d,"amount":1001}`, a, b), status: 422, code: "insufficient_funds", stored: true},
		tc{name: "transfer from string", path: tr, body: fmt.Sprintf(`{"from":"%d","to":%d,"amount":1}`, a, b), status: 400, code: "malformed_body", stored: true},
		tc{name: "transfer from 2^63", path: tr, body: fmt.Sprintf(`{"from":9223372036854775808,"to":%d,"amount":1}`, b), status: 422, code: "validation_failed", stored: true},
		tc{name: "transfer from fraction", path: tr, body: fmt.Sprintf(`{"from":%d.5,"to":%d,"amount":1}`, a, b), status: 422, code: "validation_failed", stored: true},
		tc{name: "transfer from 0", path: tr, body: fmt.Sprintf(`{"from":0,"to":%d,"amount":1}`, b), status: 422, code: "validation_failed", stored: true},
		tc{name: "transfer from -1", path: tr, body: fmt.Sprintf(`{"from":-1,"to":%d,"amount":1}`, b), status: 422, code: "validation_failed", stored: true},
		tc{name: "payout account string", path: po, body: fmt.Sprintf(`{"account":"%d","amount":1}`, a), status: 400, code: "malformed_body", stored: true},
		tc{name: "payout account 0", path: po, body: `{"account":0,"amount":1}`, status: 422, code: "validation_failed", stored: true},
		tc{name: "stepped payout overdraft", path: sp, body: fmt.Sprintf(`{"account":%d,"amount":1001}`, a), status: 422, code: "insufficient_funds", stored: true},
		tc{name: "stepped payout account -1", path: sp, body: `{"account":-1,"amount":1}`, status: 422, code: "validation_failed", stored: true},
	)

	before := ledgerState(t, s)
	for i, c := range cases {
		key := fmt.Sprintf("hostile-%d", i)
		ct := c.ct
		if ct == "" {
			ct = jsonCT
		}
		keysBefore := s.count(`SELECT count(*) FROM idem.idempotency_keys`)
		r := s.call("POST", c.path, token, key, c.body, "Content-Type", ct)
		label := c.name
		if len(label) > 120 {
			label = label[:120]
		}
		if r.status != c.status || !strings.Contains(r.body, `"code":"`+c.code+`"`) {
			body := r.body
			if len(body) > 300 {
				body = body[:300]
			}
			t.Errorf("%s: %d %s; want %d %s", label, r.status, body, c.status, c.code)
			continue
		}
		stored := s.count(`SELECT count(*) FROM idem.idempotency_keys`) - keysBefore
		if c.stored != (stored == 1) || stored > 1 {
			t.Errorf("%s: %d keys stored, want stored=%v", label, stored, c.stored)
		}
		if stored == 1 {
			again := s.call("POST", c.path, token, key, c.body, "Content-Type", ct)
			if again.status != r.status || again.body != r.body || again.header.Get("Idempotent-Replayed") != "true" {
				t.Errorf("%s: the retry %d %q (replayed=%q), want the first answer %d %q", label, again.status, again.body,
					again.header.Get("Idempotent-Replayed"), r.status, r.body)
			}
		}
		if after := ledgerState(t, s); after != before {
			t.Errorf("%s: the ledger changed:\n before %s\n after  %s", label, before, after)
			before = after
		}
	}
	t.Logf("%d hostile requests", len(cases))
}

// TestCrossPrincipalSameKey: two principals sending the same Idempotency-Key on every
// POST route are independent: each gets its own fresh answer (never the other's replay, a
// 422 reuse, or a 409 one_time_secret), and each effect lands in its own accounts.
func TestCrossPrincipalSameKey(t *testing.T) {
	t.Parallel()
	s := startServer(t, map[string]string{"PAYOUT_PROVIDER_DELAY": "0"})
	_, alice := s.principal("alice")
	_, bob := s.principal("bob")
	a1, a2 := reviewAccount(t, s, alice, "EUR"), reviewAccount(t, s, alice, "EUR")
	b1, b2 := reviewAccount(t, s, bob, "EUR"), reviewAccount(t, s, bob, "EUR")
	reviewDeposit(t, s, alice, a1, 100)
	reviewDeposit(t, s, bob, b1, 100)
	for _, c := range []struct{ path, ab, bb string }{
		{"/v1/accounts", `{"name":"x","currency":"EUR"}`, `{"name":"x","currency":"EUR"}`},
		{fmt.Sprintf("/v1/accounts/%d/deposits", a1), `{"amount":7}`, ""},
		{"/v1/transfers", fmt.Sprintf(`{"from":%d,"to":%d,"amount":5}`, a1, a2), fmt.Sprintf(`{"from":%d,"to":%d,"amount":5}`, b1, b2)},
		{"/v1/api-tokens", `{"name":"t"}`, `{"name":"t"}`},
		{"/v1/payouts", fmt.Sprintf(`{"account":%d,"amount":3}`, a1), fmt.Sprintf(`{"account":%d,"amount":3}`, b1)},
		{"/v1/stepped-payouts", fmt.Sprintf(`{"account":%d,"amount":2}`, a1), fmt.Sprintf(`{"account":%d,"amount":2}`, b1)},
	} {
		key := "shared-" + strings.ReplaceAll(c.path, "/", "_")
		ra := s.call("POST", c.path, alice, key, c.ab)
		if ra.status != 201 {
			t.Fatalf("alice %s: %+v", c.path, ra)
		}
		bpath, bbody := c.path, c.bb
		if bbody == "" { // bob deposits into his own account under alice's key
			bpath, bbody = fmt.Sprintf("/v1/accounts/%d/deposits", b1), `{"amount":7}`
		}
		rb := s.call("POST", bpath, bob, key, bbody)
		if rb.status != 201 || rb.header.Get("Idempotent-Replayed") != "" {
			t.Errorf("bob %s under alice's key: %d %s replayed=%q; want his own 201", bpath, rb.status, rb.body, rb.header.Get("Idempotent-Replayed"))
		}
		// bob with alice's exact request (her account): 404, his own answer, not her replay
		rb2 := s.call("POST", c.path, bob, key+"-2", c.ab)
		_ = rb2
	}
	ba, _ := reviewState(t, s, a1)
	bb, _ := reviewState(t, s, b1)
	if ba != 100+7-5-2 || bb != 100+7-5-2 {
		t.Errorf("balances alice %d bob %d, want 100 each", ba, bb)
	}
}

// TestOverdraftRace: many concurrent transfers and stepped payouts out of one account, with
// distinct keys, then every one retried: the balance never goes negative, exactly as many
// succeed as the money allows, every retry gets its first answer, and the books balance.
func TestOverdraftRace(t *testing.T) {
	t.Parallel()
	s := startServer(t, map[string]string{"PAYOUT_PROVIDER_DELAY": "0", "DATABASE_POOL_SIZE": "8"})
	_, token := s.principal("hostile")
	src, dst := reviewAccount(t, s, token, "EUR"), reviewAccount(t, s, token, "EUR")
	reviewDeposit(t, s, token, src, 100)
	const n = 24
	type answer struct {
		path, body, key string
		r               resp
	}
	answers := make([]answer, n)
	var wg sync.WaitGroup
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			a := answer{key: fmt.Sprintf("race-%d", i)}
			switch i % 3 {
			case 0, 1:
				a.path, a.body = "/v1/transfers", fmt.Sprintf(`{"from":%d,"to":%d,"amount":10}`, src, dst)
			case 2:
				a.path, a.body = "/v1/stepped-payouts", fmt.Sprintf(`{"account":%d,"amount":10}`, src)
			}
			a.r = s.call("POST", a.path, token, a.key, a.body)
			answers[i] = a
		}(i)
	}
	wg.Wait()
	ok := 0
	for _, a := range answers {
		switch {
		case a.r.status == 201:
			ok++
		case a.r.status == 422 && strings.Contains(a.r.body, "insufficient_funds"):
		default:
			t.Errorf("%s %s: %d %s", a.path, a.key, a.r.status, a.r.body)
		}
	}
	if ok != 10 {
		t.Errorf("%d succeeded, want 10 (100 / 10)", ok)
	}
	for _, a := range answers {
		again := s.call("POST", a.path, token, a.key, a.body)
		if again.status != a.r.status || again.body != a.r.body {
			t.Errorf("retry of %s: %d %s, want %d %s", a.key, again.status, again.body, a.r.status, a.r.body)
		}
	}
	srcBal, _ := reviewState(t, s, src)
	dstBal, _ := reviewState(t, s, dst)
	tin := s.count(`SELECT coalesce(sum(amount),0) FROM ledger.transfers WHERE to_id = $1`, dst)
	tout := s.count(`SELECT coalesce(sum(amount),0) FROM ledger.transfers WHERE from_id = $1`, src)
	res := s.count(`SELECT coalesce(sum(amount),0) FROM ledger.payout_reservations WHERE account_id = $1`, src)
	if srcBal < 0 || int(srcBal) != 100-tout-res || int(dstBal) != tin || srcBal != 0 {
		t.Errorf("books: src %d (100 - %d - %d), dst %d (in %d)", srcBal, tout, res, dstBal, tin)
	}
	pgtest.Exec(t, s.pool, `SELECT 1`)
}

// TestDeletedPrincipalTakesEverything: docs/operations.md "Principals and tokens": deleting a
// principal from ledger.principals takes its tokens, accounts, transfers and idempotency keys
// with it (ON DELETE CASCADE), and its tokens get 401, also after stepped payouts and payouts.
func TestDeletedPrincipalTakesEverything(t *testing.T) {
	t.Parallel()
	s := startServer(t, map[string]string{"PAYOUT_PROVIDER_DELAY": "0"})
	id, token := s.principal("doomed")
	_, other := s.principal("other")
	a, b := reviewAccount(t, s, token, "EUR"), reviewAccount(t, s, token, "EUR")
	o := reviewAccount(t, s, other, "EUR")
	reviewDeposit(t, s, other, o, 50)
	if r := s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", a), token, "d1", `{"amount":100}`); r.status != 201 {
		t.Fatal(r)
	}
	for i, c := range []struct{ path, body string }{
		{"/v1/transfers", fmt.Sprintf(`{"from":%d,"to":%d,"amount":10}`, a, b)},
		{"/v1/payouts", fmt.Sprintf(`{"account":%d,"amount":5}`, a)},
		{"/v1/stepped-payouts", fmt.Sprintf(`{"account":%d,"amount":5}`, a)},
		{"/v1/api-tokens", `{"name":"second"}`},
		{"/v1/accounts", `{"name":"x","currency":"EUR"}`},
		{"/v1/transfers", fmt.Sprintf(`{"from":%d,"to":%d,"amount":1000}`, a, b)}, // a stored 422
	} {
		if r := s.call("POST", c.path, token, fmt.Sprintf("k%d", i), c.body); r.status != 201 && r.status != 422 {
			t.Fatalf("%s: %+v", c.path, r)
		}
	}
	if _, err := s.pool.Exec(context.Background(), `DELETE FROM ledger.principals WHERE id = $1`, id); err != nil {
		t.Fatalf("delete the principal: %v", err)
	}
	for _, q := range []string{
		`SELECT count(*) FROM idem.idempotency_keys WHERE principal_id = $1`,
		`SELECT count(*) FROM ledger.api_tokens WHERE principal_id = $1`,
		`SELECT count(*) FROM ledger.accounts WHERE principal_id = $1`,
		`SELECT count(*) FROM ledger.transfers WHERE principal_id = $1`,
		`SELECT count(*) FROM ledger.payouts WHERE principal_id = $1`,
		`SELECT count(*) FROM ledger.payout_reservations WHERE principal_id = $1`,
	} {
		if n := s.count(q, id); n != 0 {
			t.Errorf("%s: %d left", q, n)
		}
	}
	if r := s.call("GET", fmt.Sprintf("/v1/accounts/%d", a), token, "", ""); r.status != 401 {
		t.Errorf("the deleted principal's token: %d %s, want 401", r.status, r.body)
	}
	if r := s.call("POST", "/v1/transfers", token, "k0", fmt.Sprintf(`{"from":%d,"to":%d,"amount":10}`, a, b)); r.status != 401 {
		t.Errorf("the deleted principal's keyed retry: %d %s, want 401", r.status, r.body)
	}
	if bal, _ := reviewState(t, s, o); bal != 50 {
		t.Errorf("the other principal's balance %d", bal)
	}
}

// TestSameKeyTwoPrincipalsConcurrently: docs/http.md "Two principals may use one key
// independently": while alice's transfer under key K is held (her account's row locked), bob's
// transfer under K neither waits for hers nor gets 409; it completes at once.
func TestSameKeyTwoPrincipalsConcurrently(t *testing.T) {
	t.Parallel()
	s := startServer(t, map[string]string{"IDEMPOTENCY_DUPLICATE_WAIT": "3s"})
	_, alice := s.principal("alice")
	_, bob := s.principal("bob")
	a1, a2 := reviewAccount(t, s, alice, "EUR"), reviewAccount(t, s, alice, "EUR")
	b1, b2 := reviewAccount(t, s, bob, "EUR"), reviewAccount(t, s, bob, "EUR")
	reviewDeposit(t, s, alice, a1, 100)
	reviewDeposit(t, s, bob, b1, 100)
	ctx := context.Background()
	holder, err := s.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Rollback(ctx)
	if _, err := holder.Exec(ctx, `SELECT 1 FROM ledger.accounts WHERE id = $1 FOR UPDATE`, a1); err != nil {
		t.Fatal(err)
	}
	done := make(chan resp, 1)
	go func() {
		done <- s.call("POST", "/v1/transfers", alice, "K", fmt.Sprintf(`{"from":%d,"to":%d,"amount":10}`, a1, a2))
	}()
	pgtest.WaitFor(t, s.pool, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()`)
	rb := s.call("POST", "/v1/transfers", bob, "K", fmt.Sprintf(`{"from":%d,"to":%d,"amount":10}`, b1, b2))
	if rb.status != 201 {
		t.Errorf("bob under alice's held key: %d %s, want 201 at once", rb.status, rb.body)
	}
	_ = holder.Rollback(ctx)
	if ra := <-done; ra.status != 201 {
		t.Errorf("alice: %+v", ra)
	}
}

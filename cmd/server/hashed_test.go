package main

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pgidem/pgidem/internal/pgcluster"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// hashedAccount makes a principal and an account with a balance of 1000.
func hashedAccount(t *testing.T, s *testServer, name string) (token string, account int) {
	t.Helper()
	_, token = s.principal(name)
	r := s.call("POST", "/v1/accounts", token, "", `{"name":"a","currency":"EUR"}`)
	if r.status != 201 {
		t.Fatalf("account: %+v", r)
	}
	account = int(r.json(t)["id"].(float64))
	if r := s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", account), token, "", `{"amount":1000}`); r.status != 201 {
		t.Fatalf("seed: %+v", r)
	}
	return token, account
}

// TestHashedEquivalentFormsReplay: docs/http.md "The fingerprint": bodies with one canonical
// form are one request, whatever the Content-Type parameters or the query; the money moves once.
func TestHashedEquivalentFormsReplay(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	token, a := hashedAccount(t, s, "hz-eq")
	dep := fmt.Sprintf("/v1/accounts/%d/deposits", a)
	first := s.call("POST", dep, token, "k-eq", `{"amount":100}`, "Content-Type", jsonCT)
	if first.status != 201 {
		t.Fatalf("first: %+v", first)
	}
	for _, c := range []struct{ path, body, ct string }{
		{dep, `{"amount":1e2}`, jsonCT},
		{dep, `{"amount":100.0}`, jsonCT},
		{dep, `{"amount":10E1}`, jsonCT},
		{dep, `{"amount":1000e-1}`, jsonCT},
		{dep, "\t{ \"\\u0061mount\" : 100 }\r\n", jsonCT},
		{dep, `{"amount":100}`, "application/json; charset=utf-8"},
		{dep, `{"amount":100}`, "Application/JSON"},
		{dep, `{"amount":100}`, "application/vnd.x+json"},
		{dep, `{"amount":100}`, ""},
		{dep + "?amount=5", `{"amount":100}`, jsonCT},
	} {
		r := s.call("POST", c.path, token, "k-eq", c.body, "Content-Type", c.ct)
		if r.status != 201 || r.header.Get("Idempotent-Replayed") != "true" || r.body != first.body {
			t.Errorf("%s %q (%q): %d replayed=%q %s, want the first answer replayed", c.path, c.body, c.ct, r.status,
				r.header.Get("Idempotent-Replayed"), r.body)
		}
	}
	if n := s.count(`SELECT balance FROM ledger.accounts WHERE id = $1`, a); n != 1100 {
		t.Fatalf("balance %d, want 1100", n)
	}
}

// TestHashedDifferentMeaningsMismatch: requests that mean something else under the same key
// are 422, never the first's answer: another amount (also past 2^53, where a double would merge
// them), another account, another type of body.
func TestHashedDifferentMeaningsMismatch(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	token, a := hashedAccount(t, s, "hz-diff")
	r := s.call("POST", "/v1/accounts", token, "", `{"name":"b","currency":"EUR"}`)
	b := int(r.json(t)["id"].(float64))
	dep := fmt.Sprintf("/v1/accounts/%d/deposits", a)
	if r := s.call("POST", dep, token, "k-big", `{"amount":9007199254740993}`); r.status != 201 {
		t.Fatalf("first: %+v", r)
	}
	if r := s.call("POST", dep, token, "k-big", `{"amount":9007199254740992}`); r.status != 422 || !strings.Contains(r.body, "idempotency_key_reuse") {
		t.Errorf("2^53 after 2^53+1: %+v, want 422", r)
	}
	if r := s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", b), token, "k-big", `{"amount":9007199254740993}`); r.status != 422 {
		t.Errorf("another account: %+v, want 422", r)
	}
	if r := s.call("POST", dep, token, "k-big", `{"amount":9007199254740993}`, "Content-Type", "text/plain"); r.status != 201 || r.header.Get("Idempotent-Replayed") != "true" {
		// documented (D178): a key first used for a JSON body answers a later body of another
		// type with that canonical form
		t.Logf("text/plain retry of a JSON body: %d %s", r.status, r.body)
	}
	if n := s.count(`SELECT count(*) FROM ledger.deposits WHERE account_id = $1`, a); n != 2 {
		t.Fatalf("%d deposits, want the seed and one", n)
	}
}

// TestHashedEmptyBodyIsOneRequestWhateverItsType: docs/http.md: "an empty body is the same
// request whatever its Content-Type says". A request without a body sent as text/plain (415)
// and again as application/json under the same key gets the first answer replayed.
func TestHashedEmptyBodyIsOneRequestWhateverItsType(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	token, a := hashedAccount(t, s, "hz-empty")
	dep := fmt.Sprintf("/v1/accounts/%d/deposits", a)
	first := s.call("POST", dep, token, "k-empty", "", "Content-Type", "text/plain")
	if first.status != 415 {
		t.Fatalf("text/plain, no body: %+v, want 415", first)
	}
	r := s.call("POST", dep, token, "k-empty", "", "Content-Type", jsonCT)
	if r.status != 415 || r.header.Get("Idempotent-Replayed") != "true" {
		t.Errorf("application/json, no body, after text/plain under the key: %d replayed=%q %s; want the 415 replayed",
			r.status, r.header.Get("Idempotent-Replayed"), r.body)
	}
}

// TestHashedWaitingDuplicateWithAnotherBody: a duplicate that waits (in Go, on the first's
// claim) while the first runs, but whose fingerprint differs (another amount, another account),
// gets 422 once the first is done, never the first's answer, and its
// body never runs.
func TestHashedWaitingDuplicateWithAnotherBody(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := startServer(t, nil)
	token, a := hashedAccount(t, s, "hz-wait")
	r := s.call("POST", "/v1/accounts", token, "", `{"name":"b","currency":"EUR"}`)
	b := int(r.json(t)["id"].(float64))
	for i, dup := range []struct{ path, body, ct string }{
		{fmt.Sprintf("/v1/accounts/%d/deposits", a), `{"amount":200}`, jsonCT},
		{fmt.Sprintf("/v1/accounts/%d/deposits", b), `{"amount":100}`, jsonCT},
	} {
		key := fmt.Sprintf("k-wait-%d", i)
		before := s.count(`SELECT balance FROM ledger.accounts WHERE id = $1`, a) + s.count(`SELECT balance FROM ledger.accounts WHERE id = $1`, b)
		lock := pgtest.Connect(t, s.db)
		tx, err := lock.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(ctx, `SELECT 1 FROM ledger.accounts WHERE id = $1 FOR UPDATE`, a); err != nil {
			t.Fatal(err)
		}
		var wg sync.WaitGroup
		var firstR, dupR resp
		wg.Add(1)
		go func() {
			defer wg.Done()
			firstR = s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", a), token, key, `{"amount":100}`, "Content-Type", jsonCT)
		}()
		pgtest.WaitFor(t, s.pool, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%UPDATE ledger.accounts%'`)
		wg.Add(1)
		go func() {
			defer wg.Done()
			dupR = s.call("POST", dup.path, token, key, dup.body, "Content-Type", dup.ct)
		}()
		sleepBriefly()
		sleepBriefly()
		_ = tx.Rollback(ctx)
		wg.Wait()
		_ = lock.Close(ctx)
		if firstR.status != 201 {
			t.Fatalf("%d: first: %+v", i, firstR)
		}
		if dupR.status != 422 || dupR.header.Get("Idempotent-Replayed") == "true" {
			t.Errorf("%d: duplicate %s %q (%s) that waited: %d replayed=%q %s, want 422", i, dup.path, dup.body, dup.ct,
				dupR.status, dupR.header.Get("Idempotent-Replayed"), dupR.body)
		}
		after := s.count(`SELECT balance FROM ledger.accounts WHERE id = $1`, a) + s.count(`SELECT balance FROM ledger.accounts WHERE id = $1`, b)
		if after-before != 100 {
			t.Errorf("%d: money moved %d, want 100", i, after-before)
		}
	}
}

// TestHashedTextPlainTakeoverOfAKilledSteppedPayout: a stepped payout sent as JSON, its
// server killed after the "pay" step (money reserved, the provider paid), is retried by a
// request with the same body sent as text/plain once the lease ran out. docs/http.md: "a body
// first sent as text/plain ... then sent as application/json under the same key is another
// request"; stepped.go/docs/ledger.md: the retry "goes on after" the steps, so that "the
// reservation, the provider's payout and the settlement each happen once, whatever the kill
// point". D178 leaves the text/plain takeover open; this checks what it costs: the 415 of the
// text/plain body must not become the JSON request's stored answer, with the money reserved and
// paid out but never settled.
func TestHashedTextPlainTakeoverOfAKilledSteppedPayout(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	principal, token := s.principal("hz-step")
	port, err := pgcluster.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	p := &process{t: t, bin: serverBinary(t), addr: fmt.Sprintf("127.0.0.1:%d", port)}
	p.env = append(os.Environ(), "DATABASE_URL="+s.db, "LISTEN_ADDR="+p.addr, "CLEANUP_INTERVAL=0", "PAYOUTS_LEASE=1s",
		"PAYOUT_PROVIDER_DELAY=0", "LOG_LEVEL=error", "PAYOUT_STEP_PAUSE=3s")
	acc := int(s.call("POST", "/v1/accounts", token, "", `{"name":"main","currency":"EUR"}`).json(t)["id"].(float64))
	if r := s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", acc), token, "", `{"amount":10000}`); r.status != 201 {
		t.Fatalf("deposit: %+v", r)
	}
	const key = "hz-step-1"
	body := fmt.Sprintf(`{"account":%d,"amount":700}`, acc)
	p.start()
	go func() {
		_, _, _ = pgtest.Send(t, context.Background(), "POST", "http://"+p.addr+"/v1/stepped-payouts", body,
			"Authorization", "Bearer "+token, "Idempotency-Key", key, "Content-Type", jsonCT)
	}()
	pgtest.WaitFor(t, s.pool, `SELECT count(*) FROM idem.idempotency_keys
		WHERE principal_id = $1 AND key = $2 AND recovery_point = 'pay'`, principal, key)
	p.kill()
	// The lease (1 s) runs out.
	pgtest.WaitFor(t, s.pool, `SELECT count(*) FROM idem.idempotency_keys
		WHERE principal_id = $1 AND key = $2 AND lease_expires_at < clock_timestamp()`, principal, key)
	plain := s.call("POST", "/v1/stepped-payouts", token, key, body, "Content-Type", "text/plain")
	t.Logf("text/plain retry: %d %s", plain.status, plain.body)
	var answer resp
	for deadline := time.Now().Add(15 * time.Second); ; {
		answer = s.call("POST", "/v1/stepped-payouts", token, key, body, "Content-Type", jsonCT)
		if answer.status != http.StatusConflict || time.Now().After(deadline) {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	reservations := s.count(`SELECT count(*) FROM ledger.payout_reservations WHERE principal_id = $1 AND idempotency_key = $2`, principal, key)
	settled := s.count(`SELECT count(*) FROM ledger.payout_reservations WHERE principal_id = $1 AND idempotency_key = $2 AND payout_id IS NOT NULL`, principal, key)
	balance := s.count(`SELECT balance FROM ledger.accounts WHERE id = $1`, acc)
	paid := s.count(`SELECT count(*) FROM provider.payouts WHERE principal_id = $1`, principal)
	t.Logf("JSON retry: %d replayed=%q %s; reservations %d, settled %d, provider payouts %d, balance %d", answer.status,
		answer.header.Get("Idempotent-Replayed"), answer.body, reservations, settled, paid, balance)
	if answer.status != http.StatusCreated {
		t.Errorf("the JSON request's retry got %d %s, want 201: its first attempt reserved and paid", answer.status, answer.body)
	}
	if reservations != 1 || settled != 1 {
		t.Errorf("reservations %d, settled %d (balance %d): want the reservation settled once", reservations, settled, balance)
	}
}

package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"testing"
	"time"

	"github.com/pgidem/pgidem/internal/pgcluster"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestPayoutOutlastsItsLease is the case through the reference server: a payout whose
// provider call takes 2.5 s on a route with a 1 s lease, and a client that retries every half
// second, each waiting 0.2 s for the answer. The heartbeat keeps the lease, so every retry
// during the work gets 409 with Retry-After, the retry after it gets the recorded payout, and the provider, asked from
// outside, received one call.
func TestPayoutOutlastsItsLease(t *testing.T) {
	t.Parallel()
	// Duplicates wait 0.2 s for the answer, so that the retries see the lease held.
	s := startServer(t, map[string]string{"PAYOUTS_LEASE": "1s", "PAYOUT_PROVIDER_DELAY": "2500ms",
		"IDEMPOTENCY_DUPLICATE_WAIT": "200ms"})
	_, token := s.principal("payer")
	account := int(s.call("POST", "/v1/accounts", token, "", `{"name":"main","currency":"EUR"}`).json(t)["id"].(float64))
	body := fmt.Sprintf(`{"account":%d,"amount":700}`, account)
	first := make(chan resp, 1)
	go func() { first <- s.call("POST", "/v1/payouts", token, "pay-1", body) }()
	var answer resp
	retries := 0
wait:
	for {
		select {
		case answer = <-first:
			break wait
		case <-time.After(500 * time.Millisecond):
		}
		retries++
		r := s.call("POST", "/v1/payouts", token, "pay-1", body)
		if r.status == http.StatusCreated && r.header.Get("Idempotent-Replayed") == "true" {
			answer = <-first // the payout ended while this retry was on its way
			break
		}
		if r.status != http.StatusConflict || r.header.Get("Retry-After") == "" {
			t.Fatalf("retry %d during the payout: %+v, want 409 with Retry-After", retries, r)
		}
	}
	if answer.status != http.StatusCreated || retries < 3 {
		t.Fatalf("the payout: %+v after %d retries", answer, retries)
	}
	again := s.call("POST", "/v1/payouts", token, "pay-1", body)
	if again.status != http.StatusCreated || again.body != answer.body || again.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("the retry after the payout: %+v, want the recorded %s", again, answer.body)
	}
	p := answer.json(t)
	calls := s.call("GET", "/v1/provider/calls/"+p["provider_key"].(string), token, "", "")
	if c := calls.json(t); calls.status != 200 || c["calls"] != float64(1) || c["repeats"] != float64(0) || c["provider_ref"] != p["provider_ref"] {
		t.Fatalf("the provider: %+v, want one call and no repeat for %v", calls, p["provider_ref"])
	}
	if g := s.call("GET", answer.header.Get("Location"), token, "", ""); g.status != 200 || g.json(t)["provider_ref"] != p["provider_ref"] {
		t.Fatalf("GET the payout: %+v", g)
	}
	if n := s.count(`SELECT count(*) FROM ledger.payouts`); n != 1 {
		t.Fatalf("%d payouts recorded, want 1", n)
	}
}

// TestPayoutAfterExpiryIsANewPayout (issue 28, finding 1): a key reused after its answer
// expired names a new request, which must reach the provider under a provider key of its own.
// With the provider key derived from the principal and the key alone, the provider handed the
// second request the first payout (its reference and amount), and the stored answer said a
// payout of 250000 was made that never was.
func TestPayoutAfterExpiryIsANewPayout(t *testing.T) {
	t.Parallel()
	s := startServer(t, map[string]string{"IDEMPOTENCY_TTL": "1s", "PAYOUTS_LEASE": "1s", "PAYOUT_PROVIDER_DELAY": "0"})
	_, token := s.principal("payer")
	account := int(s.call("POST", "/v1/accounts", token, "", `{"name":"main","currency":"EUR"}`).json(t)["id"].(float64))
	first := s.call("POST", "/v1/payouts", token, "K", fmt.Sprintf(`{"account":%d,"amount":100}`, account))
	if first.status != http.StatusCreated {
		t.Fatalf("the first payout: %+v", first)
	}
	time.Sleep(2200 * time.Millisecond) // the key's life passes: the TTL after the lease's end and after the answer
	second := s.call("POST", "/v1/payouts", token, "K", fmt.Sprintf(`{"account":%d,"amount":250000}`, account))
	if second.status != http.StatusCreated || second.header.Get("Idempotent-Replayed") == "true" {
		t.Fatalf("a new request under the expired key: %+v, want a new 201", second)
	}
	p1, p2 := first.json(t), second.json(t)
	if p1["provider_key"] == p2["provider_key"] || p1["provider_ref"] == p2["provider_ref"] || p2["amount"] != float64(250000) {
		t.Fatalf("the second payout %v shares the first's provider key or reference (%v)", p2, p1)
	}
	for _, p := range []map[string]any{p1, p2} {
		c := s.call("GET", "/v1/provider/calls/"+p["provider_key"].(string), token, "", "").json(t)
		if c["calls"] != float64(1) || c["provider_ref"] != p["provider_ref"] {
			t.Fatalf("the provider under %v: %v, want one call that made %v", p["provider_key"], c, p["provider_ref"])
		}
	}
	if n := s.count(`SELECT count(*) FROM provider.payouts WHERE amount = 250000`); n != 1 {
		t.Fatalf("%d payouts of 250000 at the provider, want 1", n)
	}
	if n := s.count(`SELECT count(*) FROM ledger.payouts`); n != 2 {
		t.Fatalf("%d payouts in the ledger, want 2", n)
	}
}

// TestPayoutSurvivesAServerKill (issue 28, finding 2): a server killed in the middle of a
// payout, restarted, and the client's retry: the provider, which keeps its records in the
// database, saw one call under the payout's provider key, the retry gets that payout, and
// another principal's payout after the restart never shares its reference or its ledger row.
func TestPayoutSurvivesAServerKill(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	_, alice := s.principal("alice")
	_, bob := s.principal("bob")
	accountOf := func(token string) int {
		return int(s.call("POST", "/v1/accounts", token, "", `{"name":"main","currency":"EUR"}`).json(t)["id"].(float64))
	}
	aliceAccount, bobAccount := accountOf(alice), accountOf(bob)
	port, err := pgcluster.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	p := &process{t: t, bin: serverBinary(t), addr: fmt.Sprintf("127.0.0.1:%d", port), env: append(os.Environ(),
		"DATABASE_URL="+s.db, "LISTEN_ADDR="+fmt.Sprintf("127.0.0.1:%d", port), "CLEANUP_INTERVAL=0",
		"PAYOUTS_LEASE=1s", "PAYOUT_PROVIDER_DELAY=2s", "LOG_LEVEL=error")}
	p.start()
	defer p.kill()
	send := func(token, key, body string) (int, string) {
		status, _, b := pgtest.Send(t, context.Background(), "POST", "http://"+p.addr+"/v1/payouts", body,
			"Authorization", "Bearer "+token, "Idempotency-Key", key, "Content-Type", "application/json")
		return status, b
	}
	body := fmt.Sprintf(`{"account":%d,"amount":700}`, aliceAccount)
	go send(alice, "pay-1", body)
	pgtest.WaitFor(t, s.pool, `SELECT count(*) FROM provider.payouts`) // the provider accepted it
	p.kill()
	p.start()

	var payout map[string]any
	for deadline := time.Now().Add(15 * time.Second); ; {
		status, b := send(alice, "pay-1", body)
		if status == http.StatusCreated {
			if err := json.Unmarshal([]byte(b), &payout); err != nil {
				t.Fatal(err)
			}
			break
		}
		if status != http.StatusConflict || time.Now().After(deadline) {
			t.Fatalf("the retry after the restart: %d %s", status, b)
		}
		time.Sleep(250 * time.Millisecond)
	}
	var calls int
	var ref string
	if err := s.pool.QueryRow(context.Background(), `SELECT calls, ref FROM provider.payouts WHERE idempotency_key = $1`,
		payout["provider_key"]).Scan(&calls, &ref); err != nil {
		t.Fatal(err)
	}
	if calls != 2 || ref != payout["provider_ref"] || s.count(`SELECT count(*) FROM provider.payouts`) != 1 {
		t.Fatalf("the provider: %d calls under the payout's key, reference %s; want the killed attempt's call and the "+
			"takeover's, one payout %v", calls, ref, payout["provider_ref"])
	}
	// From outside: one call acted on under the payout's key, the takeover's a repeat.
	c := s.call("GET", "/v1/provider/calls/"+payout["provider_key"].(string), alice, "", "").json(t)
	if c["calls"] != float64(1) || c["repeats"] != float64(1) || c["provider_ref"] != payout["provider_ref"] {
		t.Fatalf("GET /v1/provider/calls: %v, want one call and one repeat", c)
	}

	status, b := send(bob, "pay-1", fmt.Sprintf(`{"account":%d,"amount":5}`, bobAccount))
	var bobs map[string]any
	if err := json.Unmarshal([]byte(b), &bobs); status != http.StatusCreated || err != nil {
		t.Fatalf("bob's payout: %d %s", status, b)
	}
	if bobs["provider_ref"] == payout["provider_ref"] || bobs["provider_key"] == payout["provider_key"] {
		t.Fatalf("bob's payout %v shares alice's %v", bobs, payout)
	}
	get := s.call("GET", fmt.Sprintf("/v1/payouts/%v", bobs["id"]), bob, "", "")
	if get.status != http.StatusOK || get.json(t)["amount"] != float64(5) {
		t.Fatalf("bob reads his payout: %+v", get)
	}
	if n := s.count(`SELECT count(*) FROM ledger.payouts`); n != 2 {
		t.Fatalf("%d payouts in the ledger, want alice's and bob's", n)
	}
}

// TestPayoutDoesNotWaitForATransfer: a payout's record, written outside the request's
// transaction, references its account; its foreign-key check must not wait for a transfer
// that holds the account. When transfers locked their accounts FOR UPDATE it did, and with
// deposits updating the account in between, the check (which also locks the account's newer
// versions) could wait for a transfer that waited for it: a deadlock, and a 500 for the payout
// (a CI run of the upgrade test met it in release 0.2.0). Here a transfer's lock, taken with
// the server's own statement, is held open while the payout runs.
func TestPayoutDoesNotWaitForATransfer(t *testing.T) {
	t.Parallel()
	s := startServer(t, map[string]string{"PAYOUT_PROVIDER_DELAY": "1ms"})
	principal, token := s.principal("payer")
	open := func(name string) int64 {
		return int64(s.call("POST", "/v1/accounts", token, "", `{"name":"`+name+`","currency":"EUR"}`).json(t)["id"].(float64))
	}
	from, to := open("from"), open("to")
	ctx := context.Background()
	tx, err := s.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	rows, err := tx.Query(ctx, lockTransferAccounts, from, to, principal)
	if err != nil {
		t.Fatal(err)
	}
	locked := 0
	for rows.Next() {
		locked++
	}
	if rows.Close(); rows.Err() != nil || locked != 2 {
		t.Fatalf("the transfer's lock: %d accounts, %v", locked, rows.Err())
	}

	answer := make(chan resp, 1)
	began := time.Now()
	go func() {
		answer <- s.call("POST", "/v1/payouts", token, "pay-beside-a-transfer", fmt.Sprintf(`{"account":%d,"amount":5}`, from))
	}()
	select {
	case r := <-answer:
		if r.status != http.StatusCreated {
			t.Fatalf("the payout beside a transfer: %+v, want 201", r)
		}
		t.Logf("the payout answered in %v while the transfer held its accounts", time.Since(began).Round(time.Millisecond))
	case <-time.After(5 * time.Second):
		_ = tx.Rollback(ctx)
		t.Fatalf("the payout still waited 5 s for the transfer's lock (then: %+v)", <-answer)
	}
}

package main

import (
	"fmt"
	"net/http"
	"testing"
	"time"
)

// TestPayoutOutlastsItsLease is the case through the reference server: a payout whose
// provider call takes 2.5 s on a route with a 1 s lease, and a client that retries every half
// second. The heartbeat keeps the lease, so every retry during the work gets 409 with
// Retry-After, the retry after it gets the recorded payout, and the provider, asked from
// outside, received one call.
func TestPayoutOutlastsItsLease(t *testing.T) {
	t.Parallel()
	s := startServer(t, map[string]string{"PAYOUTS_LEASE": "1s", "PAYOUT_PROVIDER_DELAY": "2500ms"})
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
	if c := calls.json(t); calls.status != 200 || c["calls"] != float64(1) || c["provider_ref"] != p["provider_ref"] {
		t.Fatalf("the provider: %+v, want one call for %v", calls, p["provider_ref"])
	}
	if g := s.call("GET", answer.header.Get("Location"), token, "", ""); g.status != 200 || g.json(t)["provider_ref"] != p["provider_ref"] {
		t.Fatalf("GET the payout: %+v", g)
	}
	if n := s.count(`SELECT count(*) FROM ledger.payouts`); n != 1 {
		t.Fatalf("%d payouts recorded, want 1", n)
	}
}

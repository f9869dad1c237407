package main

import (
	"fmt"
	"strings"
	"testing"
	"time"
)

// TestLedgerReceiptKeyTakesAClientsKey: a receipt's key (`receipt/<job id>`) is the server's
// principal's, not the transfer's (D212): once a receipt was sent, the principal's first request
// under its own key "receipt/<that job>" runs (201). It was refused 422 idempotency_key_reuse:
// the receipt's key lived in the principal's key space, where its clients' keys live.
func TestLedgerReceiptKeyTakesAClientsKey(t *testing.T) {
	t.Parallel()
	rcv := newReceiver(t, false)
	s := startServer(t, map[string]string{"RECEIPT_URL": rcv.url})
	_, token := s.principal("alice")
	from, to := seedAccounts(t, s, token)
	if r := s.call("POST", "/v1/transfers", token, "t-1", fmt.Sprintf(`{"from":%d,"to":%d,"amount":25}`, from, to)); r.status != 201 {
		t.Fatalf("transfer: %+v", r)
	}
	waitForCount(t, s, 30*time.Second, `SELECT count(*) FROM river.river_job WHERE kind = 'receipt' AND state = 'completed'`)
	var job int64
	if err := s.pool.QueryRow(t.Context(), `SELECT id FROM river.river_job WHERE kind = 'receipt'`).Scan(&job); err != nil {
		t.Fatal(err)
	}
	key := fmt.Sprintf("receipt/%d", job)
	r := s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", to), token, key, `{"amount":7}`)
	if r.status != 201 || r.header.Get("Idempotent-Replayed") != "" {
		t.Errorf("the client's first request under its own key %q: %d %s; want 201 (the deposit runs): the receipt's internal key took the client's", key, r.status, r.body)
	}
}

// TestLedgerClientKeyCancelsAReceipt: the other order. The client used the keys "receipt/1" to
// "receipt/3" for its own deposits before its transfer's receipt job ran; the receipt is still
// delivered (docs/ledger.md: "a receiver that deduplicates by the key has each receipt once").
// Under the transfer's principal the job's claim met the client's request (ErrMismatch) and
// River cancelled it: the receipt was never sent.
func TestLedgerClientKeyCancelsAReceipt(t *testing.T) {
	t.Parallel()
	rcv := newReceiver(t, false)
	s := startServer(t, map[string]string{"RECEIPT_URL": rcv.url})
	_, token := s.principal("alice")
	from, to := seedAccounts(t, s, token)
	// River's job ids come from its sequence; the next receipt job takes the next one.
	var next int64
	if err := s.pool.QueryRow(t.Context(), `SELECT coalesce(max(id), 0) + 1 FROM river.river_job`).Scan(&next); err != nil {
		t.Fatal(err)
	}
	for i := next; i < next+3; i++ { // the next few ids, in case the sequence skips
		if r := s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", to), token, fmt.Sprintf("receipt/%d", i), `{"amount":1}`); r.status != 201 {
			t.Fatalf("deposit under receipt/%d: %+v", i, r)
		}
	}
	tr := s.call("POST", "/v1/transfers", token, "t-1", fmt.Sprintf(`{"from":%d,"to":%d,"amount":25}`, from, to))
	if tr.status != 201 {
		t.Fatalf("transfer: %+v", tr)
	}
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		if effects, _ := rcv.figures(); len(effects) == 1 {
			return
		}
		if s.count(`SELECT count(*) FROM river.river_job WHERE kind = 'receipt' AND state IN ('cancelled', 'discarded')`) > 0 {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	var state, errs string
	_ = s.pool.QueryRow(t.Context(), `SELECT state::text, errors::text FROM river.river_job WHERE kind = 'receipt'`).Scan(&state, &errs)
	effects, _ := rcv.figures()
	t.Errorf("the transfer's receipt was never delivered (receiver has %d receipts; job %s: %.300s): the client's key %q, a valid key of its own, cancelled the server's receipt job",
		len(effects), state, errs, fmt.Sprintf("receipt/%d", next))
}

// TestLedgerDepositToNoAccountIsNotBalanceLimit: a deposit of 2^63 (or 1e25) into an account
// that does not exist, or another principal's, is 404 account_not_found, as for any amount
// (docs/ledger.md), and as a transfer of it between missing accounts is. It was 422
// balance_limit, stored as the key's answer, though there was no balance to take past anything.
func TestLedgerDepositToNoAccountIsNotBalanceLimit(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	_, alice := s.principal("alice")
	_, bob := s.principal("bob")
	foreign := reviewAccount(t, s, bob, "EUR")
	own := reviewAccount(t, s, alice, "EUR")
	for _, id := range []int{987654, foreign} {
		for _, amt := range []string{"9223372036854775808", "1e25"} {
			r := s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", id), alice, fmt.Sprintf("d-%d-%s", id, amt), `{"amount":`+amt+`}`)
			if r.status != 404 || !strings.Contains(r.body, `"code":"account_not_found"`) {
				t.Errorf("deposit of %s into account %d (not alice's): %d %s; want 404 account_not_found", amt, id, r.status, r.body)
			}
		}
	}
	// The transfer route answers the same situation 404.
	r := s.call("POST", "/v1/transfers", alice, "tr", fmt.Sprintf(`{"from":%d,"to":%d,"amount":9223372036854775808}`, 987654, own))
	if r.status != 404 {
		t.Errorf("transfer of 2^63 from a missing account: %d %s", r.status, r.body)
	}
}

// ---------------------------------------------------------------------------------------
// pins (checked, correct; not pinned elsewhere)
// ---------------------------------------------------------------------------------------

// TestLedgerSteppedInsufficientIsStored: docs/ledger.md: stepped payouts' final errors
// include "422 (insufficient_funds)", and "### insufficient_funds ... Stored: a retry with the
// same key gets the same answer even if money arrived meanwhile". The refused reservation
// leaves no reservation, no provider call, no version change.
func TestLedgerSteppedInsufficientIsStored(t *testing.T) {
	t.Parallel()
	s := startServer(t, map[string]string{"PAYOUT_PROVIDER_DELAY": "0"})
	_, tok := s.principal("p")
	a := reviewAccount(t, s, tok, "EUR")
	reviewDeposit(t, s, tok, a, 10)
	body := fmt.Sprintf(`{"account":%d,"amount":50}`, a)
	first := s.call("POST", "/v1/stepped-payouts", tok, "sp", body)
	if first.status != 422 || !strings.Contains(first.body, `"code":"insufficient_funds"`) {
		t.Fatalf("stepped payout over the balance: %+v", first)
	}
	reviewDeposit(t, s, tok, a, 100)
	again := s.call("POST", "/v1/stepped-payouts", tok, "sp", body)
	if again.status != 422 || again.body != first.body || again.header.Get("Idempotent-Replayed") != "true" {
		t.Errorf("retry after money arrived: %+v; want the stored 422 replayed", again)
	}
	if bal, ver := reviewState(t, s, a); bal != 110 || ver != 3 {
		t.Errorf("balance %d version %d, want 110 and 3", bal, ver)
	}
	if n := s.count(`SELECT count(*) FROM ledger.payout_reservations`) + s.count(`SELECT count(*) FROM provider.payouts`); n != 0 {
		t.Errorf("%d reservations or provider payouts after a refused stepped payout", n)
	}
}

// TestLedgerSteppedReservationMovesTheETag: docs/ledger.md: "An account's ETag is its
// version, which every deposit, transfer and stepped payout's reservation increments"; a plain
// payout "does not change balances" (nor the version).
func TestLedgerSteppedReservationMovesTheETag(t *testing.T) {
	t.Parallel()
	s := startServer(t, map[string]string{"PAYOUT_PROVIDER_DELAY": "0"})
	_, tok := s.principal("p")
	a := reviewAccount(t, s, tok, "EUR")
	reviewDeposit(t, s, tok, a, 100) // version 2
	path := fmt.Sprintf("/v1/accounts/%d", a)
	if r := s.call("POST", "/v1/payouts", tok, "po", fmt.Sprintf(`{"account":%d,"amount":30}`, a)); r.status != 201 {
		t.Fatalf("payout: %+v", r)
	}
	if g := s.call("GET", path, tok, "", "", "If-None-Match", `"2"`); g.status != 304 {
		t.Errorf("after a plain payout: GET with If-None-Match \"2\": %d, want 304 (nothing changed)", g.status)
	}
	if r := s.call("POST", "/v1/stepped-payouts", tok, "sp", fmt.Sprintf(`{"account":%d,"amount":30}`, a)); r.status != 201 {
		t.Fatalf("stepped payout: %+v", r)
	}
	g := s.call("GET", path, tok, "", "", "If-None-Match", `"2"`)
	if g.status != 200 || g.header.Get("ETag") != `"3"` || g.json(t)["balance"] != float64(70) {
		t.Errorf("after a stepped payout: %d ETag %q %s; want 200, ETag \"3\", balance 70", g.status, g.header.Get("ETag"), g.body)
	}
}

// TestLedgerForeignTransfersAndPayoutsAre404: "a principal sees only its own accounts"
// (docs/ledger.md); GET /v1/transfers/{id} and GET /v1/payouts/{id} (plain and stepped) of
// another principal are 404 transfer_not_found / payout_not_found, as an id never used, for GET
// and HEAD alike.
func TestLedgerForeignTransfersAndPayoutsAre404(t *testing.T) {
	t.Parallel()
	s := startServer(t, map[string]string{"PAYOUT_PROVIDER_DELAY": "0"})
	_, alice := s.principal("alice")
	_, bob := s.principal("bob")
	a, b := reviewAccount(t, s, alice, "EUR"), reviewAccount(t, s, alice, "EUR")
	reviewDeposit(t, s, alice, a, 100)
	locs := []string{}
	for _, c := range []struct{ path, body string }{
		{"/v1/transfers", fmt.Sprintf(`{"from":%d,"to":%d,"amount":5}`, a, b)},
		{"/v1/payouts", fmt.Sprintf(`{"account":%d,"amount":5}`, a)},
		{"/v1/stepped-payouts", fmt.Sprintf(`{"account":%d,"amount":5}`, a)},
	} {
		r := s.call("POST", c.path, alice, "k"+c.path, c.body)
		if r.status != 201 {
			t.Fatalf("%s: %+v", c.path, r)
		}
		locs = append(locs, r.header.Get("Location"))
	}
	for _, loc := range locs {
		if r := s.call("GET", loc, alice, "", ""); r.status != 200 {
			t.Errorf("alice GET %s: %d", loc, r.status)
		}
		mine := s.call("GET", loc, bob, "", "")
		never := s.call("GET", loc[:strings.LastIndex(loc, "/")+1]+"987654", bob, "", "")
		if mine.status != 404 || mine.json(t)["code"] != never.json(t)["code"] || mine.json(t)["detail"] != never.json(t)["detail"] {
			t.Errorf("bob GET %s: %d %s; an id never used: %s", loc, mine.status, mine.body, never.body)
		}
		if h := s.call("HEAD", loc, bob, "", ""); h.status != 404 || h.body != "" {
			t.Errorf("bob HEAD %s: %d %q", loc, h.status, h.body)
		}
	}
}

// TestLedgerConcurrentPayoutDuplicatesPayOnce: six copies of one payout under one key,
// sent at once through two server processes while the provider takes 400 ms: every answer is the
// one 201 (duplicates wait, docs/http.md), the provider acted on one call and answered no repeat
// (GET /v1/provider/calls/{key}: calls 1, repeats 0), one ledger payout.
func TestLedgerConcurrentPayoutDuplicatesPayOnce(t *testing.T) {
	t.Parallel()
	env := map[string]string{"PAYOUT_PROVIDER_DELAY": "400ms"}
	s := startServer(t, env)
	s2 := serveOn(t, s.db, env)
	_, tok := s.principal("p")
	a := reviewAccount(t, s, tok, "EUR")
	body := fmt.Sprintf(`{"account":%d,"amount":9}`, a)
	out := make([]resp, 6)
	done := make(chan int)
	for i := range out {
		go func() {
			srv := s
			if i%2 == 1 {
				srv = s2
			}
			out[i] = srv.call("POST", "/v1/payouts", tok, "same", body)
			done <- i
		}()
	}
	for range out {
		<-done
	}
	for _, r := range out {
		if r.status != 201 || r.body != out[0].body {
			t.Errorf("copy: %d %s; want the one 201 %s", r.status, r.body, out[0].body)
		}
	}
	key, _ := out[0].json(t)["provider_key"].(string)
	c := s.call("GET", "/v1/provider/calls/"+key, tok, "", "")
	if c.status != 200 || c.json(t)["calls"] != float64(1) || c.json(t)["repeats"] != float64(0) || c.json(t)["provider_ref"] != out[0].json(t)["provider_ref"] {
		t.Errorf("provider calls: %s; want calls 1, repeats 0", c.body)
	}
	if n := s.count(`SELECT count(*) FROM ledger.payouts`); n != 1 {
		t.Errorf("%d ledger payouts, want 1", n)
	}
}

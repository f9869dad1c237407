package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/pgidem/pgidem/internal/pgcluster"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestSteppedPayoutKilledBetweenSteps: a payout in steps (reserve, pay, settle, answer) run by
// the real server as a child process, killed with SIGKILL after each step in turn (the step
// committed, its recovery point with it; the server pauses PAYOUT_STEP_PAUSE after each step,
// and the kill comes once the key's row shows the step), restarted, and the client retried
// until it gets its answer. For every kill point, and for a run without a kill: one
// reservation, one call that reached the provider, one settlement, the balance down by the
// amount once, and one answer (a further retry replays it byte for byte).
func TestSteppedPayoutKilledBetweenSteps(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	principal, token := s.principal("stepper")
	port, err := pgcluster.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	base := append(os.Environ(), "DATABASE_URL="+s.db, "LISTEN_ADDR="+fmt.Sprintf("127.0.0.1:%d", port),
		"CLEANUP_INTERVAL=0", "PAYOUTS_LEASE=1s", "PAYOUT_PROVIDER_DELAY=0", "LOG_LEVEL=error")
	p := &process{t: t, bin: serverBinary(t), addr: fmt.Sprintf("127.0.0.1:%d", port)}
	send := func(key, body string) (int, http.Header, string) {
		return pgtest.Send(t, context.Background(), "POST", "http://"+p.addr+"/v1/stepped-payouts", body,
			"Authorization", "Bearer "+token, "Idempotency-Key", key, "Content-Type", "application/json")
	}
	ctx := context.Background()
	const amount = 700
	for _, kill := range []string{"", "reserve", "pay", "settle"} {
		name := "kill after " + kill
		if kill == "" {
			name = "no kill"
		}
		acc := int(s.call("POST", "/v1/accounts", token, "", `{"name":"main","currency":"EUR"}`).json(t)["id"].(float64))
		if r := s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", acc), token, "", `{"amount":10000}`); r.status != 201 {
			t.Fatalf("deposit: %+v", r)
		}
		key := "step-" + kill
		body := fmt.Sprintf(`{"account":%d,"amount":%d}`, acc, amount)
		// The first attempt pauses 2 s after each step: the kill comes in that gap.
		p.env = append(base, "PAYOUT_STEP_PAUSE=2s")
		providerBefore := s.count(`SELECT count(*) FROM provider.payouts`)
		p.start()
		first := make(chan int, 1)
		go func() { status, _, _ := send(key, body); first <- status }()
		killed := false
		if kill != "" {
			pgtest.WaitFor(t, s.pool, `SELECT count(*) FROM idem.idempotency_keys
				WHERE principal_id = $1 AND key = $2 AND recovery_point = $3`, principal, key, kill)
			p.kill()
			killed = true
			// What the kill left: the steps up to the kill point, none after it.
			atKill := fmt.Sprintf("reservations %d, provider payouts %d, settlements %d",
				s.count(`SELECT count(*) FROM ledger.payout_reservations WHERE principal_id = $1 AND idempotency_key = $2`, principal, key),
				s.count(`SELECT count(*) FROM provider.payouts`)-providerBefore,
				s.count(`SELECT count(*) FROM ledger.payouts WHERE principal_id = $1 AND idempotency_key = $2`, principal, key))
			want := map[string]string{"reserve": "reservations 1, provider payouts 0, settlements 0",
				"pay": "reservations 1, provider payouts 1, settlements 0", "settle": "reservations 1, provider payouts 1, settlements 1"}[kill]
			t.Logf("%-18s at the kill: %s", "kill after "+kill, atKill)
			if atKill != want {
				t.Fatalf("kill after %s left %s, want %s", kill, atKill, want)
			}
			p.env = base // the restarted server runs the remaining steps without pauses
		}
		if !killed {
			p.env = base
		}
		if killed {
			p.start()
		}
		var status int
		var answer string
		for deadline := time.Now().Add(20 * time.Second); ; {
			status, _, answer = send(key, body)
			if status == http.StatusCreated {
				break
			}
			if status != http.StatusConflict || time.Now().After(deadline) {
				t.Fatalf("%s: the retry: %d %s", name, status, answer)
			}
			time.Sleep(200 * time.Millisecond)
		}
		var out map[string]any
		if err := json.Unmarshal([]byte(answer), &out); err != nil {
			t.Fatal(err)
		}
		pk, _ := out["provider_key"].(string)
		var calls int
		var ref string
		if err := s.pool.QueryRow(ctx, `SELECT calls, ref FROM provider.payouts WHERE idempotency_key = $1`, pk).Scan(&calls, &ref); err != nil {
			t.Fatalf("%s: the provider's record of %q: %v", name, pk, err)
		}
		reservations := s.count(`SELECT count(*) FROM ledger.payout_reservations WHERE principal_id = $1 AND idempotency_key = $2`, principal, key)
		settled := s.count(`SELECT count(*) FROM ledger.payout_reservations WHERE principal_id = $1 AND idempotency_key = $2 AND payout_id IS NOT NULL`, principal, key)
		payouts := s.count(`SELECT count(*) FROM ledger.payouts WHERE principal_id = $1 AND idempotency_key = $2`, principal, key)
		balance := s.count(`SELECT balance FROM ledger.accounts WHERE id = $1`, acc)
		_, replayHdr, replay := send(key, body)
		t.Logf("%-18s reservations %d, provider calls %d, settlements %d (payouts %d), balance %d, answer %d, replay same %v (%s)",
			name, reservations, calls, settled, payouts, balance, status, replay == answer, replayHdr.Get("Idempotent-Replayed"))
		if reservations != 1 || calls != 1 || settled != 1 || payouts != 1 || balance != 10000-amount {
			t.Errorf("%s: reservations %d, provider calls %d, settlements %d, payouts %d, balance %d; want 1, 1, 1, 1, %d",
				name, reservations, calls, settled, payouts, balance, 10000-amount)
		}
		if out["provider_ref"] != ref {
			t.Errorf("%s: the answer %v names provider reference %v, the provider's is %s", name, out, out["provider_ref"], ref)
		}
		if replay != answer || replayHdr.Get("Idempotent-Replayed") != "true" {
			t.Errorf("%s: one answer: the retry after it got %q (replayed %q), want %q replayed", name, replay,
				replayHdr.Get("Idempotent-Replayed"), answer)
		}
		if n := s.count(`SELECT count(*) FROM idem.idempotency_keys WHERE principal_id = $1 AND key = $2 AND state = 'c' AND recovery_saved IS NULL`, principal, key); n != 1 {
			t.Errorf("%s: the key is not completed with its steps cleared", name)
		}
		p.kill()
		if !killed {
			if st := <-first; st != http.StatusCreated {
				t.Errorf("no kill: the first attempt got %d", st)
			}
		}
	}
}

// TestSteppedPayoutsBeyondThePoolSize: twice as many concurrent stepped payouts as the pool has
// connections, each on an account of its own, and a deposit beside them. The pay step called
// the simulated provider (which writes through the same pool) while its step held a
// connection: with as many payouts in that step as connections, each held one and waited for
// another, until the leases were lost and every payout answered 500 after 2 s, its money
// reserved (with the 2 s lease it ran under then).
func TestSteppedPayoutsBeyondThePoolSize(t *testing.T) {
	t.Parallel()
	const n = 8
	// A lease of 10 s: a starved pool waits it out (then 500s), a healthy one takes about
	// 0.6 s; the bound below sits between with room on both sides for a loaded machine.
	s := startServer(t, map[string]string{"DATABASE_POOL_SIZE": "4", "PAYOUTS_LEASE": "10s", "PAYOUT_PROVIDER_DELAY": "300ms"})
	_, token := s.principal("steppool")
	accounts := make([]int, n+1)
	for i := range accounts {
		accounts[i] = int(s.call("POST", "/v1/accounts", token, "", `{"name":"a","currency":"EUR"}`).json(t)["id"].(float64))
		if r := s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", accounts[i]), token, "", `{"amount":1000}`); r.status != http.StatusCreated {
			t.Fatalf("the deposit: %+v", r)
		}
	}
	var wg sync.WaitGroup
	answers := make([]resp, n)
	began := time.Now()
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			answers[i] = s.call("POST", "/v1/stepped-payouts", token, fmt.Sprintf("sp-%d", i), fmt.Sprintf(`{"account":%d,"amount":10}`, accounts[i]))
		}()
	}
	deposit := s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", accounts[n]), token, "dep", `{"amount":1}`)
	wg.Wait()
	took := time.Since(began)
	for i, r := range answers {
		if r.status != http.StatusCreated {
			t.Errorf("stepped payout %d: %d %s", i, r.status, r.body)
		}
	}
	if deposit.status != http.StatusCreated {
		t.Errorf("the deposit beside them: %d %s", deposit.status, deposit.body)
	}
	// Two rounds of 300 ms on four connections; a starved pool waits out the 10 s leases.
	if took > 5*time.Second {
		t.Errorf("%d stepped payouts with a 300 ms provider took %v", n, took.Round(time.Millisecond))
	}
	if got := s.count(`SELECT count(*) FROM ledger.payouts`); got != n {
		t.Errorf("%d payouts recorded, want %d", got, n)
	}
}

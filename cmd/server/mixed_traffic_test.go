package main

import (
	"fmt"
	"math/rand/v2"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"
)

// mixOp is one keyed request of the mix and its first answer.
type mixOp struct {
	method, path, key, body string
	first                   resp
}

// runMix runs workers concurrent clients of one principal against a few shared accounts,
// each sending keyed deposits, transfers (both directions), payouts and stepped payouts, and
// GETs of the accounts, for dur. It returns the ops and every wrong answer seen: a 5xx, a
// 409, or anything else the docs do not list for the route.
func runMix(t *testing.T, s *testServer, token string, ids []int, workers int, dur time.Duration, steppedShare int) ([]*mixOp, []string) {
	t.Helper()
	var mu sync.Mutex
	var ops []*mixOp
	var wrong []string
	var wg sync.WaitGroup
	deadline := time.Now().Add(dur)
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), uint64(time.Now().UnixNano())))
			for n := 0; time.Now().Before(deadline); n++ {
				op := &mixOp{method: "POST", key: fmt.Sprintf("mix-%d-%d", w, n)}
				a := ids[rng.IntN(len(ids))]
				b := ids[rng.IntN(len(ids)-1)]
				if b >= a {
					b = ids[(indexOf(ids, b)+1)%len(ids)]
				}
				if a == b {
					b = ids[(indexOf(ids, a)+1)%len(ids)]
				}
				roll := rng.IntN(100)
				switch {
				case roll < 25:
					op.path, op.body = fmt.Sprintf("/v1/accounts/%d/deposits", a), fmt.Sprintf(`{"amount":%d}`, 1+rng.IntN(50))
				case roll < 60:
					op.path, op.body = "/v1/transfers", fmt.Sprintf(`{"from":%d,"to":%d,"amount":%d}`, a, b, 1+rng.IntN(60))
				case roll < 60+steppedShare:
					op.path, op.body = "/v1/stepped-payouts", fmt.Sprintf(`{"account":%d,"amount":%d}`, a, 1+rng.IntN(20))
				case roll < 90:
					op.path, op.body = "/v1/payouts", fmt.Sprintf(`{"account":%d,"amount":%d}`, a, 1+rng.IntN(20))
				default:
					r := s.call("GET", fmt.Sprintf("/v1/accounts/%d", a), token, "", "")
					if r.status != 200 || r.header.Get("ETag") == "" {
						mu.Lock()
						wrong = append(wrong, fmt.Sprintf("GET account: %d %s", r.status, r.body))
						mu.Unlock()
					}
					continue
				}
				op.first = s.call(op.method, op.path, token, op.key, op.body, "Content-Type", "application/json")
				ok := op.first.status == 201 ||
					(op.first.status == 422 && strings.Contains(op.first.body, "insufficient_funds") &&
						(op.path == "/v1/transfers" || op.path == "/v1/stepped-payouts"))
				mu.Lock()
				ops = append(ops, op)
				if !ok {
					wrong = append(wrong, fmt.Sprintf("%s %s %s: %d %s", op.path, op.key, op.body, op.first.status, op.first.body))
				}
				mu.Unlock()
			}
		}(w)
	}
	wg.Wait()
	return ops, wrong
}

func indexOf(ids []int, v int) int {
	for i, x := range ids {
		if x == v {
			return i
		}
	}
	return 0
}

// checkBooks checks every account's balance against its deposits, transfers and stepped
// payouts' reservations, and each key's effects: at most one per key.
func checkBooks(t *testing.T, s *testServer, ids []int) {
	t.Helper()
	for _, id := range ids {
		bal := s.count(`SELECT balance FROM ledger.accounts WHERE id = $1`, id)
		want := s.count(`SELECT (coalesce((SELECT sum(amount) FROM ledger.deposits WHERE account_id = $1), 0)
			+ coalesce((SELECT sum(amount) FROM ledger.transfers WHERE to_id = $1), 0)
			- coalesce((SELECT sum(amount) FROM ledger.transfers WHERE from_id = $1), 0)
			- coalesce((SELECT sum(amount) FROM ledger.payout_reservations WHERE account_id = $1), 0))::int`, id)
		if bal != want {
			t.Errorf("account %d: balance %d, its rows say %d", id, bal, want)
		}
	}
	for _, q := range []string{
		`SELECT count(*) FROM (SELECT idempotency_key FROM ledger.deposits WHERE idempotency_key IS NOT NULL GROUP BY 1 HAVING count(*) > 1) x`,
		`SELECT count(*) FROM (SELECT idempotency_key FROM ledger.transfers WHERE idempotency_key IS NOT NULL GROUP BY 1 HAVING count(*) > 1) x`,
		`SELECT count(*) FROM (SELECT idempotency_key FROM ledger.payouts WHERE idempotency_key IS NOT NULL GROUP BY 1 HAVING count(*) > 1) x`,
		`SELECT count(*) FROM (SELECT idempotency_key FROM ledger.payout_reservations GROUP BY 1 HAVING count(*) > 1) x`,
		`SELECT count(*) FROM ledger.payout_reservations WHERE payout_id IS NULL`,
	} {
		if n := s.count(q); n != 0 {
			t.Errorf("%s: %d", q, n)
		}
	}
}

// checkReplays repeats every op that got a final answer: the repeat must be its answer.
func checkReplays(t *testing.T, s *testServer, token string, ops []*mixOp) {
	t.Helper()
	bad := 0
	for _, op := range ops {
		if op.first.status != 201 && op.first.status != 422 {
			continue
		}
		r := s.call(op.method, op.path, token, op.key, op.body, "Content-Type", "application/json")
		if r.status != op.first.status || r.body != op.first.body || r.header.Get("Idempotent-Replayed") != "true" {
			bad++
			if bad <= 5 {
				t.Errorf("repeat of %s %s: %d %s, first %d %s", op.path, op.key, r.status, r.body, op.first.status, op.first.body)
			}
		}
	}
	if bad > 0 {
		t.Errorf("%d of %d repeats did not get the first answer", bad, len(ops))
	}
}

// TestMixedTrafficKeepsTheBooks: a review of the reference server under concurrency (D188):
// 8 clients of the documented routes (keyed deposits, transfers both ways, payouts, stepped
// payouts, GETs) on 3 shared accounts, at the default pool of a 2-CPU machine. Every keyed
// request gets 201 or a stored 422 insufficient_funds, its repeat the first answer, every
// balance equals its rows, and no key took effect twice.
func TestMixedTrafficKeepsTheBooks(t *testing.T) {
	t.Parallel()
	s := startServer(t, map[string]string{"DATABASE_POOL_SIZE": "4", "PAYOUT_PROVIDER_DELAY": "5ms", "PAYOUTS_LEASE": "2s"})
	_, token := s.principal("mix")
	ids := fundedAccounts(t, s, token, 3, 100000)
	ops, wrong := runMix(t, s, token, ids, 8, 4*time.Second, 10)
	if len(ops) < 100 {
		t.Errorf("only %d keyed requests in 4 s", len(ops))
	}
	if len(wrong) > 0 {
		t.Errorf("%d wrong answers of %d, the first: %s", len(wrong), len(ops), strings.Join(wrong[:min(5, len(wrong))], "\n"))
	}
	checkBooks(t, s, ids)
	checkReplays(t, s, token, ops)
}

// fundedAccounts opens n accounts of the principal whose token is given, each with a deposit of seed.
func fundedAccounts(t *testing.T, s *testServer, token string, n, seed int) []int {
	t.Helper()
	ids := make([]int, n)
	for i := range ids {
		ids[i] = int(s.call("POST", "/v1/accounts", token, "", `{"name":"a","currency":"EUR"}`).json(t)["id"].(float64))
		if r := s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", ids[i]), token, "", fmt.Sprintf(`{"amount":%d}`, seed)); r.status != http.StatusCreated {
			t.Fatalf("seed: %+v", r)
		}
	}
	return ids
}

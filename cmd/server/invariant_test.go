package main

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pgidem/pgidem/internal/client"
)

// TestMoneyInvariant: concurrent clients send transfers and deposits, retrying under the
// same keys with random client-side timeouts. Afterwards every balance equals what its
// deposits and transfers say, no key has more than one effect, every effect has its key,
// and every 2xx a client saw is what is stored.
func TestMoneyInvariant(t *testing.T) {
	t.Parallel()
	s := startServer(t, map[string]string{"IDEMPOTENCY_LOCK_TIMEOUT": "150ms"})
	_, token := s.principal("money")
	const accounts, workers, ops = 6, 12, 25
	ids := make([]int, accounts)
	for i := range ids {
		r := s.call("POST", "/v1/accounts", token, fmt.Sprintf("acct-%d", i), `{"name":"a","currency":"EUR"}`)
		ids[i] = int(r.json(t)["id"].(float64))
		if r := s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", ids[i]), token, fmt.Sprintf("seed-%d", i), `{"amount":5000}`); r.status != 201 {
			t.Fatalf("seed deposit: %+v", r)
		}
	}

	c := client.NewLedger(s.url, token)
	c.MaxAttempts = -1 // until the answer is final, however long the storm
	var mu sync.Mutex
	seen := map[string]string{} // key -> body of a 2xx the client saw
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 42))
			for op := range ops {
				key := fmt.Sprintf("w%d-op%d", w, op)
				var path, body string
				if rng.IntN(10) < 7 {
					from, to := rng.IntN(accounts), rng.IntN(accounts-1)
					if to >= from {
						to++
					}
					path = "/v1/transfers"
					body = fmt.Sprintf(`{"from":%d,"to":%d,"amount":%d}`, ids[from], ids[to], 1+rng.IntN(900))
				} else {
					path = fmt.Sprintf("/v1/accounts/%d/deposits", ids[rng.IntN(accounts)])
					body = fmt.Sprintf(`{"amount":%d}`, 1+rng.IntN(300))
				}
				for attempt := 0; attempt < 6; attempt++ {
					timeout := time.Duration(1+rng.IntN(60)) * time.Millisecond
					if attempt == 5 {
						timeout = 10 * time.Second
					}
					// One attempt through the client (MaxAttempts 1): it says whether the answer
					// is final; a lost response, 409 in progress or a 5xx is retried here with
					// the same key and a new random timeout.
					one := *c
					one.AttemptTimeout, one.MaxAttempts = timeout, 1
					res, err := one.Send(context.Background(), "POST", path, key, json.RawMessage(body))
					if err != nil {
						continue
					}
					status, got := res.Status, strings.TrimSpace(string(res.Body))
					if status/100 == 2 {
						mu.Lock()
						if prev, ok := seen[key]; ok && prev != got {
							t.Errorf("key %s answered %s and then %s", key, prev, got)
						}
						seen[key] = got
						mu.Unlock()
					}
					if status != http.StatusCreated && status != http.StatusUnprocessableEntity {
						t.Errorf("key %s: status %d %s", key, status, got)
					}
					break
				}
			}
		}()
	}
	wg.Wait()
	// Let cancelled requests finish rolling back.
	for i := 0; i < 200 && s.count(`SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND state LIKE '%transaction%'`) > 0; i++ {
		time.Sleep(10 * time.Millisecond)
	}

	if n := s.count(`SELECT count(*) FROM ledger.accounts a WHERE a.balance <>
		  (SELECT coalesce(sum(amount), 0) FROM ledger.deposits d WHERE d.account_id = a.id)
		+ (SELECT coalesce(sum(amount), 0) FROM ledger.transfers t WHERE t.to_id = a.id)
		- (SELECT coalesce(sum(amount), 0) FROM ledger.transfers t WHERE t.from_id = a.id)`); n != 0 {
		t.Errorf("%d balances disagree with their operations", n)
	}
	if n := s.count(`SELECT count(*) FROM (SELECT idempotency_key FROM (SELECT idempotency_key FROM ledger.deposits
		WHERE idempotency_key IS NOT NULL UNION ALL SELECT idempotency_key FROM ledger.transfers WHERE idempotency_key IS NOT NULL) e
		GROUP BY idempotency_key HAVING count(*) > 1) dup`); n != 0 {
		t.Errorf("%d keys took effect more than once", n)
	}
	if n := s.count(`SELECT count(*) FROM (SELECT idempotency_key FROM ledger.deposits UNION ALL SELECT idempotency_key FROM ledger.transfers) e
		WHERE NOT EXISTS (SELECT FROM idem.idempotency_keys k WHERE k.key = e.idempotency_key AND k.state = 'c')`); n != 0 {
		t.Errorf("%d effects without their completed key", n)
	}
	if n := s.count(`SELECT (SELECT sum(balance) FROM ledger.accounts) - (SELECT sum(amount) FROM ledger.deposits)`); n != 0 {
		t.Errorf("money was created or destroyed: %d", n)
	}
	mu.Lock()
	defer mu.Unlock()
	for key, body := range seen {
		var stored string
		if err := s.pool.QueryRow(context.Background(), `SELECT btrim(convert_from(response_body, 'UTF8'), E'\n')
			FROM idem.idempotency_keys WHERE key = $1 AND state = 'c'`, key).Scan(&stored); err != nil || stored != body {
			t.Errorf("key %s: the client saw %s, stored %q (%v)", key, body, stored, err)
		}
		var out struct{ ID int }
		_ = json.Unmarshal([]byte(body), &out)
		table := "ledger.transfers"
		if strings.Contains(body, "account_id") {
			table = "ledger.deposits"
		}
		if n := s.count(`SELECT count(*) FROM `+table+` WHERE id = $1 AND idempotency_key = $2`, out.ID, key); n != 1 {
			t.Errorf("key %s: the effect the client saw (%s %d) does not exist", key, table, out.ID)
		}
	}
	t.Logf("%d operations, %d answered 2xx, %d transfers and %d deposits took effect", workers*ops, len(seen),
		s.count(`SELECT count(*) FROM ledger.transfers`), s.count(`SELECT count(*) FROM ledger.deposits`)-accounts)
}

package main

import (
	"context"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestRetryStormCannotStarveTheAPI: one keyed transfer is held (its account's row is locked
// by another transaction) while 40 clients retry it with the same key, again at once on
// every 409, and 4 other clients send unrelated keyless deposits. At the default pool size
// (DefaultPoolSize: 4 connections on a 2-core machine) and its default wait slots (a quarter
// of the pool), the unrelated requests keep completing during the hold (the duplicates wait
// in Go, without a connection), every duplicate ends with the first request's answer or a
// 409 with Retry-After, and exactly one transfer takes effect.
func TestRetryStormCannotStarveTheAPI(t *testing.T) {
	t.Parallel()
	const hold, duplicates, others = 4 * time.Second, 40, 4
	s := startServer(t, map[string]string{"IDEMPOTENCY_LOCK_TIMEOUT": "1s"})
	_, token := s.principal("storm")
	id := func() int {
		return int(s.call("POST", "/v1/accounts", token, "", `{"name":"a","currency":"EUR"}`).json(t)["id"].(float64))
	}
	from, to, other := id(), id(), id()
	if r := s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", from), token, "", `{"amount":100}`); r.status != 201 {
		t.Fatalf("seed: %+v", r)
	}
	ctx := context.Background()
	holder, err := s.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = holder.Rollback(ctx) }()
	pgtest.Exec(t, holder, `SELECT 1 FROM ledger.accounts WHERE id = $1 FOR UPDATE`, from)

	body := fmt.Sprintf(`{"from":%d,"to":%d,"amount":10}`, from, to)
	first := make(chan resp, 1)
	go func() { first <- s.call("POST", "/v1/transfers", token, "storm", body) }()
	pgtest.WaitFor(t, s.pool, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'`)

	start := time.Now()
	released := start.Add(hold)
	var stop atomic.Bool
	var wg sync.WaitGroup
	var mu sync.Mutex
	var duringHold []time.Duration // latencies of unrelated requests answered while the hold lasted
	var unrelated, conflicts, replays, missingRetryAfter atomic.Int64
	var wrong []string
	for range others {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for !stop.Load() {
				t0 := time.Now()
				r := s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", other), token, "", `{"amount":1}`)
				if r.status != 201 {
					mu.Lock()
					wrong = append(wrong, fmt.Sprintf("unrelated deposit: %d %s", r.status, r.body))
					mu.Unlock()
					return
				}
				unrelated.Add(1)
				if time.Now().Before(released) {
					mu.Lock()
					duringHold = append(duringHold, time.Since(t0))
					mu.Unlock()
				}
			}
		}()
	}
	answers := make(chan resp, duplicates)
	for range duplicates {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				r := s.call("POST", "/v1/transfers", token, "storm", body)
				switch {
				case r.status == http.StatusConflict && strings.Contains(r.body, "request_in_progress"):
					conflicts.Add(1)
					if r.header.Get("Retry-After") == "" {
						missingRetryAfter.Add(1)
					}
					continue // an impatient client: again, at once
				case r.header.Get("Idempotent-Replayed") == "true":
					replays.Add(1)
				}
				answers <- r
				return
			}
		}()
	}
	time.Sleep(time.Until(released))
	_ = holder.Rollback(ctx)
	firstAnswer := <-first
	stop.Store(true)
	wg.Wait()
	close(answers)

	if len(wrong) > 0 {
		t.Fatalf("%d unrelated requests failed, first: %s", len(wrong), wrong[0])
	}
	if firstAnswer.status != 201 {
		t.Fatalf("the held transfer: %+v", firstAnswer)
	}
	for r := range answers {
		if r.status != 201 || r.body != firstAnswer.body {
			t.Fatalf("a duplicate ended with %d %s, want the first answer", r.status, r.body)
		}
	}
	if missingRetryAfter.Load() > 0 {
		t.Fatalf("%d of %d 409s lacked Retry-After", missingRetryAfter.Load(), conflicts.Load())
	}
	if n := s.count(`SELECT count(*) FROM ledger.transfers`); n != 1 {
		t.Fatalf("%d transfers took effect, want 1", n)
	}
	mu.Lock()
	defer mu.Unlock()
	// Liveness, not speed: many unrelated requests during the hold, not one per client
	// stuck behind the duplicates (a starved pool answers about one each, after the hold).
	if len(duringHold) < 10*others {
		t.Fatalf("only %d unrelated requests were answered during the %s hold", len(duringHold), hold)
	}
	slices.Sort(duringHold)
	pct := func(p float64) time.Duration { return duringHold[int(p*float64(len(duringHold)-1))] }
	t.Logf("during the %s hold: %d unrelated requests answered, p50 %s, p99 %s; %d duplicates: %d 409s, %d replays",
		hold, len(duringHold), pct(0.5).Round(10*time.Microsecond), pct(0.99).Round(10*time.Microsecond),
		duplicates, conflicts.Load(), replays.Load())
}

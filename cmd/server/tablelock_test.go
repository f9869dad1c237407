package main

import (
	"context"
	"fmt"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// TestLockedKeyTableDegradesToFastAnswers (issue 31): the key table is locked in ACCESS
// EXCLUSIVE mode for ten seconds, as a migration's swap, VACUUM FULL or pg_repack would lock
// it, while 8 clients send keyed deposits and 2 others read an account without a key, at the
// default pool size. Keyed requests are answered at once (503 store_unavailable with
// Retry-After), hold no connection waiting on the lock, and the unkeyed reads keep flowing.
// Before, each keyed request waited out the function's 2 s lock timeout (the compilation of
// idem_begin waited on the table under it) on a pool connection, and the whole API stalled.
func TestLockedKeyTableDegradesToFastAnswers(t *testing.T) {
	t.Parallel()
	const hold, keyedClients, unkeyedClients = 10 * time.Second, 8, 2
	s := startServer(t, nil)
	_, token := s.principal("locked")
	account := int(s.call("POST", "/v1/accounts", token, "", `{"name":"a","currency":"EUR"}`).json(t)["id"].(float64))
	deposit := func(key string) resp {
		return s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", account), token, key, `{"amount":1}`)
	}
	for i := range 20 { // every pool connection has compiled the functions before
		if r := deposit(fmt.Sprintf("warm-%d", i)); r.status != 201 {
			t.Fatalf("warm-up: %+v", r)
		}
	}

	ctx := context.Background()
	locker, err := s.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = locker.Rollback(ctx) }()
	if _, err := locker.Exec(ctx, `LOCK TABLE idem.idempotency_keys IN ACCESS EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	lockedAt := time.Now()
	released := lockedAt.Add(hold)

	var (
		wg            sync.WaitGroup
		stop          atomic.Bool
		mu            sync.Mutex
		keyedSlowest  time.Duration
		unkeyedLat    []time.Duration
		statuses      = map[int]int{}
		bad           []string
		maxLockWaitMS atomic.Int64
	)
	for c := range keyedClients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; !stop.Load(); i++ {
				t0 := time.Now()
				r := deposit(fmt.Sprintf("k-%d-%d", c, i))
				took := time.Since(t0)
				mu.Lock()
				if t0.Before(released) {
					keyedSlowest = max(keyedSlowest, took)
					statuses[r.status]++
				}
				switch {
				case r.status == http.StatusCreated:
				case (r.status == http.StatusServiceUnavailable || r.status == http.StatusConflict) && r.header.Get("Retry-After") != "":
				default:
					bad = append(bad, fmt.Sprintf("%d %s", r.status, r.body))
				}
				mu.Unlock()
			}
		}()
	}
	for range unkeyedClients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for !stop.Load() {
				t0 := time.Now()
				r := s.call("GET", fmt.Sprintf("/v1/accounts/%d", account), token, "", "")
				mu.Lock()
				if r.status != http.StatusOK {
					bad = append(bad, fmt.Sprintf("unkeyed GET: %d %s", r.status, r.body))
				} else if t0.Before(released) {
					unkeyedLat = append(unkeyedLat, time.Since(t0))
				}
				mu.Unlock()
			}
		}()
	}
	// How long the server's connections wait on the lock, sampled all along: a claim that
	// waited out a lock timeout would show up as a wait of seconds.
	wg.Add(1)
	go func() {
		defer wg.Done()
		for !stop.Load() {
			var ms int64
			_ = s.pool.QueryRow(ctx, `SELECT coalesce(max(extract(epoch FROM clock_timestamp() - query_start) * 1000), 0)::bigint
				FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock' AND pid <> $1`,
				locker.Conn().PgConn().PID()).Scan(&ms)
			if ms > maxLockWaitMS.Load() {
				maxLockWaitMS.Store(ms)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}()
	time.Sleep(time.Until(released))
	if err := locker.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	time.Sleep(500 * time.Millisecond) // requests after the lock go through again
	stop.Store(true)
	wg.Wait()

	slices.Sort(unkeyedLat)
	t.Logf("during the %v lock: keyed answers %v, slowest keyed %v; %d unkeyed reads, slowest %v; longest lock wait of a server connection %d ms",
		hold, statuses, keyedSlowest.Round(time.Millisecond), len(unkeyedLat), unkeyedLat[len(unkeyedLat)-1].Round(time.Millisecond),
		maxLockWaitMS.Load())
	if len(bad) > 0 {
		t.Fatalf("%d answers that are neither 201 nor 409/503 with Retry-After, e.g. %s", len(bad), bad[0])
	}
	if keyedSlowest > 3*time.Second || statuses[http.StatusServiceUnavailable] == 0 {
		t.Fatalf("keyed requests during the lock: slowest %v (want within 3 s), answers %v (want 503s)", keyedSlowest, statuses)
	}
	// Behaviour, not speed (the 0.5 s target is measured on a quiet machine, docs/operations.md):
	// before, unkeyed reads waited for pool connections that keyed requests held for their 2 s
	// lock timeout, again and again (3.9 s); flowing, they take milliseconds, a busy machine's
	// scheduling aside.
	if len(unkeyedLat) < 20 || unkeyedLat[len(unkeyedLat)-1] >= 2*time.Second {
		t.Fatalf("%d unkeyed reads during the lock, the slowest %v: want them flowing", len(unkeyedLat), unkeyedLat[len(unkeyedLat)-1])
	}
	// A behaviour check: a claim that waited on the lock would wait its 2 s lock timeout; the
	// probes wait 5 ms each (more on a busy machine, never near a second).
	if w := maxLockWaitMS.Load(); w >= 1000 {
		t.Fatalf("a server connection waited %d ms on the locked table: keyed requests must not hold connections waiting on it", w)
	}
	if r := deposit("after"); r.status != http.StatusCreated {
		t.Fatalf("a keyed deposit after the lock: %+v", r)
	}
}

package main

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/pgidem/pgidem/internal/release010"
	idemsql "github.com/pgidem/pgidem/sql"
)

// upgradeClients send the previous release's keyed deposits during the upgrade part.
const upgradeClients = 6

// upgradePart measures what the previous release's servers see while this release's migrate
// runs over a key table of BENCH_UPGRADE_KEYS keys (1.5 million): release 0.1.0's keyed
// deposit, served to upgradeClients clients in a loop against the same database as the
// migrate (idemsql.Migrate: the online rebuild of the key table, then the swap), and the
// slowest of its requests that ended before the swap committed, with their answers.
func upgradePart(ctx context.Context, b *bench) error {
	const db = "bench_upgrade"
	if err := recreate(ctx, b.url, db); err != nil {
		return err
	}
	conn, err := connect(ctx, b.url, db)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	if err := release010.Install(ctx, conn); err != nil {
		return err
	}
	if _, err := conn.Exec(ctx, `INSERT INTO principals VALUES ('p_alice', 'alice');
		INSERT INTO accounts (principal_id, name, currency) VALUES ('p_alice', 'main', 'EUR')`); err != nil {
		return err
	}
	t0 := time.Now()
	if err := release010.Fill(ctx, conn, b.upgradeKeys); err != nil {
		return err
	}
	fmt.Printf("upgrade: %d keys of 0.1.0 loaded in %s\n", b.upgradeKeys, time.Since(t0).Round(time.Second))
	pool, err := openPool(ctx, b.url, db, upgradeClients+2, nil)
	if err != nil {
		return err
	}
	defer pool.Close()
	old := httptest.NewServer(release010.Deposit(pool, "p_alice"))
	defer old.Close()

	type answer struct {
		began, ended time.Time
		status       int
	}
	var (
		mu      sync.Mutex
		answers []answer
		stop    atomic.Bool
		wg      sync.WaitGroup
		swapped atomic.Pointer[time.Time]
	)
	for c := range upgradeClients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; !stop.Load(); i++ {
				began := time.Now()
				req, _ := http.NewRequestWithContext(ctx, "POST", old.URL+"/v1/accounts/1/deposits", strings.NewReader(`{"amount":1}`))
				req.Header.Set("Idempotency-Key", fmt.Sprintf("old-%d-%d", c, i))
				req.Header.Set("Content-Type", "application/json")
				status := 0
				if res, err := http.DefaultClient.Do(req); err == nil {
					status = res.StatusCode
					res.Body.Close()
				}
				mu.Lock()
				answers = append(answers, answer{began, time.Now(), status})
				mu.Unlock()
			}
		}()
	}
	watch, err := openPool(ctx, b.url, db, 1, nil)
	if err != nil {
		return err
	}
	defer watch.Close()
	watchCtx, stopWatch := context.WithCancel(ctx)
	defer stopWatch()
	go func() {
		for watchCtx.Err() == nil {
			var v int
			if err := watch.QueryRow(watchCtx, `SELECT version FROM idem.schema_version`).Scan(&v); err == nil && v >= 3 {
				now := time.Now()
				swapped.Store(&now)
				return
			}
			time.Sleep(2 * time.Millisecond)
		}
	}()
	time.Sleep(time.Second) // the old release serves for a while first
	migrateConn, err := connect(ctx, b.url, db)
	if err != nil {
		return err
	}
	defer migrateConn.Close(ctx)
	start := time.Now()
	err = idemsql.Migrate(ctx, migrateConn, idemsql.Options{})
	took := time.Since(start)
	time.Sleep(200 * time.Millisecond)
	stop.Store(true)
	wg.Wait()
	if err != nil {
		return fmt.Errorf("migrate under the previous release's traffic: %w", err)
	}
	swapAt := swapped.Load()
	if swapAt == nil {
		return fmt.Errorf("the swap's commit was not seen")
	}
	// The swap is seen by polling every 2 ms: an answer in the last 20 ms before may be after it.
	cut := swapAt.Add(-20 * time.Millisecond)
	statuses := map[int]int{}
	var slowest time.Duration
	atSwap := 0
	for _, a := range answers {
		switch {
		case !a.began.Before(start) && a.ended.Before(cut):
			statuses[a.status]++
			slowest = max(slowest, a.ended.Sub(a.began))
		case a.began.Before(*swapAt) && !a.ended.Before(cut) && a.status >= 500:
			atSwap++
		}
	}
	fmt.Printf("upgrade: migrate took %s; the swap committed after %s; the previous release's answers before it %v, slowest %s; "+
		"%d answered 5xx in flight at the swap\n", took.Round(time.Millisecond), swapAt.Sub(start).Round(time.Millisecond), statuses,
		slowest.Round(time.Millisecond), atSwap)
	fiveXX := 0
	for status, n := range statuses {
		if status >= 500 || status == 0 {
			fiveXX += n
		}
	}
	keys := fmt.Sprintf("%.1f M keys", float64(b.upgradeKeys)/1e6)
	ms := float64(slowest.Microseconds()) / 1000
	b.check("upgrade: the previous release's slowest request while migrate runs, ms ("+keys+")", fmt.Sprintf("%.0f", ms), ms, "<=", 1000, "%.0f")
	b.check("upgrade: the previous release's 5xx before the migrate committed ("+keys+")", fmt.Sprint(fiveXX), float64(fiveXX), "=", 0, "%.0f")
	b.info("upgrade: the previous release's requests in flight at the swap answered 5xx", fmt.Sprint(atSwap))
	return nil
}

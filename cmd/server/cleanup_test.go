package main

import (
	"context"
	"fmt"
	"github.com/pgidem/pgidem/internal/pgtest"
	"io"
	"log/slog"
	"sync"
	"testing"
)

func expire(t *testing.T, s *testServer, principal string, n int) {
	t.Helper()
	pgtest.InsertExpired(t, s.pool, principal, n)
}

// TestCleanupWhileRequestsRun: a pass deletes every expired key and no live one while
// keyed requests keep arriving.
func TestCleanupWhileRequestsRun(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	id, token := s.principal("c")
	expire(t, s, id, 2500)
	c := newCleaner(s.pool, 100, nil, slog.New(slog.NewTextHandler(io.Discard, nil)))
	var wg sync.WaitGroup
	wg.Add(1)
	var statuses []int
	go func() {
		defer wg.Done()
		for i := range 40 {
			r := s.call("POST", "/v1/accounts", token, fmt.Sprintf("live-%d", i), `{"name":"a","currency":"EUR"}`)
			statuses = append(statuses, r.status)
		}
	}()
	n, ran, err := c.pass(context.Background())
	wg.Wait()
	if err != nil || !ran || n != 2500 {
		t.Fatalf("pass: %d deleted, ran %v, %v; want 2500", n, ran, err)
	}
	for i, st := range statuses {
		if st != 201 {
			t.Fatalf("request %d: %d", i, st)
		}
	}
	if k := s.count(`SELECT count(*) FROM idem.idempotency_keys WHERE key LIKE 'live-%'`); k != 40 {
		t.Fatalf("%d live keys, want 40", k)
	}
	if k := s.count(`SELECT count(*) FROM idem.idempotency_keys WHERE key LIKE 'old-%'`); k != 0 {
		t.Fatalf("%d expired keys left", k)
	}
}

// TestTwoInstancesOneCleaner: while one process holds the cleanup lock another skips its
// pass; two processes at once never delete a row twice.
func TestTwoInstancesOneCleaner(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	id, _ := s.principal("c")
	expire(t, s, id, 3000)
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	a, b := newCleaner(s.pool, 100, nil, log), newCleaner(s.pool, 100, nil, log)

	ctx := context.Background()
	holder, err := s.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := holder.Exec(ctx, `SELECT pg_advisory_xact_lock($1)`, cleanupLockID); err != nil {
		t.Fatal(err)
	}
	if n, ran, err := b.pass(ctx); err != nil || ran || n != 0 {
		t.Fatalf("a pass while another holds the lock: %d, ran %v, %v", n, ran, err)
	}
	_ = holder.Rollback(ctx)

	var wg sync.WaitGroup
	start := make(chan struct{})
	results := make([]int, 2)
	ranBoth := make([]bool, 2)
	for i, c := range []*cleaner{a, b} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			n, ran, err := c.pass(ctx)
			if err != nil {
				t.Error(err)
			}
			results[i], ranBoth[i] = n, ran
		}()
	}
	close(start)
	wg.Wait()
	if results[0]+results[1] != 3000 {
		t.Fatalf("deleted %v, want 3000 in all", results)
	}
	if !ranBoth[0] && !ranBoth[1] {
		t.Fatal("no pass ran")
	}
	if k := s.count(`SELECT count(*) FROM idem.idempotency_keys`); k != 0 {
		t.Fatalf("%d keys left", k)
	}
}

// TestScheduledCleanupStopsWithTheServer: the gocron job runs passes on its interval and
// stop waits for it.
func TestScheduledCleanup(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	id, _ := s.principal("c")
	expire(t, s, id, 500)
	c := newCleaner(s.pool, 100, nil, slog.New(slog.NewTextHandler(io.Discard, nil)))
	stop, err := c.schedule(context.Background(), 1e9/20) // every 50 ms
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 200 && s.count(`SELECT count(*) FROM idem.idempotency_keys`) > 0; i++ {
		sleepBriefly()
	}
	stop()
	stop() // idempotent
	if k := s.count(`SELECT count(*) FROM idem.idempotency_keys`); k != 0 {
		t.Fatalf("%d expired keys left after the scheduled passes", k)
	}
}

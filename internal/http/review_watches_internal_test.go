package idemhttp

import (
	"context"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// TestWatchesLeaveNothingBehind (review, passes): many keys waited on, every waiter leaving at
// its deadline (the look never sees an answer), some keys signalled by their holder while
// waited on, and waiters racing the signal: once they are all gone the watches map is empty,
// every poll goroutine has ended, and no waiter is left blocked. One look per key and tick
// whatever the number of waiters.
func TestWatchesLeaveNothingBehind(t *testing.T) {
	ws := newWatches()
	base := runtime.NumGoroutine()
	var looks atomic.Int64
	look := func(ctx context.Context, ids []watchKey) (map[watchKey]lookResult, error) {
		looks.Add(int64(len(ids)))
		return nil, nil
	}
	const keys, perKey = 500, 4
	var wg sync.WaitGroup
	for k := range keys {
		id := watchKey{"alice", fmt.Sprint(k)}
		for range perKey {
			wg.Add(1)
			go func() {
				defer wg.Done()
				ctx, cancel := context.WithTimeout(context.Background(), 250*time.Millisecond)
				defer cancel()
				_, _ = ws.wait(ctx, id, 20*time.Millisecond, look)
			}()
		}
		if k%3 == 0 {
			go ws.signal(id) // the holder's answer, racing the waiters
		}
	}
	wg.Wait()
	deadline := time.Now().Add(5 * time.Second)
	for {
		ws.mu.Lock()
		n := len(ws.keys)
		ws.mu.Unlock()
		if n == 0 && runtime.NumGoroutine() <= base+2 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after every waiter left: %d watches, %d goroutines (were %d)", n, runtime.NumGoroutine(), base)
		}
		time.Sleep(10 * time.Millisecond)
	}
	// 250 ms of waiting, a look every 20 ms: at most about 13 looks a key, whatever its waiters.
	if n := looks.Load(); n > keys*15 {
		t.Fatalf("%d looks for %d keys in 250 ms at one look per 20 ms and key", n, keys)
	}
}

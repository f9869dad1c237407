package idemhttp_test

import (
	"context"
	"net/http"
	"sync"
	"testing"
)

// TestLeaseDuplicatesHoldBalanced (review, passes): lease duplicates count their bodies toward
// MaxWaitingBytes while they wait (Gate.Hold); half of them lose their clients during the wait,
// the others get the holder's answer: afterwards the gate counts nothing waiting and no bytes.
func TestLeaseDuplicatesHoldBalanced(t *testing.T) {
	t.Parallel()
	a := newApp(t, nil)
	const body = `{"block":true}`
	first := make(chan reply, 1)
	go func() { first <- a.do("POST", "/jobs", "alice", "hold", body) }()
	<-a.started
	const dups = 20
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var wg sync.WaitGroup
	replies := make(chan reply, dups)
	for i := range dups {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c := context.Background()
			if i%2 == 0 {
				c = ctx
			}
			replies <- a.doCtx(c, "POST", "/jobs", "alice", "hold", body)
		}()
	}
	waitUntil(t, "every duplicate waits", func() bool { return a.m.GateStats().Waiting == dups })
	cancel()
	waitUntil(t, "the impatient ones left", func() bool { return a.m.GateStats().Waiting == dups/2 })
	a.unblock()
	if r := <-first; r.status != http.StatusAccepted {
		t.Fatalf("the first: %+v", r)
	}
	wg.Wait()
	close(replies)
	replayed := 0
	for r := range replies {
		if r.status == http.StatusAccepted && r.header.Get("Idempotent-Replayed") == "true" {
			replayed++
		}
	}
	if replayed != dups/2 {
		t.Fatalf("%d duplicates got the replay, want %d", replayed, dups/2)
	}
	waitUntil(t, "nothing counted", func() bool {
		s := a.m.GateStats()
		return s.Waiting == 0 && s.WaitingBytes == 0
	})
}

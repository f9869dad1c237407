package idem_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestDrainedDuplicateAtTheDeadlineIsNotAStoreFailure: duplicates waited in Go (the Gate's
// per-key queue) for a request of this process that held their key, its handler blocked on a
// channel, when Shutdown was called with a context that had already ended (a shutdown timeout
// of 0, a second signal): its drain ended their waits and its deadline had passed. When a
// duplicate's answer was decided after the tracker was stopped (so not the drain's 409) but
// before the callback that ends its work context had run (so not ErrShutdown's cause), the
// context.Canceled of its wait fell through to the store's error: 503 store_unavailable,
// logged at ERROR, in 96 to 211 of 240 duplicates (D179). Each duplicate is answered 409
// request_in_progress or 503 shutting_down now.
func TestDrainedDuplicateAtTheDeadlineIsNotAStoreFailure(t *testing.T) {
	t.Parallel()
	for _, after := range []time.Duration{0, 300 * time.Millisecond} {
		t.Run(fmt.Sprintf("deadline_after=%v", after), func(t *testing.T) { drainAtDeadline(t, after) })
	}
}

func drainAtDeadline(t *testing.T, after time.Duration) {
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 8)
	const rounds, dups = 20, 12
	bad := 0
	counts := map[string]int{}
	for round := 0; round < rounds; round++ {
		m, err := idem.New(ctx, idem.Options{DB: pool, Principal: bearerOK, DuplicateWait: 5 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		hIn := make(chan struct{})
		var once sync.Once
		h := m.Route(idem.Route{Action: "POST /dr"})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			once.Do(func() { close(hIn) })
			<-r.Context().Done() // the holder: runs until Shutdown ends its work
			w.WriteHeader(201)
		}))
		key := fmt.Sprintf("dr-%d", round)
		post := func() (int, string) {
			req := httptest.NewRequest("POST", "/dr", strings.NewReader(`{"a":1}`))
			req.Header.Set("Content-Type", "application/json")
			req.Header.Set("Authorization", "Bearer ok")
			req.Header.Set("Idempotency-Key", key)
			w := httptest.NewRecorder()
			h.ServeHTTP(w, req)
			var p struct{ Code string }
			_ = json.Unmarshal(w.Body.Bytes(), &p)
			return w.Code, p.Code
		}
		var wg sync.WaitGroup
		wg.Add(1)
		go func() { defer wg.Done(); post() }()
		shutdownWait(t, hIn, "the holder's handler")
		var mu sync.Mutex
		var answers []string
		for i := 0; i < dups; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				c, code := post()
				mu.Lock()
				answers = append(answers, fmt.Sprintf("%d %s", c, code))
				mu.Unlock()
			}()
		}
		// The duplicates are waiting in Go for the holder's flight.
		deadline := time.Now().Add(5 * time.Second)
		for m.GateStats().Waiting < dups && time.Now().Before(deadline) {
			time.Sleep(time.Millisecond)
		}
		if w := m.GateStats().Waiting; w < dups {
			t.Fatalf("only %d duplicates waiting", w)
		}
		sctx, cancel := context.WithTimeout(ctx, after)
		defer cancel()
		_ = m.Shutdown(sctx)
		wg.Wait()
		for _, a := range answers {
			counts[a]++
			if !strings.HasSuffix(a, "request_in_progress") && !strings.HasSuffix(a, "shutting_down") {
				bad++
			}
		}
	}
	t.Logf("duplicates' answers over %d rounds: %v", rounds, counts)
	if bad > 0 {
		t.Errorf("%d of %d duplicates drained at Shutdown's deadline were answered as a store failure, not 409/503 shutting_down", bad, rounds*dups)
	}
}

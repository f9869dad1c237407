package idemhttp_test

import (
	"context"
	"net/http"
	"testing"
	"time"

	idemhttp "github.com/pgidem/pgidem/internal/http"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestClientThatGoesAwayGetsTheAnswerOnRetry: the client of a keyed request goes away while
// its handler runs (a disconnect, as an attempt timeout does). The work does not end with the
// client: it runs to its end and commits with its answer. The client's retry, sent while the
// work still runs, waits for it and gets that answer; one effect, one key.
func TestClientThatGoesAwayGetsTheAnswerOnRetry(t *testing.T) {
	t.Parallel()
	a := newApp(t, nil)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan reply, 1)
	go func() { done <- a.doCtx(ctx, "POST", "/transfers", "alice", "k1", `{"amount":1,"block":true}`) }()
	<-a.started
	cancel()
	<-done
	// Wait until the server has seen the disconnect (its connection is closed), and check the
	// work's context did not end with it.
	time.Sleep(300 * time.Millisecond)
	if err := (*a.blocked.Load()).Err(); err != nil {
		t.Fatalf("the work's context ended with the client: %v", err)
	}
	retry := make(chan reply, 1)
	go func() { retry <- a.do("POST", "/transfers", "alice", "k1", `{"amount":1,"block":true}`) }()
	deadline := time.Now().Add(5 * time.Second)
	for a.m.GateStats().Waiting == 0 {
		if time.Now().After(deadline) {
			t.Fatal("the retry never waited for the work")
		}
		time.Sleep(5 * time.Millisecond)
	}
	a.unblock()
	r := <-retry
	if r.status != http.StatusCreated || r.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("the retry while the work ran: %+v, want the work's answer, replayed", r)
	}
	if a.keys() != 1 || a.effects() != 1 {
		t.Fatalf("%d keys, %d effects; want one of each", a.keys(), a.effects())
	}
}

// TestWorkTimeoutEndsTheWork: the server-side deadline of a keyed unit of work
// (Options.WorkTimeout) ends it whether or not the client is still there: the work's context
// ends at the deadline, the transaction rolls back, nothing is stored, and a retry runs it.
func TestWorkTimeoutEndsTheWork(t *testing.T) {
	t.Parallel()
	a := newApp(t, func(o *idemhttp.Options) { o.WorkTimeout = 300 * time.Millisecond })
	done := make(chan reply, 1)
	go func() { done <- a.do("POST", "/transfers", "alice", "k1", `{"amount":1,"block":true}`) }()
	<-a.started
	select {
	case <-(*a.blocked.Load()).Done():
	case <-time.After(5 * time.Second):
		t.Fatal("the work's context did not end at its deadline")
	}
	a.unblock()
	if r := <-done; r.status < 500 {
		t.Fatalf("the work past its deadline: %+v, want a 5xx", r)
	}
	if a.keys() != 0 || a.effects() != 0 {
		t.Fatalf("%d keys, %d effects after the deadline; want none", a.keys(), a.effects())
	}
	if r := a.do("POST", "/transfers", "alice", "k1", `{"amount":1}`); r.status != http.StatusCreated {
		t.Fatalf("the retry: %+v", r)
	}
}

// TestLeaseDuplicateGetsTheAnswerSoon: a duplicate on a lease route (lease 1 s, work 2 s) sent
// 0.3 s after the first waits for the first's answer, without a connection, and gets it soon
// after it is stored (within 2 s here; the budget of half a second is make bench's): from this process (woken by the holder) and from another
// (which looks at the key), where before it got 409 with the rest of the lease as Retry-After.
// The provider is called once.
func TestLeaseDuplicateGetsTheAnswerSoon(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 10)
	prov := newProvider()
	here := servePayoutsWith(t, pool, prov, nil)
	there := servePayoutsWith(t, pool, prov, nil) // another process on the same database
	type timed struct {
		r  reply
		at time.Time
	}
	post := func(p *payouts, out chan<- timed) {
		r := p.post(context.Background(), "soon", 2000)
		out <- timed{r, time.Now()}
	}
	first, dupHere, dupThere := make(chan timed, 1), make(chan timed, 1), make(chan timed, 1)
	go post(here, first)
	time.Sleep(300 * time.Millisecond)
	go post(here, dupHere)
	go post(there, dupThere)
	f := <-first
	if f.r.status != http.StatusCreated {
		t.Fatalf("the first: %+v", f.r)
	}
	for name, ch := range map[string]chan timed{"in this process": dupHere, "in another process": dupThere} {
		d := <-ch
		if d.r.status != http.StatusCreated || d.r.body != f.r.body || d.r.header.Get("Idempotent-Replayed") != "true" {
			t.Fatalf("the duplicate %s: %+v, want the replay of %s", name, d.r, f.r.body)
		}
		// The budget is half a second (make bench's duplicate part); here a bound that a
		// loaded machine does not trip, an order of magnitude below a wait for the lease.
		if late := d.at.Sub(f.at); late > 2*time.Second {
			t.Fatalf("the duplicate %s had the answer %v after the first", name, late)
		}
	}
	if calls, _, payouts := prov.counts(); calls != 1 || payouts != 1 {
		t.Fatalf("%d provider calls, %d payouts; want one", calls, payouts)
	}
}

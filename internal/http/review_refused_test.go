package idemhttp_test

import (
	"net/http"
	"testing"
	"time"

	idemhttp "github.com/pgidem/pgidem/internal/http"
)

// TestRefusedCountsRequestsAnswered409 (review finding): idempotency_refused_total counts
// "requests answered 409 without waiting on the database" and idempotency_coalesced_total
// "requests that found their key in flight in this process and waited" (GateStats.Refused,
// Coalesced). Since duplicates wait up to DuplicateWait by claiming again and again (keyed's
// loop), the Gate counts every pass: a duplicate whose wait in Go runs out at the lock timeout
// (here 300 ms) and claims again counts one refusal and one coalescing per pass, and a
// duplicate without a wait slot one refusal every 100 ms, though it is answered with the
// first's replay in the end, never 409. The counters then measure passes, not requests; an
// alert on refusals fires for duplicates that were all served.
//
// The gap is held by the first request's handler, blocked on a channel.
func TestRefusedCountsRequestsAnswered409(t *testing.T) {
	t.Parallel()
	a := newApp(t, func(o *idemhttp.Options) { o.LockTimeout = 300 * time.Millisecond })
	const body = `{"amount":1}`
	first := make(chan reply, 1)
	go func() { first <- a.do("POST", "/transfers", "alice", "refused", body, "X-Block", "1") }()
	<-a.started
	dup := make(chan reply, 1)
	go func() { dup <- a.do("POST", "/transfers", "alice", "refused", body) }()
	waitUntil(t, "the duplicate waits", func() bool { return a.m.GateStats().Waiting == 1 })
	time.Sleep(1500 * time.Millisecond) // five lock timeouts of waiting
	a.unblock()
	if r := <-first; r.status != http.StatusCreated {
		t.Fatalf("the first: %+v", r)
	}
	r := <-dup
	if r.status != http.StatusCreated || r.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("the duplicate: %+v, want the replay", r)
	}
	s := a.m.GateStats()
	t.Logf("gate: %+v", s)
	if s.Refused != 0 || s.Coalesced != 1 {
		t.Fatalf("one duplicate, answered with the replay: idempotency_refused_total %d (want 0, it got no 409), "+
			"idempotency_coalesced_total %d (want 1)", s.Refused, s.Coalesced)
	}
}

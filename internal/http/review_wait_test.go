package idemhttp_test

import (
	"context"
	"net/http"
	"testing"
	"time"

	idemhttp "github.com/pgidem/pgidem/internal/http"
)

// waitUntil polls cond every 5 ms up to 10 s.
func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting until %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestWorkTimeoutDoesNotCountTheDuplicatesWait (review finding): Options.WorkTimeout bounds
// "the unit of work of a keyed request on a transactional route, from its claim to its commit".
// keyedOnce starts the work context's deadline (workContext) before Gate.RunDetached, so the
// duplicate's wait in Go for the holder of its key (up to the lock timeout, itself up to
// DuplicateWait) is taken out of its own work's time. Here: WorkTimeout 2 s; the first request
// holds the key until its work times out and rolls back; the duplicate, which has waited about
// 2.5 s for it, then claims and runs work of 1 s (well under WorkTimeout), and fails with 5xx
// because its deadline passed while it waited. (With 1 s and work of 0.6 s, a machine running
// three test suites at once took the duplicate's claim and commit past the 0.4 s left.) The same deadline ends a wait on another
// process's row lock (a wait slot) when WorkTimeout < LockTimeout: 5xx instead of 409.
//
// The gap is held by the first request's handler, blocked on a channel, and the wait is seen
// through GateStats.Waiting.
func TestWorkTimeoutDoesNotCountTheDuplicatesWait(t *testing.T) {
	t.Parallel()
	a := newApp(t, func(o *idemhttp.Options) { o.WorkTimeout = 2 * time.Second })
	const body = `{"amount":1,"sleep_ms":1000}`
	first := make(chan reply, 1)
	go func() { first <- a.do("POST", "/transfers", "alice", "wt", body, "X-Block", "1") }()
	<-a.started // the first holds the key (its claim uncommitted), its handler blocked
	dup := make(chan reply, 1)
	go func() { dup <- a.do("POST", "/transfers", "alice", "wt", body) }()
	waitUntil(t, "the duplicate waits in Go", func() bool { return a.m.GateStats().Waiting == 1 })
	// The first's work runs past its WorkTimeout and rolls back (its insert fails).
	<-(*a.blocked.Load()).Done()
	time.Sleep(500 * time.Millisecond) // the first's rollback takes a while (a slow handler)
	a.unblock()
	if r := <-first; r.status < 500 {
		t.Fatalf("the first, past its WorkTimeout: %+v, want 5xx", r)
	}
	r := <-dup
	t.Logf("the duplicate: %d %s", r.status, r.body)
	if r.status != http.StatusCreated {
		t.Fatalf("the duplicate's own work took 1 s of a 2 s WorkTimeout, yet it got %d %s: its wait for the "+
			"first was counted against its WorkTimeout", r.status, r.body)
	}
}

// TestClientGoneWhileWaitingIsNotAStoreError (review finding): a duplicate whose client goes
// away while it waits for the holder of its key (the impatient client the release is built for:
// its attempt timeout fires, it retries) is answered by storeError, whose "client gone" check
// returns StateStoreError: the metric idem_requests{state="store_error"} (the one alerts watch
// for a failing store) counts every impatient client, and nothing is logged. The wait's own
// outcome is busy (nothing failed; the key is in progress).
//
// The gap is held by the holder's handler, blocked on a channel; the wait is seen through
// GateStats.Waiting.
func TestClientGoneWhileWaitingIsNotAStoreError(t *testing.T) {
	t.Parallel()
	obs := newObserver()
	a := newApp(t, func(o *idemhttp.Options) { o.Metrics = obs })
	const body = `{"amount":1}`
	first := make(chan reply, 1)
	go func() { first <- a.do("POST", "/transfers", "alice", "gone", body, "X-Block", "1") }()
	<-a.started
	ctx, cancel := context.WithCancel(context.Background())
	dup := make(chan reply, 1)
	go func() { dup <- a.doCtx(ctx, "POST", "/transfers", "alice", "gone", body) }()
	waitUntil(t, "the duplicate waits in Go", func() bool { return a.m.GateStats().Waiting == 1 })
	cancel() // the duplicate's client goes away while it waits
	<-dup
	waitUntil(t, "the duplicate's wait ended", func() bool { return a.m.GateStats().Waiting == 0 })
	waitUntil(t, "the duplicate was counted", func() bool {
		c := obs.counts()
		return c["store_error"]+c["busy"] > 0
	})
	a.unblock()
	if r := <-first; r.status != http.StatusCreated {
		t.Fatalf("the first: %+v", r)
	}
	c := obs.counts()
	t.Logf("counts: %v", c)
	if c["store_error"] != 0 {
		t.Fatalf("a client that went away while its duplicate waited was counted as a store error: %v", c)
	}
}

// TestWorkTimeoutDoesNotEndARowLockWait (review finding, the same cause as
// TestWorkTimeoutDoesNotCountTheDuplicatesWait): a duplicate whose key another process holds
// waits on the key's row lock inside its claim, on the work context, whose WorkTimeout (here
// 1 s) is shorter than the lock timeout (3 s): the wait ends at the WorkTimeout with a context
// error, answered 503 store_unavailable ("the request could not be recorded") and logged as a
// failure of the unit of work, instead of 409 request_in_progress at the lock timeout. Nothing
// checks WorkTimeout against LockTimeout (or DuplicateWait, which bounds the waits).
//
// The gap is held by a real row lock: another connection's uncommitted claim of the key.
func TestWorkTimeoutDoesNotEndARowLockWait(t *testing.T) {
	t.Parallel()
	a := newApp(t, func(o *idemhttp.Options) { o.WorkTimeout, o.LockTimeout = time.Second, 3*time.Second })
	release := holdKeyElsewhere(t, a, "alice", "wt-lock")
	defer release()
	r := a.do("POST", "/transfers", "alice", "wt-lock", `{"amount":1}`)
	t.Logf("the duplicate: %d %s", r.status, r.body)
	if r.status != http.StatusConflict {
		t.Fatalf("a duplicate waiting on another process's claim: %d, want 409 request_in_progress at its lock timeout", r.status)
	}
}

package idemhttp_test

import (
	"context"
	"testing"
	"time"

	"github.com/pgidem/pgidem/internal/pgtest"
)

// holdKeyElsewhere claims principal/key in a transaction of another connection (another
// process's transactional holder) and leaves it uncommitted; the returned function rolls it back.
func holdKeyElsewhere(t *testing.T, a *app, principal, key string) func() {
	t.Helper()
	holder := pgtest.Connect(t, pgtest.URLOf(t, a.pool))
	pgtest.Exec(t, holder, `BEGIN`)
	pgtest.Exec(t, holder, `SELECT idem.idem_begin($1, $2, 'POST /transfers', sha256('other'))`, principal, key)
	done := false
	return func() {
		if !done {
			done = true
			pgtest.Exec(t, holder, `ROLLBACK`)
		}
	}
}

// lockWaiters counts the claims that wait on another holder's row lock, past the Gate's probe.
const lockWaiters = pgtest.KeyWaiters

// TestRowLockWaitEndsWithTheClient (review finding): "the waits before the work still end with
// the client" (Gate.RunDetached: the wait context for the wait, the work context for the work).
// That holds for the wait in Go only. A duplicate whose key another process holds waits on the
// key's row lock inside the claim, which runs on the work context (context.WithoutCancel): when
// its client goes away, it keeps waiting for the rest of the lock timeout (up to DuplicateWait),
// holding a pool connection and one of the MaxWaitingClaims wait slots for nobody; the impatient
// clients the release is built for (attempt timeouts, retries) fill the slots with such waits and
// the live duplicates get 409 at once (errNoSlot).
//
// The gap is held by a real row lock: another connection's uncommitted claim of the key.
func TestRowLockWaitEndsWithTheClient(t *testing.T) {
	t.Parallel()
	a := newApp(t, nil) // LockTimeout 5 s
	release := holdKeyElsewhere(t, a, "alice", "rl-gone")
	defer release()
	ctx, cancel := context.WithCancel(context.Background())
	dup := make(chan reply, 1)
	go func() { dup <- a.doCtx(ctx, "POST", "/transfers", "alice", "rl-gone", `{"amount":1}`) }()
	waitUntil(t, "the claim takes a wait slot", func() bool { return a.m.GateStats().LockWaits == 1 })
	pgtest.WaitFor(t, a.pool, lockWaiters)
	cancel() // the client goes away
	<-dup
	// The server sees the disconnect at once; a loaded machine may take a moment more. The
	// bound tells the two behaviours apart: without the cancel the wait lasts the lock timeout (5 s).
	slots, waiters := a.m.GateStats().LockWaits, a.count(lockWaiters)
	for deadline := time.Now().Add(3 * time.Second); (slots != 0 || waiters != 0) && time.Now().Before(deadline); {
		time.Sleep(50 * time.Millisecond)
		slots, waiters = a.m.GateStats().LockWaits, a.count(lockWaiters)
	}
	t.Logf("after the client left: %d wait slots taken, %d claims waiting on the row lock", slots, waiters)
	if slots != 0 || waiters != 0 {
		t.Fatalf("the duplicate whose client went away still waits on the row lock (%d slots, %d waiting claims): "+
			"it holds a connection and a wait slot for the rest of its lock timeout", slots, waiters)
	}
}

// TestShutdownStopsADuplicateWaitingOnAnotherProcess (review finding): Middleware.Shutdown says
// "Duplicates waiting for another request's answer stop waiting at once (409
// request_in_progress; the client retries against the next process)". A duplicate on a
// transactional route whose key another process holds waits on the row lock, inside the claim,
// on the work context, which Shutdown ends only at its deadline: Shutdown waits the duplicate's
// whole lock timeout (up to DuplicateWait, 10 s by default) and the duplicate is not answered
// 409 at once. With the default DuplicateWait and a SHUTDOWN_TIMEOUT under it, every such
// duplicate turns a clean shutdown into one that runs out (ErrShutdown, Shutdown's error).
//
// The gap is held by a real row lock: another connection's uncommitted claim of the key.
func TestShutdownStopsADuplicateWaitingOnAnotherProcess(t *testing.T) {
	t.Parallel()
	a := newApp(t, nil) // LockTimeout 5 s
	release := holdKeyElsewhere(t, a, "alice", "rl-shutdown")
	defer release()
	dup := make(chan reply, 1)
	go func() { dup <- a.do("POST", "/transfers", "alice", "rl-shutdown", `{"amount":1}`) }()
	pgtest.WaitFor(t, a.pool, lockWaiters)
	sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	began := time.Now()
	err := a.m.Shutdown(sctx)
	took := time.Since(began)
	r := <-dup
	t.Logf("Shutdown returned %v after %v; the duplicate got %d %s", err, took.Round(time.Millisecond), r.status, r.body)
	// Waiting, it would take the 5 s lock timeout; 2.5 s leaves room for a loaded CI machine.
	if took > 2500*time.Millisecond {
		t.Fatalf("Shutdown waited %v for a duplicate waiting on another process's claim, which should stop waiting at once", took)
	}
	if r.status != 409 {
		t.Fatalf("the duplicate at shutdown: %d, want 409 request_in_progress", r.status)
	}
}

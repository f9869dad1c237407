package dbidem_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/internal/dbidem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// gateWait polls ok until it holds, failing after 10 s.
func gateWait(t *testing.T, what string, ok func() bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !ok(); {
		if time.Now().After(deadline) {
			t.Fatalf("timed out: %s", what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// TestGateSlotFreedOnceClaimed: a wait slot is for a claim that waits on a key's row lock
// held by another process (LockWaits: "they wait on a key's row lock held by another
// process"). Once that holder rolls back and the waiting claim takes the key, its work runs:
// it no longer waits on any row, so its slot must be free for another key's claim. The slot was
// held through the work and its COMMIT, and another key's claim was refused (no slot).
func TestGateSlotFreedOnceClaimed(t *testing.T) {
	t.Parallel()
	pool, url := pgtest.NewPool(t, 6)
	ctx := context.Background()
	gate := dbidem.NewGate(dbidem.GateOptions{MaxWaitingClaims: 1})

	// "Another process" holds key a, uncommitted.
	other := holdElsewhere(t, url, "a")

	inside, release := make(chan struct{}), make(chan struct{})
	var releaseOnce sync.Once
	t.Cleanup(func() { releaseOnce.Do(func() { close(release) }) })
	aDone := make(chan error, 1)
	go func() {
		c := claim("a", `{}`)
		c.LockTimeout = 5 * time.Second
		aDone <- gate.Run(ctx, pool, dbidem.TxOptions{}, c, func(tx *dbidem.Tx, d dbidem.Decision) error {
			if d.Outcome == dbidem.Claimed {
				close(inside)
				<-release // a long handler
				tx.CompleteOnCommit(dbidem.Response{Status: 200})
			}
			return nil
		})
	}()
	gateWait(t, "a's claim takes the wait slot", func() bool { return gate.LockWaits() == 1 })
	_ = other.Rollback(ctx) // the other process gave key a up: a claims it and works
	select {
	case <-inside:
	case <-time.After(10 * time.Second):
		t.Fatal("a never claimed")
	}
	lockWaits := gate.LockWaits()

	// Another process now holds key b, and commits it a little later.
	other2, err := pgtest.Connect(t, url).Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	cb := claim("b", `{}`)
	d, err := dbidem.Begin(ctx, other2, cb)
	if err != nil || d.Outcome != dbidem.Claimed {
		t.Fatalf("other2's claim of b: %+v %v", d, err)
	}
	committed := make(chan struct{})
	defer func() { <-committed; _ = other2.Rollback(ctx) }()
	go func() {
		defer close(committed)
		time.Sleep(300 * time.Millisecond)
		_, _ = other2.Exec(ctx, `SELECT idem.idem_complete(p_principal => $1, p_key => $2, p_attempt => $3, p_status => 201,
			p_headers => '{}', p_body => '{}'::bytea)`, cb.Principal, cb.Key, d.Attempt)
		_ = other2.Commit(ctx)
	}()
	cb.LockTimeout = 5 * time.Second
	var got dbidem.Decision
	start := time.Now()
	errB := gate.Run(ctx, pool, dbidem.TxOptions{}, cb, func(tx *dbidem.Tx, d dbidem.Decision) error {
		got = d
		return nil
	})
	took := time.Since(start)
	releaseOnce.Do(func() { close(release) })
	if err := <-aDone; err != nil {
		t.Errorf("a: %v", err)
	}
	if lockWaits != 0 {
		t.Errorf("while a's claimed work ran (no claim waiting on any row): LockWaits()=%d, want 0", lockWaits)
	}
	if errB != nil || got.Outcome != dbidem.Replay {
		t.Errorf("b, whose other-process holder committed after 300 ms (lock timeout 5 s): %v (decision %q) after %s; "+
			"want a wait on b's row with the free slot and a replay", errB, got.Outcome, took.Round(time.Millisecond))
	}
	if gate.LockWaits() != 0 {
		t.Errorf("after: LockWaits()=%d", gate.LockWaits())
	}
}

// TestGatePanicIsNoAnswer: a Do whose fn panics after claiming the key (a job runner
// recovers the panic, as DoLease's doc says such runners do) stored nothing: the key has no
// answer. Its duplicates waiting in Go must go on one at a time (the next takes the flight and
// runs fn; the others wait in Go for it and replay its answer). A build of D211 read the
// unwinding panic as an answer and let the duplicates claim side by side: they took wait slots on
// the key's row, and the one without a slot was refused at once, long before its lock timeout.
func TestGatePanicIsNoAnswer(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 8)
	ctx := context.Background()
	pgtest.Exec(t, pool, `CREATE TABLE effects (n int)`)
	gate := dbidem.NewGate(dbidem.GateOptions{MaxWaitingClaims: 1})
	job := dbidem.Job{Principal: "p", Key: "panics", Action: "job", Input: map[string]int{"n": 1}, Gate: gate,
		LockTimeout: 8 * time.Second}

	fInside, fRelease := make(chan struct{}), make(chan struct{})
	nextInside, nextRelease := make(chan struct{}), make(chan struct{})
	var relOnce sync.Once
	t.Cleanup(func() { relOnce.Do(func() { close(nextRelease) }) })
	var runs atomic.Int32
	fn := func(ctx context.Context, tx pgx.Tx) (int, error) {
		n := runs.Add(1)
		if _, err := tx.Exec(ctx, `INSERT INTO effects VALUES (1)`); err != nil {
			return 0, err
		}
		switch n {
		case 1:
			close(fInside)
			<-fRelease
			panic("fn panics")
		case 2:
			close(nextInside)
			<-nextRelease
		}
		return int(n), nil
	}
	fDone := make(chan any, 1)
	go func() {
		defer func() { fDone <- recover() }()
		_, _, _ = dbidem.Do(ctx, pool, job, dbidem.TxOptions{}, fn)
	}()
	<-fInside
	const dups = 3
	type res struct {
		n        int
		replayed bool
		err      error
		at       time.Duration
	}
	start := time.Now()
	results := make(chan res, dups)
	for range dups {
		go func() {
			n, replayed, err := dbidem.Do(ctx, pool, job, dbidem.TxOptions{}, fn)
			results <- res{n, replayed, err, time.Since(start)}
		}()
	}
	gateWait(t, "the duplicates wait in Go", func() bool { return gate.Waiting() == dups })
	close(fRelease)
	if p := <-fDone; p == nil {
		t.Fatal("F did not panic")
	}
	select {
	case <-nextInside:
	case <-time.After(10 * time.Second):
		t.Fatal("no duplicate ran fn after F's panic")
	}
	// The next holder works; the others should wait in Go for it.
	var early []res
	timeout := time.After(500 * time.Millisecond)
collect:
	for {
		select {
		case r := <-results:
			early = append(early, r)
		case <-timeout:
			break collect
		}
	}
	waiting, lockWaits := gate.Waiting(), gate.LockWaits()
	relOnce.Do(func() { close(nextRelease) })
	all := early
	for range dups - len(early) {
		all = append(all, <-results)
	}
	for _, r := range early {
		t.Errorf("while the duplicate that took the key after F's panic worked, another was answered after %s: %d %v %v; "+
			"want a wait in Go (lock timeout 8 s) and its answer", r.at.Round(time.Millisecond), r.n, r.replayed, r.err)
	}
	if waiting != dups-1 || lockWaits != 0 {
		t.Errorf("while the next holder worked: Waiting()=%d LockWaits()=%d, want %d waiting in Go, 0 on the key's row",
			waiting, lockWaits, dups-1)
	}
	for _, r := range all {
		if r.err != nil && !errors.Is(r.err, dbidem.ErrInProgress) {
			t.Errorf("duplicate: %v", r.err)
		}
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM effects`); n != 1 {
		t.Errorf("%d effects, want 1", n)
	}
	if gate.Waiting() != 0 || gate.WaitingBytes() != 0 || gate.LockWaits() != 0 {
		t.Errorf("after: Waiting()=%d WaitingBytes()=%d LockWaits()=%d", gate.Waiting(), gate.WaitingBytes(), gate.LockWaits())
	}
}

// TestGateStorm: 200 Run calls of one key with mixed bodies, the key deleted (as expired) a
// few times under them: one effect per answer (fresh claim), and after the storm the Gate
// holds nothing: gauges at 0 and a new request of the key serialises behind a slow holder as
// on a fresh Gate.
func TestGateStorm(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 10)
	ctx := context.Background()
	pgtest.Exec(t, pool, `CREATE TABLE effects (n int)`)
	gate := dbidem.NewGate(dbidem.GateOptions{MaxWaitingClaims: 3})
	var claimed atomic.Int32
	work := func(tx *dbidem.Tx, d dbidem.Decision) error {
		if d.Outcome == dbidem.Claimed {
			if _, err := tx.Exec(ctx, `INSERT INTO effects VALUES (1)`); err != nil {
				return err
			}
			time.Sleep(time.Duration(d.Attempt%7) * time.Millisecond)
			tx.CompleteOnCommit(dbidem.Response{Status: 201, Body: []byte(`{}`)})
			claimed.Add(1)
		}
		return nil
	}
	const n = 200
	var wg sync.WaitGroup
	errs := make(chan error, n)
	stop := make(chan struct{})
	var dw sync.WaitGroup
	dw.Add(1)
	go func() {
		defer dw.Done()
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			case <-time.After(15 * time.Millisecond):
			}
			_, _ = pool.Exec(ctx, `DELETE FROM idem.idempotency_keys WHERE key = 'storm' AND state = 'completed'`)
		}
	}()
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			body := `{"amount":1}`
			if i%17 == 0 {
				body = `{"amount":2}`
			}
			c := claim("storm", body)
			c.LockTimeout = 10 * time.Second
			cctx := ctx
			if i%13 == 0 {
				var cancel context.CancelFunc
				cctx, cancel = context.WithTimeout(ctx, time.Duration(i%5)*time.Millisecond)
				defer cancel()
			}
			if err := gate.RunHolding(cctx, pool, dbidem.TxOptions{}, c, int64(len(body)), work); err != nil &&
				!errors.Is(err, dbidem.ErrInProgress) && !errors.Is(err, context.DeadlineExceeded) {
				errs <- fmt.Errorf("request %d: %w", i, err)
			}
		}()
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(90 * time.Second):
		t.Fatal("the storm did not end: a deadlock?")
	}
	close(stop)
	dw.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if e := pgtest.Count(t, pool, `SELECT count(*) FROM effects`); e != int(claimed.Load()) {
		t.Errorf("%d effects, %d committed fresh claims", e, claimed.Load())
	}
	if gate.Waiting() != 0 || gate.WaitingBytes() != 0 || gate.LockWaits() != 0 {
		t.Errorf("after the storm: Waiting()=%d WaitingBytes()=%d LockWaits()=%d", gate.Waiting(), gate.WaitingBytes(), gate.LockWaits())
	}
	// A fresh generation: a slow holder, then a duplicate of this process must wait in Go.
	pgtest.Exec(t, pool, `DELETE FROM idem.idempotency_keys WHERE key = 'storm'`)
	inside, release := make(chan struct{}), make(chan struct{})
	c := claim("storm", `{"amount":1}`)
	c.LockTimeout = 5 * time.Second
	hDone := make(chan error, 1)
	go func() {
		hDone <- gate.Run(ctx, pool, dbidem.TxOptions{}, c, func(tx *dbidem.Tx, d dbidem.Decision) error {
			if d.Outcome == dbidem.Claimed {
				close(inside)
				<-release
				tx.CompleteOnCommit(dbidem.Response{Status: 201})
			}
			return nil
		})
	}()
	<-inside
	dDone := make(chan error, 1)
	var dOut dbidem.Outcome
	go func() {
		dDone <- gate.Run(ctx, pool, dbidem.TxOptions{}, c, func(tx *dbidem.Tx, d dbidem.Decision) error { dOut = d.Outcome; return nil })
	}()
	gateWaitOr := time.Now().Add(3 * time.Second)
	for gate.Waiting() != 1 && time.Now().Before(gateWaitOr) {
		time.Sleep(2 * time.Millisecond)
	}
	waiting, lockWaits := gate.Waiting(), gate.LockWaits()
	close(release)
	if err := <-hDone; err != nil {
		t.Error(err)
	}
	if err := <-dDone; err != nil || dOut != dbidem.Replay {
		t.Errorf("the duplicate after the storm: %v %q", err, dOut)
	}
	if waiting != 1 || lockWaits != 0 {
		t.Errorf("after the storm, a duplicate of a slow holder: Waiting()=%d LockWaits()=%d, want 1, 0 (a wait in Go)", waiting, lockWaits)
	}
}

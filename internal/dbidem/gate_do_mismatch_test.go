package dbidem_test

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/internal/dbidem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestGateDoMismatchLineHidesAnswer: a flight that read a committed key (a replay, or a
// mismatch: another request's answer) leaves it answered (D215), so that a repeat behind a line
// of such flights waits past its bound for the answer. Do (and DoLease) turn a Mismatch into an
// error their unit of work returns (ErrMismatch), and the Gate marked a flight answered only
// when its unit returned nil: behind a line of Do mismatches, 2 or 3 of 5 repeats of the
// answered job got ErrInProgress at their lock timeout, although nothing was in progress and
// the answer was stored before they came. Behind a line of replays, none did.
func TestGateDoMismatchLineHidesAnswer(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 6)
	ctx := context.Background()
	run := func(key string, aheadInput int) (busy int, aheadErrs map[string]int) {
		gate := dbidem.NewGate(dbidem.GateOptions{})
		job := dbidem.Job{Principal: "alice", Key: key, Action: "a", Input: map[string]int{"n": 1}, Gate: gate,
			LockTimeout: 150 * time.Millisecond}
		fn := func(context.Context, pgx.Tx) (int, error) { return 1, nil }
		if _, _, err := dbidem.Do(ctx, pool, job, dbidem.TxOptions{}, fn); err != nil {
			t.Fatal(err)
		}
		ahead := job
		ahead.Input = map[string]int{"n": aheadInput}
		ahead.LockTimeout = 30 * time.Second // the line itself never runs out
		const nm, nd = 300, 1
		line := make(chan error, nm)
		for range nm {
			go func() { _, _, err := dbidem.Do(ctx, pool, ahead, dbidem.TxOptions{}, fn); line <- err }()
		}
		gateWait(t, "the line waits in Go", func() bool { return gate.Waiting() >= 25 })
		dups := make(chan error, nd)
		for range nd {
			go func() {
				v, replayed, err := dbidem.Do(ctx, pool, job, dbidem.TxOptions{}, fn)
				if err == nil && (!replayed || v != 1) {
					err = errors.New("not a replay")
				}
				dups <- err
			}()
		}
		for range nd {
			if err := <-dups; err != nil {
				if !errors.Is(err, dbidem.ErrInProgress) {
					t.Errorf("a repeat: %v", err)
				}
				busy++
			}
		}
		aheadErrs = map[string]int{}
		for range nm {
			err := <-line
			switch {
			case err == nil:
				aheadErrs["nil"]++
			case errors.Is(err, dbidem.ErrMismatch):
				aheadErrs["mismatch"]++
			default:
				aheadErrs[err.Error()]++
			}
		}
		return busy, aheadErrs
	}
	// One repeat per line: a repeat that replays marks the key answered for the others.
	busyR, busyM := 0, 0
	var aheadR, aheadM map[string]int
	for i := range 5 {
		b, a := run(fmt.Sprintf("do-replays-%d", i), 1)
		busyR, aheadR = busyR+b, a
		b, a = run(fmt.Sprintf("do-mismatches-%d", i), 2)
		busyM, aheadM = busyM+b, a
	}
	t.Logf("behind %v replays: %d of 5 repeats ErrInProgress; behind %v mismatches: %d of 5", aheadR, busyR, aheadM, busyM)
	if busyM > 0 {
		t.Errorf("%d of 5 Do repeats of an answered job, behind a line of Do mismatches, got ErrInProgress "+
			"(nothing was in progress; the answer was stored before they came); behind a line of replays %d did", busyM, busyR)
	}
}

// TestGateStormLeavesNoGoroutines: after a storm on two keys (duplicates that wait in Go, run
// out of their bound, are cancelled mid-wait, wait on a row held by another transaction with
// and without a slot, have that wait cancelled), the Gate's gauges are back to zero and no
// goroutine is left behind (not parallel: runtime.NumGoroutine counts the whole process).
func TestGateStormLeavesNoGoroutines(t *testing.T) {
	pool, url := pgtest.NewPool(t, 8)
	ctx := context.Background()
	gate := dbidem.NewGate(dbidem.GateOptions{MaxWaitingClaims: 2})
	complete := func(tx *dbidem.Tx, d dbidem.Decision) error {
		if d.Outcome == dbidem.Claimed {
			tx.CompleteOnCommit(dbidem.Response{Status: 201})
		}
		return nil
	}
	// Warm the pool and the Gate's default lock timeout.
	if err := gate.Run(ctx, pool, dbidem.TxOptions{}, claim("warm", `{}`), complete); err != nil {
		t.Fatal(err)
	}
	time.Sleep(200 * time.Millisecond)
	before := runtime.NumGoroutine()

	other := holdElsewhere(t, url, "held")
	inside, release := make(chan struct{}), make(chan struct{})
	slowDone := make(chan error, 1)
	go func() {
		c := claim("slow", `{}`)
		c.LockTimeout = 10 * time.Second
		slowDone <- gate.Run(ctx, pool, dbidem.TxOptions{}, c, func(tx *dbidem.Tx, d dbidem.Decision) error {
			if d.Outcome == dbidem.Claimed {
				close(inside)
				<-release
				tx.CompleteOnCommit(dbidem.Response{Status: 201})
			}
			return nil
		})
	}()
	<-inside
	var wg sync.WaitGroup
	for i := range 60 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			key := "slow"
			if i%3 == 0 {
				key = "held"
			}
			c := claim(key, `{}`)
			c.LockTimeout = time.Duration(50+i*10) * time.Millisecond
			cctx, cancel := context.WithCancel(ctx)
			defer cancel()
			if i%4 == 0 {
				time.AfterFunc(time.Duration(i)*5*time.Millisecond, cancel)
			}
			err := gate.RunDetached(cctx, ctx, pool, dbidem.TxOptions{}, c, 100, complete)
			if err != nil && !errors.Is(err, dbidem.ErrInProgress) && !dbidem.IsWaitEnded(err) && !errors.Is(err, context.Canceled) {
				t.Errorf("request %d (%s): %v", i, key, err)
			}
		}()
	}
	time.Sleep(300 * time.Millisecond)
	close(release)
	_ = other.Rollback(ctx)
	wg.Wait()
	if err := <-slowDone; err != nil {
		t.Fatal(err)
	}
	var after int
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		after = runtime.NumGoroutine()
		if after <= before || time.Now().After(deadline) {
			break
		}
	}
	if after > before {
		buf := make([]byte, 1<<20)
		n := runtime.Stack(buf, true)
		t.Errorf("goroutines: %d before the storm, %d after it\n%s", before, after, buf[:n])
	}
	if gate.Waiting() != 0 || gate.WaitingBytes() != 0 || gate.LockWaits() != 0 {
		t.Errorf("after: Waiting()=%d WaitingBytes()=%d LockWaits()=%d", gate.Waiting(), gate.WaitingBytes(), gate.LockWaits())
	}
}

// TestGateWaitInGoCountsTowardLockTimeout: the wait in Go counts toward the lock timeout, and
// what is left of it bounds the wait on the row (D215). Another transaction holds the key's
// row. The flight ahead waits 900 ms for a connection of an exhausted pool, then only probes
// and leaves; the duplicate behind it, with a lock timeout of 1 s, waited 900 ms in Go: its wait
// on the row is what is left, about 100 ms (not a whole lock timeout more: 1.9 s in all).
func TestGateWaitInGoCountsTowardLockTimeout(t *testing.T) {
	t.Parallel()
	pool, url := pgtest.NewPool(t, 2)
	ctx := context.Background()
	gate := dbidem.NewGate(dbidem.GateOptions{})
	const lt = time.Second
	holdElsewhere(t, url, "count")
	var conns []*pgxpool.Conn
	for range 2 {
		c, err := pool.Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		conns = append(conns, c)
	}
	// A and D go through one Acquirer that tells when A, the first to ask it for a connection,
	// has the flight (the Gate lets a request ask for a connection only then) and waits for
	// one: D starts only then, not after a fixed pause that a loaded machine may outlast, which
	// let D take the flight ahead of A.
	asking := &signalAcquirer{Pool: pool, asked: make(chan struct{})}
	aDone := make(chan error, 1)
	go func() {
		c := claim("count", `{}`)
		c.LockTimeout = dbidem.Probe
		aDone <- gate.Run(ctx, asking, dbidem.TxOptions{}, c, func(*dbidem.Tx, dbidem.Decision) error { return nil })
	}()
	<-asking.asked // A has the flight and waits for a connection
	start := time.Now()
	dDone := make(chan error, 1)
	go func() {
		c := claim("count", `{}`)
		c.LockTimeout = lt
		dDone <- gate.Run(ctx, asking, dbidem.TxOptions{}, c, func(*dbidem.Tx, dbidem.Decision) error { return nil })
	}()
	gateWait(t, "the duplicate waits in Go", func() bool { return gate.Waiting() == 1 })
	time.Sleep(lt*9/10 - time.Since(start))
	for _, c := range conns {
		c.Release()
	}
	if err := <-aDone; !errors.Is(err, dbidem.ErrInProgress) {
		t.Fatalf("A: %v", err)
	}
	err := <-dDone
	took := time.Since(start)
	t.Logf("the duplicate: %v after %s", err, took.Round(time.Millisecond))
	if !errors.Is(err, dbidem.ErrInProgress) {
		t.Errorf("the duplicate: %v, want ErrInProgress", err)
	}
	if took > lt*3/2 {
		t.Errorf("the duplicate with a lock timeout of %s took %s: its wait in Go did not count toward its wait on the row", lt, took)
	}
	if took < lt-100*time.Millisecond {
		t.Errorf("the duplicate with a lock timeout of %s gave up after %s", lt, took)
	}
}

// signalAcquirer is a pool whose asked channel is closed at the first call of Acquire.
type signalAcquirer struct {
	*pgxpool.Pool
	once  sync.Once
	asked chan struct{}
}

func (s *signalAcquirer) Acquire(ctx context.Context) (*pgxpool.Conn, error) {
	s.once.Do(func() { close(s.asked) })
	return s.Pool.Acquire(ctx)
}

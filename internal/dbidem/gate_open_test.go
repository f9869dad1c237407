package dbidem_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/pgidem/pgidem/internal/dbidem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestOpenKeyFreshClaimSerialises (D211): a key whose flight answered is "open": its
// waiters claim side by side. When one of them finds the key gone (expired, released, cleaned
// up) it claims it afresh and runs the work; the Gate's doc says requests of this process with
// the same key then run one at a time again, a newcomer waiting in Go (no connection, no lock
// wait on the database). In D211's first build the key stayed open while that fresh claim's
// work ran, so newcomers claimed at once, took wait slots and waited on the key's row in the
// database, and the one that found no slot was refused at once although the answer came well
// within its lock timeout.
func TestOpenKeyFreshClaimSerialises(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 8)
	ctx := context.Background()
	pgtest.Exec(t, pool, `CREATE TABLE effects (n int)`)
	gate := dbidem.NewGate(dbidem.GateOptions{MaxWaitingClaims: 1})
	c := claim("open-key", `{"amount":1}`)
	c.LockTimeout = 10 * time.Second

	var (
		fInside, fRelease   = make(chan struct{}), make(chan struct{})
		wInside, wRelease   = make(chan struct{}), make(chan struct{})
		n1Inside, n1Release = make(chan struct{}), make(chan struct{})
	)
	var once sync.Once
	releaseAll := func() {
		once.Do(func() {
			for _, ch := range []chan struct{}{fRelease, wRelease, n1Release} {
				select {
				case <-ch:
				default:
					close(ch)
				}
			}
		})
	}
	t.Cleanup(releaseAll)

	// work runs once per claim: a fresh claim inserts an effect and completes; a replay only
	// blocks where the test says.
	work := func(inside, release chan struct{}) func(tx *dbidem.Tx, d dbidem.Decision) error {
		return func(tx *dbidem.Tx, d dbidem.Decision) error {
			if d.Outcome == dbidem.Claimed {
				if _, err := tx.Exec(ctx, `INSERT INTO effects VALUES (1)`); err != nil {
					return err
				}
				tx.CompleteOnCommit(dbidem.Response{Status: 201, Body: []byte(`{"ok":true}`)})
			}
			if inside != nil {
				close(inside)
				<-release
			}
			return nil
		}
	}
	errs := make(chan error, 10)
	run := func(name string, fn func(tx *dbidem.Tx, d dbidem.Decision) error) chan error {
		done := make(chan error, 1)
		go func() {
			err := gate.Run(ctx, pool, dbidem.TxOptions{}, c, fn)
			if err != nil {
				err = errors.Join(errors.New(name), err)
			}
			done <- err
		}()
		return done
	}

	// F: the flight, which claims and works.
	fDone := run("F", work(fInside, fRelease))
	<-fInside
	// W: a duplicate of this process, waiting in Go for F.
	wDone := run("W", work(wInside, wRelease))
	waitGauge(t, "W waits in Go", func() bool { return gate.Waiting() == 1 })
	close(fRelease)
	if err := <-fDone; err != nil {
		t.Fatal(err)
	}
	// W replays (side by side, the key is open) and holds its replay open.
	<-wInside
	// Meanwhile the key goes away (its TTL ran out and the cleaner deleted it).
	pgtest.Exec(t, pool, `DELETE FROM idem.idempotency_keys WHERE key = 'open-key'`)
	// N1 claims the key afresh and runs the work (a long handler).
	n1Done := run("N1", work(n1Inside, n1Release))
	select {
	case <-n1Inside:
	case <-time.After(10 * time.Second):
		t.Fatal("N1 never claimed")
	}
	// W ends: it found the answer. N1 still works on the key in this process.
	close(wRelease)
	if err := <-wDone; err != nil {
		t.Fatal(err)
	}

	// N2: a duplicate of N1, of this process. It should wait in Go for N1.
	n2Done := run("N2", work(nil, nil))
	deadline := time.Now().Add(3 * time.Second)
	for gate.Waiting() == 0 && gate.LockWaits() == 0 && time.Now().Before(deadline) {
		time.Sleep(2 * time.Millisecond)
	}
	waitsInGo, lockWaits := gate.Waiting(), gate.LockWaits()
	// N3: another. With N2 waiting in Go it should wait in Go too, not be refused.
	start := time.Now()
	n3Done := run("N3", work(nil, nil))
	var n3Err error
	var n3Early bool
	select {
	case n3Err = <-n3Done:
		n3Early = true
	case <-time.After(500 * time.Millisecond):
	}
	n3After := time.Since(start)
	close(n1Release)
	if err := <-n1Done; err != nil {
		errs <- err
	}
	if err := <-n2Done; err != nil {
		errs <- err
	}
	if !n3Early {
		n3Err = <-n3Done
	}
	close(errs)
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM effects`); n != 2 {
		t.Errorf("%d effects, want 2 (F's and N1's)", n)
	}
	if waitsInGo != 1 || lockWaits != 0 {
		t.Errorf("while N1 (this process) worked on the key afresh, N2: Waiting()=%d LockWaits()=%d; "+
			"want it waiting in Go (1, 0), not on the key's row in the database", waitsInGo, lockWaits)
	}
	if n3Early {
		t.Errorf("N3, a duplicate of N1 of this process, was answered after %s with %v; want a wait in Go and N1's answer", n3After, n3Err)
	} else if n3Err != nil {
		t.Errorf("N3: %v", n3Err)
	}
	for err := range errs {
		t.Error(err)
	}
	if gate.Waiting() != 0 || gate.WaitingBytes() != 0 {
		t.Errorf("after: Waiting()=%d WaitingBytes()=%d, want 0, 0", gate.Waiting(), gate.WaitingBytes())
	}
}

func waitGauge(t *testing.T, what string, ok func() bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !ok(); {
		if time.Now().After(deadline) {
			t.Fatalf("timed out: %s", what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

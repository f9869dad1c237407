package dbidem_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/internal/dbidem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestZZGate3FailedFreshClaimWaiterWaitsOnRow: D211 "one that claims it afresh takes its
// flight at once, before its work runs, so that the requests after it wait for that work in Go"
// and the Probe doc "A request of this process never waits on a key that another request of
// this process holds (the Gate makes it wait in Go)".
//
// An open key expires; another process holds it uncommitted; A and B (this process) claim it
// beside each other and wait on that row. It rolls back: A claims afresh (takes the flight), B
// waits on A's row. W (a newcomer) waits in Go for A's flight. A's work fails (rollback): A
// leaves, closing its flight unanswered, and B claims afresh at about the same time. When A's
// leave comes first, W takes a flight of its own (nothing in g.flights, the open key gone), and
// B's claimed() then puts its flight beside W's: W probes, finds B's row and waits on it in the
// database with a wait slot, although B is a request of this process.
func TestZZGate3FailedFreshClaimWaiterWaitsOnRow(t *testing.T) {
	t.Parallel()
	pool, url := pgtest.NewPool(t, 10)
	ctx := context.Background()
	bad, good, other := 0, 0, 0
	var notes []string
	for i := range 6 {
		r := gate3FailedFreshClaimRound(t, ctx, pool, url, fmt.Sprintf("ffc-%d", i))
		notes = append(notes, r)
		switch r {
		case "bad":
			bad++
		case "good":
			good++
		default:
			other++
		}
	}
	t.Logf("rounds: %v", notes)
	if bad > 0 {
		t.Errorf("in %d of %d rounds, while B (a request of this process) worked on its fresh claim of the key, the newcomer W "+
			"that had waited in Go for A's failed flight waited on B's row in the database with a wait slot (LockWaits()=1, Waiting()=0); "+
			"want W waiting in Go for B's work (Waiting()=1, LockWaits()=0)", bad, len(notes))
	}
}

func gate3FailedFreshClaimRound(t *testing.T, ctx context.Context, pool *pgxpool.Pool, url, key string) string {
	gate := dbidem.NewGate(dbidem.GateOptions{MaxWaitingClaims: 4})
	c := claim(key, `{"amount":1}`)
	c.LockTimeout = 5 * time.Second

	fIn, fRel := make(chan struct{}), make(chan struct{})
	hIn, hRel := make(chan struct{}), make(chan struct{})
	aIn, aRel := make(chan struct{}), make(chan struct{})
	bIn, bRel := make(chan struct{}), make(chan struct{})
	chans := []chan struct{}{fRel, hRel, aRel, bRel}
	var once sync.Once
	releaseAll := func() {
		once.Do(func() {
			for _, ch := range chans {
				select {
				case <-ch:
				default:
					close(ch)
				}
			}
		})
	}
	defer releaseAll()
	hold := func(in, rel chan struct{}) func(tx *dbidem.Tx, d dbidem.Decision) error {
		return func(tx *dbidem.Tx, d dbidem.Decision) error {
			if d.Outcome == dbidem.Claimed {
				tx.CompleteOnCommit(dbidem.Response{Status: 201, Body: []byte(`{}`)})
			}
			close(in)
			<-rel
			return nil
		}
	}
	run := func(fn func(tx *dbidem.Tx, d dbidem.Decision) error) chan error {
		done := make(chan error, 1)
		go func() { done <- gate.Run(ctx, pool, dbidem.TxOptions{}, c, fn) }()
		return done
	}
	// F answers the key; H waited for it and replays, holding: the key is open.
	fDone := run(hold(fIn, fRel))
	<-fIn
	hDone := run(hold(hIn, hRel))
	gateWait(t, "H waits in Go", func() bool { return gate.Waiting() == 1 })
	close(fRel)
	if err := <-fDone; err != nil {
		t.Fatal(err)
	}
	<-hIn
	// The key expires (is cleaned up); another process claims it, uncommitted.
	pgtest.Exec(t, pool, `DELETE FROM idem.idempotency_keys WHERE key = '`+key+`'`)
	otx, err := pgtest.Connect(t, url).Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = otx.Rollback(ctx) }()
	if d, err := dbidem.Begin(ctx, otx, c); err != nil || d.Outcome != dbidem.Claimed {
		t.Fatalf("the other process's claim: %+v %v", d, err)
	}
	// A and B claim beside each other on the open key; the first to claim fails after a while,
	// the second holds.
	var fresh atomic.Int32
	boom := errors.New("boom")
	ab := func(tx *dbidem.Tx, d dbidem.Decision) error {
		if d.Outcome != dbidem.Claimed {
			return nil
		}
		switch fresh.Add(1) {
		case 1:
			close(aIn)
			<-aRel
			return boom
		default:
			tx.CompleteOnCommit(dbidem.Response{Status: 201, Body: []byte(`{}`)})
			close(bIn)
			<-bRel
			return nil
		}
	}
	abDone := make(chan error, 2)
	for range 2 {
		go func() { abDone <- gate.Run(ctx, pool, dbidem.TxOptions{}, c, ab) }()
	}
	gateWait(t, "A and B wait on the other process's row", func() bool { return gate.LockWaits() == 2 })
	_ = otx.Rollback(ctx)
	<-aIn
	gateWait(t, "A's slot freed", func() bool { return gate.LockWaits() == 1 })
	// W, a newcomer, waits in Go for A.
	var wOut atomic.Value
	wDone := run(func(tx *dbidem.Tx, d dbidem.Decision) error {
		wOut.Store(d.Outcome)
		if d.Outcome == dbidem.Claimed {
			tx.CompleteOnCommit(dbidem.Response{Status: 201, Body: []byte(`{}`)})
		}
		return nil
	})
	gateWait(t, "W waits in Go", func() bool { return gate.Waiting() == 1 })
	close(aRel)
	if err := <-abDone; !errors.Is(err, boom) {
		t.Fatalf("A: %v", err)
	}
	select {
	case <-bIn:
	case <-time.After(3 * time.Second):
		releaseAll()
		<-abDone
		<-wDone
		<-hDone
		return fmt.Sprintf("inconclusive(W:%v)", wOut.Load())
	}
	// B holds its fresh claim, in its work. Where does W wait?
	time.Sleep(200 * time.Millisecond)
	waiting, lockWaits := gate.Waiting(), gate.LockWaits()
	releaseAll()
	if err := <-abDone; err != nil {
		t.Errorf("B: %v", err)
	}
	if err := <-wDone; err != nil {
		t.Errorf("W: %v", err)
	}
	if err := <-hDone; err != nil {
		t.Errorf("H: %v", err)
	}
	if gate.Waiting() != 0 || gate.LockWaits() != 0 || gate.WaitingBytes() != 0 {
		t.Errorf("after: Waiting()=%d LockWaits()=%d WaitingBytes()=%d", gate.Waiting(), gate.LockWaits(), gate.WaitingBytes())
	}
	if lockWaits == 1 && waiting == 0 {
		return "bad"
	}
	if waiting == 1 && lockWaits == 0 {
		return "good"
	}
	return fmt.Sprintf("odd(waiting=%d,lockWaits=%d)", waiting, lockWaits)
}

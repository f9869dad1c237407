package dbidem_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/internal/dbidem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestReplayCommitHangsHoldsTheLine: a first build of D215 had a flight that decided Replay
// mark the key answered at once, so a duplicate behind it whose bound passed kept waiting
// "while the request ahead only reads". But the flight ahead is not done reading when it
// decides: its transaction still has to COMMIT, and a COMMIT that never answers (a black-holed
// connection; the library bounds only a claim's statement and a lease claim's COMMIT) held
// every duplicate behind it, in Go, without any bound. The mark is set as the flight leaves,
// and a wait past the bound waits at most ClaimReplyMargin for each flight ahead. The Gate
// promises: "past its lock timeout it gets ErrInProgress without touching the database".
func TestReplayCommitHangsHoldsTheLine(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	direct, url := pgtest.NewPool(t, 2)
	job := dbidem.Job{Principal: "alice", Key: "hang", Action: "a", LockTimeout: 500 * time.Millisecond,
		Gate: dbidem.NewGate(dbidem.GateOptions{})}
	if _, _, err := dbidem.Do(ctx, direct, job, dbidem.TxOptions{}, func(context.Context, pgx.Tx) (string, error) { return "first", nil }); err != nil {
		t.Fatal(err)
	}
	p := pgtest.NewProxy(t, pgtest.TCPAddr(t))
	pool, err := pgxpool.New(ctx, pgtest.Via(t, url, p.Addr)+" pool_max_conns=2")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	if v, replayed, err := dbidem.Do(ctx, pool, job, dbidem.TxOptions{}, func(context.Context, pgx.Tx) (string, error) { return "again", nil }); err != nil || !replayed || v != "first" {
		t.Fatalf("warm-up: %q %v %v", v, replayed, err)
	}
	p.CommitHole.Store(true) // a connection's COMMIT, and everything after it, is swallowed
	actx, cancelA := context.WithCancel(ctx)
	defer cancelA()
	aDone := make(chan error, 1)
	go func() {
		_, _, err := dbidem.Do(actx, pool, job, dbidem.TxOptions{}, func(context.Context, pgx.Tx) (string, error) { return "again", nil })
		aDone <- err
	}()
	// A decides Replay at once and sends COMMIT, which never answers.
	time.Sleep(500 * time.Millisecond)
	select {
	case err := <-aDone:
		t.Fatalf("the flight ahead returned: %v; want it hung at its COMMIT", err)
	default:
	}
	start := time.Now()
	bDone := make(chan error, 1)
	go func() {
		_, _, err := dbidem.Do(ctx, pool, job, dbidem.TxOptions{}, func(context.Context, pgx.Tx) (string, error) { return "again", nil })
		bDone <- err
	}()
	returned := false
	select {
	case err := <-bDone:
		returned = true
		took := time.Since(start)
		t.Logf("the duplicate behind: %v after %s", err, took.Round(time.Millisecond))
		if took > 2*time.Second {
			t.Errorf("the duplicate behind waited %s, its lock timeout is 500 ms", took)
		}
		if err != nil && !errors.Is(err, dbidem.ErrInProgress) {
			t.Errorf("the duplicate behind: %v, want ErrInProgress (or its replay)", err)
		}
	case <-time.After(8 * time.Second):
		t.Errorf("(Gate.Waiting %d: the duplicate waits in Go) "+
			"a Do with a lock timeout of 500 ms still waits in Go after 8 s behind a flight that decided Replay "+
			"and hangs at its COMMIT: the answered mark (set as the flight decides, D215) ends the bound of every duplicate behind it",
			job.Gate.Waiting())
	}
	p.CommitHole.Store(false)
	cancelA()
	<-aDone
	if !returned {
		select {
		case <-bDone:
		case <-time.After(10 * time.Second):
			t.Errorf("the duplicate behind did not return even after the flight ahead ended")
		}
	}
}

// TestWaitInGoBehindAFlightOnTheRow: another process holds the key's uncommitted claim;
// a Do of this process waits on its row (with a slot), and a second Do of this process waits in
// Go behind the first. Both get the other process's answer when it commits within their lock
// timeout, and ErrInProgress at about their lock timeout (not before) when it does not ("a
// concurrent run past the lock timeout, ErrInProgress").
func TestWaitInGoBehindAFlightOnTheRow(t *testing.T) {
	t.Parallel()
	for _, holdQ := range []time.Duration{1200 * time.Millisecond, 3500 * time.Millisecond} {
		t.Run(holdQ.String(), func(t *testing.T) {
			t.Parallel()
			pool1, _ := pgtest.NewPool(t, 4)
			pool2, err := pgxpool.New(context.Background(), pgtest.URLOf(t, pool1))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(pool2.Close)
			ctx := context.Background()
			job := dbidem.Job{Principal: "alice", Key: "behind-row", Action: "a", LockTimeout: 2 * time.Second,
				Gate: dbidem.NewGate(dbidem.GateOptions{})}
			jobQ := job
			jobQ.Gate = dbidem.NewGate(dbidem.GateOptions{}) // another process
			inQ := make(chan struct{})
			qDone := make(chan error, 1)
			go func() {
				_, _, err := dbidem.Do(ctx, pool2, jobQ, dbidem.TxOptions{}, func(context.Context, pgx.Tx) (string, error) {
					close(inQ)
					time.Sleep(holdQ)
					return "Q", nil
				})
				qDone <- err
			}()
			<-inQ
			type res struct {
				v        string
				replayed bool
				err      error
				took     time.Duration
			}
			run := func(out chan<- res) {
				start := time.Now()
				v, replayed, err := dbidem.Do(ctx, pool1, job, dbidem.TxOptions{}, func(context.Context, pgx.Tx) (string, error) { return "me", nil })
				out <- res{v, replayed, err, time.Since(start)}
			}
			first, second := make(chan res, 1), make(chan res, 1)
			go run(first)
			time.Sleep(50 * time.Millisecond)
			go run(second)
			for i, c := range []chan res{first, second} {
				r := <-c
				t.Logf("hold %s, Do %d: %q replayed=%v err=%v after %s", holdQ, i+1, r.v, r.replayed, r.err, r.took.Round(time.Millisecond))
				if holdQ < 2*time.Second {
					if r.err != nil || !r.replayed || r.v != "Q" {
						t.Errorf("Do %d: the other process committed within the lock timeout; got %q %v %v after %s, want its answer",
							i+1, r.v, r.replayed, r.err, r.took)
					}
					continue
				}
				if !errors.Is(r.err, dbidem.ErrInProgress) || r.took < 1900*time.Millisecond || r.took > 3*time.Second {
					t.Errorf("Do %d: got %v after %s; want ErrInProgress at about the lock timeout (2 s)", i+1, r.err, r.took)
				}
			}
			if qerr := <-qDone; qerr != nil {
				t.Fatalf("the other process: %v", qerr)
			}
		})
	}
}

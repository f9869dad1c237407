package idemhttp_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	idemhttp "github.com/pgidem/pgidem/internal/http"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestGateLateRepeatBehindAnsweredLine (D234): a repeat of an answered request that comes
// into a line of duplicates after its first flight left, behind a flight that is slow to
// read the answer, waits for it past its DuplicateWait and replays. It had never seen a
// flight leave with the answer, so at its bound it was told 409 request_in_progress although
// the answer had been stored before it arrived (a load on the machine made the Gate's line
// slow enough for that in CI: TestGateMismatchLineHidesAnswer). The flight ahead is held on
// its way to the database by the pool (its connection's PrepareConn waits), not by a sleep.
func TestGateLateRepeatBehindAnsweredLine(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.NewDB(t)
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 4
	// A hold armed here stops the next acquisition of a connection until it is released.
	type hold struct {
		arrived, release chan struct{}
		free             func()
	}
	holds := make(chan hold, 2)
	var armed []hold
	arm := func() hold {
		release := make(chan struct{})
		h := hold{make(chan struct{}), release, sync.OnceFunc(func() { close(release) })}
		armed = append(armed, h)
		holds <- h
		return h
	}
	cfg.PrepareConn = func(ctx context.Context, _ *pgx.Conn) (bool, error) {
		select {
		case h := <-holds:
			close(h.arrived)
			select {
			case <-h.release:
			case <-ctx.Done():
				return false, ctx.Err()
			}
		default:
		}
		return true, nil
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	const wait = 300 * time.Millisecond
	e := newGateEnvOn(t, pool, url, func(o *idemhttp.Options) { o.DuplicateWait = wait })
	// A test that stops early frees what it holds, or the server's Close waits for it.
	t.Cleanup(func() {
		for _, h := range armed {
			h.free()
		}
	})
	const key, body, other = "late-repeat", `{"amount":1}`, `{"amount":2}`
	if r := e.send(ctx, "/tx", key, body); r.status != 201 {
		t.Fatalf("first: %d %s", r.status, r.body)
	}
	within := func(what string, c <-chan gateReply) gateReply {
		t.Helper()
		select {
		case r := <-c:
			return r
		case <-time.After(10 * time.Second):
			t.Fatalf("no answer to %s", what)
			return gateReply{}
		}
	}
	// The line: a mismatch held on its way to the database (the first flight), and a second
	// mismatch waiting behind it in the Gate.
	h1 := arm()
	m1, m2, rep := make(chan gateReply, 1), make(chan gateReply, 1), make(chan gateReply, 1)
	go func() { m1 <- e.send(ctx, "/tx", key, other) }()
	<-h1.arrived
	go func() { m2 <- e.send(ctx, "/tx", key, other) }()
	untilTrue(t, "the second mismatch waits behind the first", 5*time.Second, func() bool { return e.m.GateStats().Waiting >= 1 })
	// The first flight reads the answer and leaves; the second, which saw it leave, is the
	// flight now, held on its way to the database.
	h2 := arm()
	h1.free()
	if r := within("the first mismatch", m1); r.status != 422 {
		t.Fatalf("the first mismatch: %d %s", r.status, r.body)
	}
	<-h2.arrived
	// The repeat comes into the line now: it never saw a flight leave with the answer.
	go func() { rep <- e.send(ctx, "/tx", key, body) }()
	untilTrue(t, "the repeat waits behind the second mismatch", 5*time.Second, func() bool { return e.m.GateStats().Waiting >= 1 })
	select {
	case r := <-rep:
		t.Fatalf("the repeat answered %d %s after %v, while the flight ahead of it was held (its DuplicateWait is %v)",
			r.status, r.body, r.took, wait)
	case <-time.After(3 * wait):
	}
	h2.free()
	if r := within("the second mismatch", m2); r.status != 422 {
		t.Errorf("the second mismatch: %d %s", r.status, r.body)
	}
	r := within("the repeat", rep)
	if r.status != 201 || r.header.Get("Idempotent-Replayed") != "true" {
		t.Errorf("the repeat: %d %s (replayed %q), want the stored 201", r.status, r.body, r.header.Get("Idempotent-Replayed"))
	}
	if n := pgtest.Count(t, e.pool, `SELECT count(*) FROM effects`); n != 1 {
		t.Errorf("effects: %d, want 1", n)
	}
	e.gateIdle(t)
}

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

// gateHold stops the next acquisition of a connection by a gate env's pool until it is
// released: arrived is closed when an acquisition reaches it.
type gateHold struct {
	arrived, release chan struct{}
	free             func()
}

// newHeldGateEnv is a gate env with DuplicateWait wait on a pool of 4 connections whose next
// acquisition arm() holds (its connection's PrepareConn waits), so that a flight is held on
// its way to the database by the pool, not by a sleep.
func newHeldGateEnv(t *testing.T, wait time.Duration) (e *gateEnv, arm func() gateHold) {
	t.Helper()
	ctx := context.Background()
	url := pgtest.NewDB(t)
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 4
	holds := make(chan gateHold, 2)
	var mu sync.Mutex
	var armed []gateHold
	arm = func() gateHold {
		release := make(chan struct{})
		h := gateHold{make(chan struct{}), release, sync.OnceFunc(func() { close(release) })}
		mu.Lock()
		armed = append(armed, h)
		mu.Unlock()
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
	e = newGateEnvOn(t, pool, url, func(o *idemhttp.Options) { o.DuplicateWait = wait })
	// A test that stops early frees what it holds, or the server's Close waits for it.
	t.Cleanup(func() {
		mu.Lock()
		defer mu.Unlock()
		for _, h := range armed {
			h.free()
		}
	})
	return e, arm
}

// within is the reply on c, or the test's end after 10 s.
func within(t *testing.T, what string, c <-chan gateReply) gateReply {
	t.Helper()
	select {
	case r := <-c:
		return r
	case <-time.After(10 * time.Second):
		t.Fatalf("no answer to %s", what)
		return gateReply{}
	}
}

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
	const wait = 300 * time.Millisecond
	e, arm := newHeldGateEnv(t, wait)
	const key, body, other = "late-repeat", `{"amount":1}`, `{"amount":2}`
	if r := e.send(ctx, "/tx", key, body); r.status != 201 {
		t.Fatalf("first: %d %s", r.status, r.body)
	}
	// The line: a mismatch held on its way to the database (the first flight), and a second
	// mismatch waiting behind it in the Gate.
	h1 := arm()
	m1, m2 := make(chan gateReply, 1), make(chan gateReply, 1)
	go func() { m1 <- e.send(ctx, "/tx", key, other) }()
	<-h1.arrived
	go func() { m2 <- e.send(ctx, "/tx", key, other) }()
	untilTrue(t, "the second mismatch waits behind the first", 5*time.Second, func() bool { return e.m.GateStats().Waiting >= 1 })
	// The first flight reads the answer and leaves; the second, which saw it leave, is the
	// flight now, held on its way to the database.
	h2 := arm()
	h1.free()
	if r := within(t, "the first mismatch", m1); r.status != 422 {
		t.Fatalf("the first mismatch: %d %s", r.status, r.body)
	}
	<-h2.arrived
	// The repeat comes into the line now: it never saw a flight leave with the answer.
	repeatBehindHeldFlight(t, e, key, body, wait, h2, "the second mismatch", m2)
	if n := pgtest.Count(t, e.pool, `SELECT count(*) FROM effects`); n != 1 {
		t.Errorf("effects: %d, want 1", n)
	}
	e.gateIdle(t)
}

// TestGateRepeatBehindANewcomerAfterALine (D260): a line's flight leaves the key answered
// while nobody of the line is left to start the next flight (the request that waited behind
// it was refused at its bound), and a request that comes in just then starts it: the Gate
// kept nothing of the key once no request worked on it, so that flight started knowing
// nothing, and a repeat of the answered request behind it, slow to read the answer (held
// here by the pool, as a loaded machine holds it), was told 409 request_in_progress at its
// bound although the answer had been stored before it arrived. CI met it in
// TestGateMismatchLineHidesAnswer, whose line's late goroutines started flights between two
// flights of the line. The Gate now remembers, for a moment, that a line left the key
// answered.
func TestGateRepeatBehindANewcomerAfterALine(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	const wait = 300 * time.Millisecond
	e, arm := newHeldGateEnv(t, wait)
	const key, body, other = "newcomer", `{"amount":1}`, `{"amount":2}`
	if r := e.send(ctx, "/tx", key, body); r.status != 201 {
		t.Fatalf("first: %d %s", r.status, r.body)
	}
	// A line: a mismatch held on its way to the database, and one behind it that is refused
	// at its bound (it never saw a flight leave).
	h1 := arm()
	m1, m2, m3 := make(chan gateReply, 1), make(chan gateReply, 1), make(chan gateReply, 1)
	go func() { m1 <- e.send(ctx, "/tx", key, other) }()
	<-h1.arrived
	go func() { m2 <- e.send(ctx, "/tx", key, other) }()
	if r := within(t, "the second mismatch", m2); r.status != 409 {
		t.Fatalf("the second mismatch, behind a held flight: %d %s, want 409 at its bound", r.status, r.body)
	}
	// The line's flight reads the answer and leaves with nobody behind it.
	h1.free()
	if r := within(t, "the first mismatch", m1); r.status != 422 {
		t.Fatalf("the first mismatch: %d %s", r.status, r.body)
	}
	// A newcomer starts the next flight, held on its way to the database; the repeat comes in
	// behind it.
	h2 := arm()
	go func() { m3 <- e.send(ctx, "/tx", key, other) }()
	<-h2.arrived
	repeatBehindHeldFlight(t, e, key, body, wait, h2, "the newcomer", m3)
	if n := pgtest.Count(t, e.pool, `SELECT count(*) FROM effects`); n != 1 {
		t.Errorf("effects: %d, want 1", n)
	}
	e.gateIdle(t)
}

// repeatBehindHeldFlight sends a repeat of the answered request (key, body) behind the flight
// that h holds, the mismatch whose reply comes on ahead: the repeat must wait past its
// DuplicateWait while that flight is held, and replay the stored 201 once it is let go (the
// mismatch gets 422).
func repeatBehindHeldFlight(t *testing.T, e *gateEnv, key, body string, wait time.Duration, h gateHold, aheadName string, ahead <-chan gateReply) {
	t.Helper()
	rep := make(chan gateReply, 1)
	go func() { rep <- e.send(context.Background(), "/tx", key, body) }()
	untilTrue(t, "the repeat waits behind "+aheadName, 5*time.Second, func() bool { return e.m.GateStats().Waiting >= 1 })
	select {
	case r := <-rep:
		t.Fatalf("the repeat answered %d %s after %v, while the flight ahead of it (%s) was held (its DuplicateWait is %v)",
			r.status, r.body, r.took, aheadName, wait)
	case <-time.After(3 * wait):
	}
	h.free()
	if r := within(t, aheadName, ahead); r.status != 422 {
		t.Errorf("%s: %d %s", aheadName, r.status, r.body)
	}
	r := within(t, "the repeat", rep)
	if r.status != 201 || r.header.Get("Idempotent-Replayed") != "true" {
		t.Errorf("the repeat: %d %s (replayed %q), want the stored 201", r.status, r.body, r.header.Get("Idempotent-Replayed"))
	}
}

package dbidem_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/internal/dbidem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// slowExtensions is a Querier (a wrapper of the pool, as a tracing one is) whose extensions
// come back only once release is closed, whatever their context says: run first when run is
// set (the extension lands in the database, its reply is late), else not run at all (it
// never reached the database).
type slowExtensions struct {
	pool    *pgxpool.Pool
	run     bool
	release chan struct{}
	held    chan struct{} // gets one value as each extension is held
}

func (s slowExtensions) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if !strings.Contains(sql, "idem_extend") {
		return s.pool.QueryRow(ctx, sql, args...)
	}
	var end *int64
	var err error
	if s.run {
		err = s.pool.QueryRow(context.Background(), sql, args...).Scan(&end)
	}
	s.held <- struct{}{}
	<-s.release
	if !s.run {
		err = errors.New("the extension was never sent")
	}
	return scanned{end, err}
}

// scanned is a row already read: one nullable bigint, or an error.
type scanned struct {
	end *int64
	err error
}

func (r scanned) Scan(dest ...any) error {
	if r.err != nil {
		return r.err
	}
	*(dest[0].(**int64)) = r.end
	return nil
}

func (s slowExtensions) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	return s.pool.Exec(ctx, sql, args...)
}

// leaseUnder claims a key with a lease of 600 ms and starts its heartbeat on s.
func leaseUnder(t *testing.T, s slowExtensions, key string) (*dbidem.Lease, dbidem.Claim) {
	t.Helper()
	c := claim(key, `{"job":1}`)
	c.Lease = 600 * time.Millisecond
	d, err := dbidem.Begin(context.Background(), s.pool, c)
	if err != nil || d.Outcome != dbidem.Claimed {
		t.Fatalf("claim: %+v %v", d, err)
	}
	l := dbidem.KeepAlive(context.Background(), s, c.Principal, c.Key, d.Attempt, dbidem.LeaseOptions{Lease: c.Lease, Start: d.Sent})
	return l, c
}

// TestLeaseLostAtItsEndWhileAnExtensionHangs (D261): the lease's end is told to the work at
// that end, not when the extension in flight comes back. The loss was signalled by the
// heartbeat's loop, which waits through each extension: an extension still on its way at the
// lease's end (blocked on a locked table, as in TestLeaseLostBeforeATakeoverUnderATableLock,
// which once learned 34 ms late; here a Querier that gives up only when it is let go) held the
// news until it returned, when another process may already have taken the key over. On the
// tree before, the work learned nothing until the extension was let go 3 s later.
func TestLeaseLostAtItsEndWhileAnExtensionHangs(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 4)
	s := slowExtensions{pool: pool, release: make(chan struct{}), held: make(chan struct{}, 8)}
	l, c := leaseUnder(t, s, "hung-extension")
	released := false
	release := func() {
		if !released {
			released = true
			close(s.release)
		}
	}
	defer func() { release(); l.Stop() }()
	<-s.held
	end := l.End()
	select {
	case <-l.Context().Done():
	case <-time.After(3 * time.Second):
		release()
		t.Fatalf("the lease ran out at %v and the work was not told within 3 s, while its extension hung", end.Format(time.StampMilli))
	}
	lostAt := time.Now()
	// A wake-up on a loaded machine can take a few hundred milliseconds; waiting for the hung
	// extension takes until it is let go (3 s, the select above).
	if late := lostAt.Sub(end); late > time.Second {
		t.Errorf("the work learned its lease was lost %v after the lease's end by its own clock", late)
	}
	if !errors.Is(context.Cause(l.Context()), dbidem.ErrLeaseLost) || !l.Lost() || l.TakenOver() {
		t.Errorf("cause %v, lost %v, taken over %v: want ErrLeaseLost by the clock", context.Cause(l.Context()), l.Lost(), l.TakenOver())
	}
	// The work was told at its lease's end by its own clock, which is never later than the
	// database's: no other process could take the key over before then.
	var dbEnd time.Time
	if err := pool.QueryRow(context.Background(), `SELECT lease_expires_at FROM idem.idempotency_keys WHERE key = $1`, c.Key).Scan(&dbEnd); err != nil {
		t.Fatal(err)
	}
	if end.After(dbEnd) {
		t.Errorf("the lease's end by the process's clock, %v, is after the database's, %v", end.Format(time.StampMicro), dbEnd.Format(time.StampMicro))
	}
	release()
	if !l.Stop() || l.Extensions() != 0 {
		t.Errorf("Stop: lost %v after %d extensions, want lost after none", l.Lost(), l.Extensions())
	}
}

// TestLeaseExtensionHeardAfterTheEndKeepsItLost (D261): an extension that landed but whose
// reply came back after the lease had run out by the process's clock does not undo the loss
// the work was told: its context stays ended with ErrLeaseLost, Lost stays true, and the
// extension is not counted.
func TestLeaseExtensionHeardAfterTheEndKeepsItLost(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 4)
	s := slowExtensions{pool: pool, run: true, release: make(chan struct{}), held: make(chan struct{}, 8)}
	l, _ := leaseUnder(t, s, "late-reply")
	once := false
	release := func() {
		if !once {
			once = true
			close(s.release)
		}
	}
	defer func() { release(); l.Stop() }()
	<-s.held // the extension landed; its reply waits
	select {
	case <-l.Context().Done():
	case <-time.After(3 * time.Second):
		release()
		t.Fatal("the lease ran out and the work was not told within 3 s, while its extension's reply was held")
	}
	release()
	lost := l.Stop() // waits for the heartbeat, which has read the late reply
	if !lost || !errors.Is(context.Cause(l.Context()), dbidem.ErrLeaseLost) || l.Extensions() != 0 {
		t.Errorf("after a late reply: Stop says lost %v, cause %v, %d extensions; want lost, ErrLeaseLost, none",
			lost, context.Cause(l.Context()), l.Extensions())
	}
}

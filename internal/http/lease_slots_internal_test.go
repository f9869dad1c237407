package idemhttp

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgidem/pgidem/internal/dbidem"
)

// takeWithin takes a lease slot, or fails once d has passed.
func takeWithin(l leaseSlots, d time.Duration) (func(), error) {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	return l.take(ctx)
}

// TestLeaseStatementsHoldAtMostHalfThePool (D229): lease statements run up to MaxWaitingClaims
// or half the pool's connections, whichever is more, and not beyond: under a locked key table
// they all wait on it, and the rest of the pool serves other keys.
func TestLeaseStatementsHoldAtMostHalfThePool(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		conns         int32
		waiting, want int
	}{{4, 1, 2}, {8, 2, 4}, {8, 5, 5}, {2, 1, 1}, {3, 1, 1}, {16, 4, 8}} {
		l := newLeaseSlots(c.waiting, c.conns)
		var releases []func()
		for range c.want {
			release, err := takeWithin(l, time.Second)
			if err != nil {
				t.Fatalf("pool %d, MaxWaitingClaims %d: statement %d of %d found no slot: %v", c.conns, c.waiting, len(releases)+1, c.want, err)
			}
			releases = append(releases, release)
		}
		if _, err := takeWithin(l, 50*time.Millisecond); !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("pool %d, MaxWaitingClaims %d: statement %d ran (%v), want it to wait", c.conns, c.waiting, c.want+1, err)
		}
		releases[0]()
		release, err := takeWithin(l, time.Second)
		if err != nil {
			t.Fatalf("pool %d, MaxWaitingClaims %d: no slot after one was given back: %v", c.conns, c.waiting, err)
		}
		release()
		for _, r := range releases[1:] {
			r()
		}
		if len(l) != 0 {
			t.Fatalf("pool %d, MaxWaitingClaims %d: %d slots still taken after every statement gave its back", c.conns, c.waiting, len(l))
		}
	}
}

// panicky is a pool whose code panics in every call (an application's tracer or wrapper).
type panicky struct{}

func (panicky) QueryRow(context.Context, string, ...any) pgx.Row { panic("the pool's code panics") }
func (panicky) Exec(context.Context, string, ...any) (pgconn.CommandTag, error) {
	panic("the pool's code panics")
}

// TestLeaseSlotGoesBackWhenThePoolPanics (D225, D229): a statement whose pool panics gives its
// slot back, also an answer's recording sent from dbidem's own goroutine (its panic is an
// outcome unknown there); else every later lease statement of the process would wait for it.
func TestLeaseSlotGoesBackWhenThePoolPanics(t *testing.T) {
	t.Parallel()
	s := slotted{q: panicky{}, slots: newLeaseSlots(1, 2)}
	ctx := context.Background()
	for i := range 2 {
		func() {
			defer func() {
				if recover() == nil {
					t.Fatal("the pool's panic did not come through")
				}
			}()
			if i == 0 {
				_ = s.QueryRow(ctx, "SELECT 1").Scan()
			} else {
				_, _ = s.Exec(ctx, "SELECT 1")
			}
		}()
	}
	cctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	if err := dbidem.Complete(cctx, s, "alice", "k", 1, dbidem.Response{Status: 201}); !errors.Is(err, dbidem.ErrCommitUnknown) {
		t.Fatalf("a recording whose pool panicked: %v, want ErrCommitUnknown", err)
	}
	release, err := takeWithin(s.slots, time.Second)
	if err != nil {
		t.Fatalf("the slot did not come back after the pool's panics: %v", err)
	}
	release()
}

// TestRecordingWaitsForASlotOnlyAsLongAsItsContext (review finding, D229): an answer's
// recording is sent from dbidem's goroutine on a context that never ends (D165), and took its
// slot there: with every slot taken it waited for one forever, past its deadline and past
// Shutdown, and sent its statement whenever one came. It takes the slot on the caller's
// context now, and nothing is sent when that ends first.
func TestRecordingWaitsForASlotOnlyAsLongAsItsContext(t *testing.T) {
	t.Parallel()
	s := slotted{q: panicky{}, slots: newLeaseSlots(1, 2)}
	hold, err := takeWithin(s.slots, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	cctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	began := time.Now()
	err = dbidem.Complete(cctx, s, "alice", "k", 1, dbidem.Response{Status: 201})
	if !errors.Is(err, context.DeadlineExceeded) || errors.Is(err, dbidem.ErrCommitUnknown) || time.Since(began) > 2*time.Second {
		t.Fatalf("a recording that found no slot: %v after %v, want its context's end, not an outcome unknown (nothing was sent)",
			err, time.Since(began))
	}
	hold()
	// Given back: nothing waits for it any more (the panicky pool would panic on the
	// goroutine; a statement sent now would show as a slot taken).
	time.Sleep(50 * time.Millisecond)
	if len(s.slots) != 0 {
		t.Fatalf("%d slots taken after the recording gave up: it still waited and took one", len(s.slots))
	}
}

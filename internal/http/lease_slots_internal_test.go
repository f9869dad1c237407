package idemhttp

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgidem/pgidem/internal/pgtest"
)

// takeWithin takes room for a lease statement, or fails once d has passed.
func takeWithin(t *testing.T, l *leaseSlots, d time.Duration) (func(), error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	return l.take(ctx)
}

// TestLeaseStatementsHoldAtMostHalfThePool (D229): with every slot taken, lease statements run
// beside the slots up to half the pool's connections, and not beyond, whatever they hold yet:
// under a locked key table they all wait on it, and the other half of the pool serves other
// keys. A pool busy with other work leaves nothing beside the slots.
func TestLeaseStatementsHoldAtMostHalfThePool(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ conns, slots, want int }{{4, 1, 2}, {8, 2, 4}, {8, 5, 5}, {2, 1, 1}, {3, 1, 1}} {
		pool, _ := pgtest.NewPool(t, int32(c.conns))
		l := newLeaseSlots(c.slots, pool)
		var releases []func()
		for range c.want {
			release, err := takeWithin(t, l, time.Second)
			if err != nil {
				t.Fatalf("pool %d, %d slots: statement %d of %d found no room: %v", c.conns, c.slots, len(releases)+1, c.want, err)
			}
			releases = append(releases, release)
		}
		if _, err := takeWithin(t, l, 100*time.Millisecond); !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("pool %d, %d slots: statement %d ran (%v), want it to wait: lease statements would hold more than half the pool",
				c.conns, c.slots, c.want+1, err)
		}
		// One gives its room back: the next one runs.
		releases[len(releases)-1]()
		release, err := takeWithin(t, l, time.Second)
		if err != nil {
			t.Fatalf("pool %d, %d slots: no room after one gave its back: %v", c.conns, c.slots, err)
		}
		release()
		for _, r := range releases[:len(releases)-1] {
			r()
		}
		if len(l.slots) != 0 || l.extra != 0 {
			t.Fatalf("pool %d, %d slots: %d slots and %d beside still taken after every statement gave its room back",
				c.conns, c.slots, len(l.slots), l.extra)
		}
	}

	// The pool's connections held by other work (a transactional handler's, say): once they
	// leave less than half the pool free, nothing runs beside the one slot.
	pool, _ := pgtest.NewPool(t, 4)
	l := newLeaseSlots(1, pool)
	ctx := context.Background()
	for range 2 {
		c, err := pool.Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Release()
	}
	release, err := takeWithin(t, l, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer release()
	if _, err := takeWithin(t, l, 100*time.Millisecond); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("a statement ran beside the slot (%v) while other work held half the pool", err)
	}
}

// panicky is a pool whose code panics in every call (an application's tracer or wrapper).
type panicky struct{}

func (panicky) QueryRow(context.Context, string, ...any) pgx.Row { panic("the pool's code panics") }
func (panicky) Exec(context.Context, string, ...any) (pgconn.CommandTag, error) {
	panic("the pool's code panics")
}

// TestLeaseSlotGoesBackWhenThePoolPanics (D225, D229): a statement whose pool panics gives its
// room back, in a slot or beside the slots; else every later lease statement of the process
// would wait for it.
func TestLeaseSlotGoesBackWhenThePoolPanics(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 4)
	s := slotted{q: panicky{}, slots: newLeaseSlots(1, pool)}
	ctx := context.Background()
	for i := range 3 {
		func() {
			// The first in the slot, the second beside it (the slot held by hand), the third
			// through Exec.
			if i == 1 {
				s.slots.slots <- struct{}{}
				defer func() { <-s.slots.slots }()
			}
			defer func() {
				if recover() == nil {
					t.Fatal("the pool's panic did not come through")
				}
			}()
			if i == 2 {
				_, _ = s.Exec(ctx, "SELECT 1")
			} else {
				_ = s.QueryRow(ctx, "SELECT 1").Scan()
			}
		}()
	}
	if len(s.slots.slots) != 0 || s.slots.extra != 0 {
		t.Fatalf("%d slots and %d beside taken after the pool's panics, want none", len(s.slots.slots), s.slots.extra)
	}
}

package idemhttp

import (
	"context"
	"errors"
	"slices"
	"sync"
	"time"
)

// ErrShutdown is the cause (context.Cause) of a keyed request's work context when the
// middleware's Shutdown gave up waiting for it: the handler should stop. On a transactional
// route the unit of work rolls back (nothing is stored; the client's retry runs it again). On
// a lease route, unless the handler answers with a 2xx or a final error, its lease ends at
// once without an answer, and the client's retry runs the work again under the same
// ClaimInfo.ProviderKey.
var ErrShutdown = errors.New("idem: shut down")

// shutdownGrace is how long Shutdown waits, once its context ended, for the work it cancelled
// to roll back or give its lease up.
const shutdownGrace = 5 * time.Second

// workTracker counts the requests in flight whose work outlives their clients (keyed
// requests, and every request to a lease route) and ends their work at Shutdown.
type workTracker struct {
	mu sync.Mutex
	// all counts them from their arrival (the principal function, the body); working from the
	// moment they start their claim or their work (begin). Before its deadline Shutdown waits
	// for all; after it, for working only: a request still arriving then is refused before
	// any claim or work, and nothing of it needs the grace.
	all, working count
	// ended: Shutdown's deadline has passed. live are the cancel functions of the work
	// contexts in use: the tracker ends them itself, before the call that ends it returns, so
	// that a request reading its context's cause sees the deadline the moment it is known.
	ended  bool
	live   map[uint64]context.CancelCauseFunc
	nextID uint64
	// draining ends when Shutdown starts: duplicates stop waiting for answers then.
	draining context.Context
	drain    context.CancelFunc
	// deadlines are the contexts Shutdown was called with: stopped reads them itself, so a
	// request that comes once one has ended is refused, not only once the callback that
	// stops the tracker has run.
	deadlines []context.Context
}

// count is a number of requests, with a channel closed while it is 0.
type count struct {
	n    int
	idle chan struct{}
}

func newCount() count {
	c := count{idle: make(chan struct{})}
	close(c.idle)
	return c
}

func (c *count) add() {
	if c.n == 0 {
		c.idle = make(chan struct{})
	}
	c.n++
}

func (c *count) done() {
	if c.n--; c.n == 0 {
		close(c.idle)
	}
}

func newWorkTracker() *workTracker {
	draining, drain := context.WithCancel(context.Background())
	return &workTracker{all: newCount(), working: newCount(), live: map[uint64]context.CancelCauseFunc{},
		draining: draining, drain: drain}
}

// enter counts one request in flight from its arrival (so a Shutdown that comes while its
// principal function runs or its body arrives waits for it too), and returns the function
// to call when it is done (once; later calls do nothing).
func (t *workTracker) enter() func() {
	t.mu.Lock()
	t.all.add()
	t.mu.Unlock()
	return sync.OnceFunc(func() {
		t.mu.Lock()
		t.all.done()
		t.mu.Unlock()
	})
}

// begin counts a request entered before as working, from its claim or its work on, and
// returns the function to call when it is done; or false, counting nothing, when Shutdown's
// deadline has passed (its work would be ended as it starts). One lock orders it with
// Shutdown's: a request that began before the deadline is waited for during the grace.
func (t *workTracker) begin() (func(), bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.stoppedLocked() {
		return nil, false
	}
	t.working.add()
	return sync.OnceFunc(func() {
		t.mu.Lock()
		t.working.done()
		t.mu.Unlock()
	}), true
}

// context returns the context of one piece of work: it ends when parent ends or the tracker is
// stopped (at once if it was already), with cause ErrShutdown, and with the returned function.
func (t *workTracker) context(parent context.Context) (context.Context, func()) {
	ctx, cancel := context.WithCancelCause(parent)
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.stoppedLocked() {
		cancel(ErrShutdown)
		return ctx, func() { cancel(context.Canceled) }
	}
	id := t.nextID
	t.nextID++
	t.live[id] = cancel
	return ctx, func() {
		t.mu.Lock()
		delete(t.live, id)
		t.mu.Unlock()
		cancel(context.Canceled)
	}
}

// stoppedLocked tells whether the work of this middleware is ended: Shutdown's context has
// ended. It stops the tracker itself when that context ended and its callback has not run yet.
func (t *workTracker) stoppedLocked() bool {
	if !t.ended && slices.ContainsFunc(t.deadlines, func(ctx context.Context) bool { return ctx.Err() != nil }) {
		t.stopLocked()
	}
	return t.ended
}

// stop ends the work: every work context in use ends with cause ErrShutdown before it
// returns, and every one made later is ended as it is made.
func (t *workTracker) stop() {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.stopLocked()
}

func (t *workTracker) stopLocked() {
	if t.ended {
		return
	}
	t.ended = true
	// A context's cancel ends its descendants at once and calls back its AfterFunc
	// functions in goroutines of their own: nothing here takes t.mu again.
	for _, cancel := range t.live {
		cancel(ErrShutdown)
	}
}

// idle returns the channel closed while c counts nothing.
func (t *workTracker) idle(c *count) <-chan struct{} {
	t.mu.Lock()
	defer t.mu.Unlock()
	return c.idle
}

// Shutdown waits for the keyed requests still in flight, whose work runs on a context that
// outlives the client (so an HTTP server's own Shutdown, which stops waiting for a handler
// whose client is gone, does not end it), and for every request to a lease route: from their
// arrival (the principal function, the body) to those committing or recording their answers. Duplicates waiting for another request's answer stop
// waiting at once (409 request_in_progress; the client retries against the next process);
// requests with fresh keys are still served until ctx ends.
// When ctx ends first, it ends the work's contexts with cause ErrShutdown (a transactional unit
// of work rolls back; lease work gives its lease up), waits up to five seconds more for them,
// and returns ctx's error. From the moment ctx ends, a keyed request that comes is answered
// 503 shutting_down before any claim (one whose claim was under way is ended at once, and
// answered so), also when Shutdown had returned early (nothing was in flight). Call it beside the HTTP server's
// Shutdown, with the same deadline, and wait for both before the process exits:
//
//	go func() { errc <- srv.Shutdown(ctx) }()
//	workErr := m.Shutdown(ctx)
//	srvErr := <-errc
func (m *Middleware) Shutdown(ctx context.Context) error {
	m.work.drain()
	m.work.mu.Lock()
	m.work.deadlines = append(m.work.deadlines, ctx)
	m.work.mu.Unlock()
	context.AfterFunc(ctx, m.work.stop)
	select {
	case <-m.work.idle(&m.work.all):
		if ctx.Err() == nil {
			return nil
		}
	case <-ctx.Done():
	}
	m.work.stop()
	// The grace is for the work that began: a request still arriving is refused when it
	// would begin (workTracker.begin).
	grace := time.NewTimer(shutdownGrace)
	defer grace.Stop()
	select {
	case <-m.work.idle(&m.work.working):
	case <-grace.C:
	}
	return ctx.Err()
}

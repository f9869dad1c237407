package idemhttp

import (
	"context"
	"errors"
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

// workTracker counts the keyed requests in flight (their work outlives their clients) and
// ends their work at Shutdown.
type workTracker struct {
	mu     sync.Mutex
	n      int
	idle   chan struct{} // closed while n == 0
	stop   context.Context
	cancel context.CancelCauseFunc
	// draining ends when Shutdown starts: duplicates stop waiting for answers then.
	draining context.Context
	drain    context.CancelFunc
	// deadlines are the contexts Shutdown was called with: stopped reads them itself, so a
	// request that comes once one has ended is refused, not only once the callback that
	// stops the tracker has run.
	deadlines []context.Context
}

func newWorkTracker() *workTracker {
	stop, cancel := context.WithCancelCause(context.Background())
	draining, drain := context.WithCancel(context.Background())
	t := &workTracker{idle: make(chan struct{}), stop: stop, cancel: cancel, draining: draining, drain: drain}
	close(t.idle)
	return t
}

// enter counts one keyed request in flight, from before its claim (so a Shutdown that comes
// while it claims waits for it too), and returns the function to call when it is done.
func (t *workTracker) enter() func() {
	t.mu.Lock()
	if t.n == 0 {
		t.idle = make(chan struct{})
	}
	t.n++
	t.mu.Unlock()
	var once sync.Once
	return func() {
		once.Do(func() {
			t.mu.Lock()
			if t.n--; t.n == 0 {
				close(t.idle)
			}
			t.mu.Unlock()
		})
	}
}

// context returns the context of one piece of work: it ends when parent ends or the tracker is
// stopped (at once if it was already), and with the returned function.
func (t *workTracker) context(parent context.Context) (context.Context, func()) {
	ctx, cancel := context.WithCancelCause(parent)
	stop := context.AfterFunc(t.stop, func() { cancel(context.Cause(t.stop)) })
	if t.stopped() {
		// AfterFunc on an ended context calls back in a goroutine of its own: the work would
		// start on a live context and have it ended under it a moment later (D179).
		cancel(context.Cause(t.stop))
	}
	return ctx, func() {
		stop()
		cancel(context.Canceled)
	}
}

// stopped tells whether the work of this middleware is ended: Shutdown's context has ended.
// It stops the tracker itself when that context ended and its callback has not run yet.
func (t *workTracker) stopped() bool {
	if t.stop.Err() != nil {
		return true
	}
	t.mu.Lock()
	deadlines := t.deadlines
	t.mu.Unlock()
	for _, ctx := range deadlines {
		if ctx.Err() != nil {
			t.cancel(ErrShutdown)
			return true
		}
	}
	return false
}

func (t *workTracker) idleChan() <-chan struct{} {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.idle
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
	context.AfterFunc(ctx, func() { m.work.cancel(ErrShutdown) })
	select {
	case <-m.work.idleChan():
		if ctx.Err() == nil {
			return nil
		}
	case <-ctx.Done():
	}
	m.work.cancel(ErrShutdown)
	grace := time.NewTimer(shutdownGrace)
	defer grace.Stop()
	select {
	case <-m.work.idleChan():
	case <-grace.C:
	}
	return ctx.Err()
}

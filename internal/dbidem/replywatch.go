package dbidem

import (
	"context"
	"net"
	"sync"
	"time"
)

// replyTick is how often a bound that has passed looks again at a reply that is arriving.
const replyTick = 250 * time.Millisecond

// replyTickSlack is the kernel's clock tick at its coarsest (HZ=100), by which the time since
// it last received data may be off.
const replyTickSlack = 10 * time.Millisecond

// replyMinBytes is the least a counted reply must bring in each ClaimReplyMargin once its
// bound has passed: a reply that trickles in slower (a byte every few seconds) is taken for
// lost, or it would hold its request and connection for as long as the trickle lasts.
const replyMinBytes = 64 << 10

// replyGraces is how many more times (replyTick/5 apart) a bound looks for unread bytes when
// its connection counts no received bytes (a Unix socket, a system other than Linux), before
// it takes a reply that has not begun for lost: the reader may have just emptied the buffer.
const replyGraces = 4

// replyWatch tells a reply that is slow to arrive (a large answer on a slow link or a loaded
// machine) from one that is not coming (D213). It looks at the connection's socket only once
// the bound has passed, never on the way of a statement that answers in time: on Linux over
// TCP, when the kernel last received data and how many bytes it has received; anywhere it can,
// the bytes waiting unread. Where it can see neither, nothing ever arrives and a bound ends as
// a plain deadline would.
type replyWatch struct {
	conn    net.Conn
	start   time.Time // when the statement was sent (about)
	looked  bool      // the socket was looked at once
	rx      uint64    // the bytes received at the last look
	counted bool      // the socket counts the bytes it received
	began   bool      // some of the reply was seen arriving
	last    time.Time // when it was last seen arriving
	// The window of a counted reply: from when, and from how many bytes received, it must
	// bring replyMinBytes within ClaimReplyMargin.
	windowAt time.Time
	windowRx uint64
}

func newReplyWatch(c net.Conn, start time.Time) *replyWatch {
	for {
		u, ok := c.(interface{ NetConn() net.Conn })
		if !ok {
			break
		}
		c = u.NetConn()
	}
	return &replyWatch{conn: c, start: start, counted: true}
}

// arriving reports whether bytes of the reply came in since the last look (at the first look,
// since the statement was sent), or wait to be read; false, for good, once a counted reply
// brought less than replyMinBytes in a window of ClaimReplyMargin.
func (w *replyWatch) arriving(now time.Time) bool {
	moved := false
	if w.counted {
		rx, since, ok := socketReceived(w.conn)
		switch {
		case !ok:
			w.counted = false
		case !w.looked:
			// Data received after the statement was sent is its reply's; the kernel counts in
			// clock ticks (up to 10 ms), so data received just before it is not taken for it.
			moved = since+replyTickSlack < now.Sub(w.start)
			w.windowAt, w.windowRx = now, rx
		default:
			moved = rx != w.rx
			if now.Sub(w.windowAt) >= ClaimReplyMargin {
				if rx-w.windowRx < replyMinBytes {
					w.began, w.counted, w.conn = false, false, nil // a trickle: nothing counts any more
					return false
				}
				w.windowAt, w.windowRx = now, rx
			}
		}
		w.rx = rx
		if moved {
			w.began, w.last = true, now.Add(-since)
		}
	}
	w.looked = true
	if w.conn != nil && socketUnread(w.conn) > 0 {
		w.began, w.last = true, now
		return true
	}
	return moved
}

// replyBound bounds a statement whose reply may never come (D168, D213): its context ends
// with errNoReply d after now, unless its reply is arriving by then; from then on it ends once
// no byte of the reply has arrived for ClaimReplyMargin. The bytes of a large reply keep
// coming for as long as its transfer takes; a connection that delivers none is given up as
// before.
type replyBound struct {
	mu     sync.Mutex
	w      *replyWatch
	t      *time.Timer
	cancel context.CancelCauseFunc
	graces int
	done   bool
}

func newReplyBound(parent context.Context, conn net.Conn, d time.Duration) (context.Context, *replyBound) {
	ctx, cancel := context.WithCancelCause(parent)
	b := &replyBound{cancel: cancel}
	if conn != nil {
		b.w = newReplyWatch(conn, time.Now())
	}
	b.mu.Lock()
	b.t = time.AfterFunc(d, b.fire)
	b.mu.Unlock()
	return ctx, b
}

func (b *replyBound) fire() {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.done {
		return
	}
	if w := b.w; w != nil {
		now := time.Now()
		switch {
		case w.arriving(now), w.began && now.Sub(w.last) < ClaimReplyMargin:
			b.t.Reset(replyTick)
			return
		case !w.began && !w.counted && w.conn != nil && b.graces < replyGraces:
			b.graces++
			b.t.Reset(replyTick / 5)
			return
		}
	}
	b.done = true
	b.cancel(errNoReply)
}

// live reports whether the bound has not ended: its statement is under way, and the bound
// still waits for its reply (before its end, or past it while the reply arrives). An outer
// bound (a lease claim's whole unit) defers to it: the bound ends its own statement, counted
// from the statement's sending, where the outer bound counts from the unit's start (a wait
// for a pool connection, probes) and would give up a statement sent late that still waits
// well within its lock timeout.
func (b *replyBound) live() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return !b.done
}

// stop ends the bound and its context; the statement is over. It tells whether the bound
// had been kept going past its end by a reply that was arriving.
func (b *replyBound) stop() (extended bool) {
	b.mu.Lock()
	extended = !b.done && b.w != nil && b.w.began
	b.done = true
	b.t.Stop()
	b.mu.Unlock()
	b.cancel(nil)
	return extended
}

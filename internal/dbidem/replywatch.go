package dbidem

import (
	"context"
	"net"
	"sync"
	"time"
)

// replyTick is how often a bound that has passed looks again at a reply that is arriving.
const replyTick = 250 * time.Millisecond

// replyMinBytes is the least a counted reply must bring in each ClaimReplyMargin once its
// bound has passed: a reply that trickles in slower (a byte every few seconds) is taken for
// lost, or it would hold its request and connection for as long as the trickle lasts.
const replyMinBytes = 64 << 10

// replyGraces is how many more times (replyTick/5 apart) a bound looks for unread bytes when
// its connection counts no received bytes (a Unix socket, a system other than Linux), before
// it takes a reply that has not begun for lost: the reader may have just emptied the buffer.
const replyGraces = 4

// replyWatch tells a reply that is slow to arrive (a large answer on a slow link or a loaded
// machine) from one that is not coming (D213). It looks at the connection's socket: the bytes
// its kernel has received (TCP on Linux counts them) and the bytes waiting unread. Where it can
// see neither, nothing ever arrives and a bound ends as a plain deadline would.
type replyWatch struct {
	conn    net.Conn
	rx      uint64
	counted bool      // the socket counts the bytes it received
	began   bool      // some of the reply was seen arriving
	last    time.Time // when it was last seen arriving
	// The window of a counted reply: from when, and from how many bytes received, it must
	// bring replyMinBytes within ClaimReplyMargin.
	windowAt time.Time
	windowRx uint64
}

func newReplyWatch(c net.Conn) *replyWatch {
	for {
		u, ok := c.(interface{ NetConn() net.Conn })
		if !ok {
			break
		}
		c = u.NetConn()
	}
	w := &replyWatch{conn: c}
	w.rx, w.counted = socketReceived(c)
	return w
}

// arriving reports whether bytes came in since the last look, or wait to be read; false, for
// good, once a counted reply brought less than replyMinBytes in a window of ClaimReplyMargin.
func (w *replyWatch) arriving(now time.Time) bool {
	moved := false
	if w.counted {
		rx, ok := socketReceived(w.conn)
		moved = ok && rx != w.rx
		if ok {
			w.rx = rx
		}
		if w.windowAt.IsZero() {
			w.windowAt, w.windowRx = now, w.rx
		} else if now.Sub(w.windowAt) >= ClaimReplyMargin {
			if w.rx-w.windowRx < replyMinBytes {
				w.began, w.counted = false, false
				w.conn = nil // a trickle: nothing counts any more
				return false
			}
			w.windowAt, w.windowRx = now, w.rx
		}
	}
	if moved || w.conn != nil && socketUnread(w.conn) > 0 {
		w.began, w.last = true, now
		return true
	}
	return false
}

// replyBound bounds a statement whose reply may never come (D168, D213): its context ends
// with errNoReply d after now, unless its reply is arriving by then; from then on it ends once
// no byte of the reply has arrived for ClaimReplyMargin. The bytes of a large reply keep
// coming for as long as its transfer takes; a connection that delivers none is given up as
// before.
type replyBound struct {
	mu      sync.Mutex
	w       *replyWatch
	t       *time.Timer
	cancel  context.CancelCauseFunc
	graces  int
	done    bool
	expired bool
}

func newReplyBound(parent context.Context, conn net.Conn, d time.Duration) (context.Context, *replyBound) {
	ctx, cancel := context.WithCancelCause(parent)
	b := &replyBound{cancel: cancel}
	if conn != nil {
		b.w = newReplyWatch(conn)
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
	b.expired, b.done = true, true
	b.cancel(errNoReply)
}

// receiving reports whether the statement's reply has begun to arrive and is still coming:
// an outer bound (a lease claim's whole unit) waits for it as this one does.
func (b *replyBound) receiving() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.done || b.w == nil {
		return false
	}
	now := time.Now()
	return b.w.arriving(now) || b.w.began && now.Sub(b.w.last) < ClaimReplyMargin
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

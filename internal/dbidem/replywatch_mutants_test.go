//go:build linux

package dbidem

// Tests from a mutation review of the reply watch (replywatch.go, replywatch_linux.go; D213,
// D236): each failed with a single-point change that the rest of the suite let pass. They use a
// real socket pair on this machine (no database), so they are fast; the watch's time is
// given to arriving where the test can, so a window of ClaimReplyMargin takes no time.

import (
	"context"
	"errors"
	"io"
	"net"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"
)

// watchPair is a connected pair of sockets over network ("tcp" on 127.0.0.1, or "unix"): the
// client's side (the watch's connection) and the server's (the database's). Both are closed
// at the test's end.
func watchPair(t *testing.T, network string) (client, server net.Conn) {
	t.Helper()
	addr := "127.0.0.1:0"
	if network == "unix" {
		addr = filepath.Join(t.TempDir(), "s")
	}
	ln, err := net.Listen(network, addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	accepted := make(chan net.Conn, 1)
	go func() {
		c, _ := ln.Accept()
		accepted <- c
	}()
	client, err = net.Dial(network, ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { client.Close() })
	select {
	case server = <-accepted:
	case <-time.After(10 * time.Second):
		t.Fatal("no connection accepted")
	}
	if server == nil {
		t.Fatal("accept failed")
	}
	t.Cleanup(func() { server.Close() })
	return client, server
}

// pairSend writes n bytes on server and reads them all on client (the reader keeps up, as pgx
// does): once it returns, the client's kernel has received them and nothing is unread.
func pairSend(t *testing.T, server, client net.Conn, n int) {
	t.Helper()
	werr := make(chan error, 1)
	go func() {
		_, err := server.Write(make([]byte, n))
		werr <- err
	}()
	client.SetReadDeadline(time.Now().Add(10 * time.Second))
	defer client.SetReadDeadline(time.Time{})
	if _, err := io.ReadFull(client, make([]byte, n)); err != nil {
		t.Fatal(err)
	}
	if err := <-werr; err != nil {
		t.Fatal(err)
	}
}

// pairUnread writes n bytes on server and waits until the client's socket holds them unread.
func pairUnread(t *testing.T, server, client net.Conn, n int) {
	t.Helper()
	if _, err := server.Write(make([]byte, n)); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for socketUnread(client) < n {
		if time.Now().After(deadline) {
			t.Fatalf("%d bytes written, %d unread on the client after 5 s", n, socketUnread(client))
		}
		time.Sleep(time.Millisecond)
	}
}

// pairDrain reads client until it is closed, counting the bytes: a reader that keeps up.
func pairDrain(client net.Conn) *atomic.Int64 {
	var n atomic.Int64
	go func() {
		buf := make([]byte, 64<<10)
		for {
			k, err := client.Read(buf)
			n.Add(int64(k))
			if err != nil {
				return
			}
		}
	}()
	return &n
}

// A counted reply (TCP) past its bound must bring replyMinBytes in each window of
// ClaimReplyMargin, each window measured from the last (D213): a reply that brought plenty in
// its first window and then trickles is given up at the end of the next, and for good (bytes
// unread afterwards do not bring it back, and it no longer counts as begun), even when a few
// bytes came in since the look before. A reply that moves before its first window ends is
// arriving, however few its bytes so far.
func TestReplyWatchTrickleWindows(t *testing.T) {
	t.Parallel()
	client, server := watchPair(t, "tcp")
	w := newReplyWatch(client, time.Now())
	time.Sleep(30 * time.Millisecond) // what follows is after the statement, past replyTickSlack
	t0 := time.Now()
	if w.arriving(t0) {
		t.Fatal("first look: arriving before a byte was sent")
	}
	pairSend(t, server, client, 1000)
	if !w.arriving(t0.Add(replyTick)) {
		// The first window ends a margin after the first look.
		t.Fatal("1000 bytes received a tick after the first look: not arriving")
	}
	pairSend(t, server, client, 100<<10)
	if !w.arriving(t0.Add(ClaimReplyMargin)) {
		t.Fatal("101 KB in the first window: taken for a trickle")
	}
	pairSend(t, server, client, 8<<10)
	if !w.arriving(t0.Add(ClaimReplyMargin + replyTick)) {
		t.Fatal("8 KB received a tick into the second window: not arriving")
	}
	pairSend(t, server, client, 1000) // moving at the window's end, but too little in it
	if w.arriving(t0.Add(2 * ClaimReplyMargin)) {
		t.Fatalf("9 KB in the second window (less than %d bytes): not taken for a trickle",
			replyMinBytes)
	}
	if w.counted || w.began {
		// fire reads began.
		t.Fatalf("after a trickle: counted %v, began %v; want neither", w.counted, w.began)
	}
	pairUnread(t, server, client, 1000)
	if w.arriving(t0.Add(2*ClaimReplyMargin + replyTick)) {
		t.Fatal("a reply given up for a trickle is arriving again once bytes wait unread")
	}
	if w.began {
		t.Fatal("a reply given up for a trickle began again")
	}
}

// Data that came in just before the statement was sent (the end of the reply before it, on a
// connection reused at once) is not its reply: the kernel's time of the last data is in clock
// ticks (4 ms here at HZ=250), so a look without replyTickSlack sees it after the statement's
// start about every other time. Twenty tries, none may be seen arriving.
func TestReplyWatchIgnoresDataJustBeforeTheStatement(t *testing.T) {
	t.Parallel()
	client, server := watchPair(t, "tcp")
	for i := 0; i < 20; i++ {
		pairSend(t, server, client, 100)
		w := newReplyWatch(client, time.Now())
		time.Sleep(20 * time.Millisecond)
		if w.arriving(time.Now()) {
			t.Fatalf("try %d: data received just before the statement was sent seen as its reply", i)
		}
	}
}

// Over a Unix socket, which counts nothing, a single byte waiting unread is a reply arriving.
func TestReplyWatchOneUnreadByte(t *testing.T) {
	t.Parallel()
	client, server := watchPair(t, "unix")
	w := newReplyWatch(client, time.Now())
	if w.arriving(time.Now()) {
		t.Fatal("arriving before a byte was sent")
	}
	pairUnread(t, server, client, 1)
	if !w.arriving(time.Now()) || !w.began {
		t.Fatal("one unread byte not seen arriving")
	}
}

// Past its bound, a reply that has begun is waited for while no gap between its bytes is
// longer than ClaimReplyMargin: a pause of about a second (the server busy, the link's
// buffers) neither ends the bound nor makes live (which the lease unit's outer bound asks) say no;
// stop then tells that the bound was kept going.
func TestReplyBoundWaitsThroughAPause(t *testing.T) {
	t.Parallel()
	client, server := watchPair(t, "tcp")
	read := pairDrain(client)
	ctx, b := newReplyBound(context.Background(), client, 200*time.Millisecond)
	t.Cleanup(func() { b.stop() })
	start := time.Now()
	time.Sleep(50 * time.Millisecond)
	if _, err := server.Write(make([]byte, 100<<10)); err != nil {
		t.Fatal(err)
	}
	// The pause: nothing is sent until a second after the start (the bound ended at 200 ms
	// and has looked a few times since).
	time.Sleep(time.Until(start.Add(time.Second)))
	if err := context.Cause(ctx); err != nil {
		t.Fatalf("a reply that began and paused for under a second given up %s after the start: %v",
			time.Since(start), err)
	}
	if !b.live() {
		t.Fatal("a reply that began and paused for under a second: the bound says it ended")
	}
	if _, err := server.Write(make([]byte, 100<<10)); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for read.Load() < 200<<10 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	if err := context.Cause(ctx); err != nil {
		t.Fatalf("a reply that came whole given up: %v", err)
	}
	if !b.stop() {
		t.Fatal("stop: a bound kept going past its end by an arriving reply says it was not")
	}
	if err := context.Cause(ctx); errors.Is(err, errNoReply) {
		t.Fatalf("stopped bound's cause: %v", err)
	}
}

// A reply that came and stopped is given up ClaimReplyMargin after its last byte, not after
// the bound first saw it: here its bytes came at 100 ms and the bound ended at 2.5 s, so it is
// given up at about 5.1 s (the next tick), not at 7.5 s.
func TestReplyBoundCountsTheGapFromTheLastByte(t *testing.T) {
	t.Parallel()
	client, server := watchPair(t, "tcp")
	pairDrain(client)
	ctx, b := newReplyBound(context.Background(), client, 2500*time.Millisecond)
	t.Cleanup(func() { b.stop() })
	start := time.Now()
	time.Sleep(100 * time.Millisecond)
	if _, err := server.Write(make([]byte, 1000)); err != nil {
		t.Fatal(err)
	}
	select {
	case <-ctx.Done():
	case <-time.After(20 * time.Second):
		t.Fatal("a reply that stopped was not given up in 20 s")
	}
	took := time.Since(start)
	if !errors.Is(context.Cause(ctx), errNoReply) {
		t.Fatalf("ended with %v, want no reply", context.Cause(ctx))
	}
	if b.live() {
		t.Fatal("a bound that gave its reply up is still live: a lease unit's bound would wait on it")
	}
	if took < ClaimReplyMargin || took > ClaimReplyMargin+1500*time.Millisecond {
		t.Fatalf("a reply whose last byte came at 100 ms given up after %s, want about %s", took,
			ClaimReplyMargin+100*time.Millisecond)
	}
}

// A bound that was stopped (its statement over; the connection goes back to the pool, and its
// next statement's reply comes) says it is not live, and that it was not kept going.
func TestReplyBoundStoppedIsNotLive(t *testing.T) {
	t.Parallel()
	client, server := watchPair(t, "tcp")
	ctx, b := newReplyBound(context.Background(), client, time.Hour)
	t.Cleanup(func() { b.stop() })
	time.Sleep(30 * time.Millisecond) // past replyTickSlack: the bytes below are after the start
	if b.stop() {
		t.Fatal("stop: a bound that never passed its end says it was kept going")
	}
	if ctx.Err() == nil {
		t.Fatal("a stopped bound's context is not done")
	}
	pairUnread(t, server, client, 1000)
	if b.live() {
		t.Fatal("a stopped bound is live while the bytes of what follows on its connection come")
	}
}

// A reply that has not begun is given up at the bound over TCP, whose count would have shown a
// reply (no graces); over a Unix socket only after replyGraces more looks replyTick/5 apart
// (D213: four, 50 ms apart), since the reader may just have emptied the buffer.
func TestReplyBoundGraces(t *testing.T) {
	t.Parallel()
	for _, network := range []string{"tcp", "unix"} {
		t.Run(network, func(t *testing.T) {
			t.Parallel()
			client, _ := watchPair(t, network)
			const d = 20 * time.Millisecond
			start := time.Now()
			ctx, b := newReplyBound(context.Background(), client, d)
			t.Cleanup(func() { b.stop() })
			select {
			case <-ctx.Done():
			case <-time.After(10 * time.Second):
				t.Fatal("a black hole not given up in 10 s")
			}
			took := time.Since(start)
			if !errors.Is(context.Cause(ctx), errNoReply) {
				t.Fatalf("ended with %v, want no reply", context.Cause(ctx))
			}
			b.mu.Lock()
			graces := b.graces
			b.mu.Unlock()
			want := 0
			if network == "unix" {
				want = replyGraces
			}
			if graces != want {
				t.Fatalf("given up after %d graces (%s), want %d", graces, took, want)
			}
			if network == "unix" {
				// timers never fire early: at least d and four graces of 50 ms; with a grace
				// of a whole tick it would be over a second
				if minimum := d + replyGraces*replyTick/5; took < minimum || took > d+900*time.Millisecond {
					t.Fatalf("given up after %s, want about %s", took, minimum)
				}
			}
		})
	}
}

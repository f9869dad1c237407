package dbidem

import (
	"context"
	"testing"
	"time"
)

// TestGateLineMemory (D260): what the Gate keeps of a key between two flights. A flight that
// leaves the key answered while a request waited for it is remembered, and the next flight,
// whoever starts it, starts knowing (flight.after); a flight nobody waited for is not
// remembered; a memory is taken by the flight that reads it, which passes it on when it
// leaves the key answered, and one nobody read is swept (as flights leave) once it is older
// than lineMemory.
func TestGateLineMemory(t *testing.T) {
	ctx := context.Background()
	g := NewGate(GateOptions{})
	recent := func() int {
		g.mu.Lock()
		defer g.mu.Unlock()
		return len(g.recent)
	}
	enter := func(key string) *pass {
		t.Helper()
		p, err := g.enter(ctx, nil, "alice", key, time.Second, 0)
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	// Nobody waited: nothing is remembered.
	enter("alone").leave(true, true, Replay, false)
	if n := recent(); n != 0 {
		t.Fatalf("a flight nobody waited for left %d memories", n)
	}
	if p := enter("alone"); p.f.after {
		t.Error("a flight after one nobody waited for starts knowing the answer")
	} else {
		p.leave(true, true, Replay, false)
	}
	// A request waits and goes (its context ends); the flight leaves answered; a newcomer
	// starts the next flight knowing.
	line := func(key string, outcome Outcome, committed bool) {
		t.Helper()
		first := enter(key)
		wctx, cancel := context.WithCancel(ctx)
		gone := make(chan error, 1)
		go func() { _, err := g.enter(wctx, nil, "alice", key, time.Minute, 0); gone <- err }()
		for g.Waiting() != 1 {
			time.Sleep(time.Millisecond)
		}
		cancel()
		if err := <-gone; err == nil {
			t.Fatal("the waiter got a pass")
		}
		first.leave(true, committed, outcome, false)
	}
	line("line", Mismatch, true)
	if n := recent(); n != 1 {
		t.Fatalf("a line's answered flight left %d memories, want 1", n)
	}
	next := enter("line")
	if !next.f.after {
		t.Error("the flight after a line that left the key answered starts knowing nothing")
	}
	if n := recent(); n != 0 {
		t.Errorf("the memory was not taken by the next flight: %d left", n)
	}
	// That flight, a newcomer's nobody waited behind, passes the note on: the next newcomer,
	// in the same gap of the line, starts knowing too.
	next.leave(true, true, Replay, false)
	if n := recent(); n != 1 {
		t.Errorf("a flight that started knowing left %d memories, want 1", n)
	}
	if p := enter("line"); !p.f.after {
		t.Error("the second newcomer after a line that left the key answered starts knowing nothing")
	} else {
		p.leave(true, true, Replay, false)
	}
	if p := enter("line"); !p.f.after {
		t.Error("the third newcomer after a line that left the key answered starts knowing nothing")
	} else {
		p.leave(false, false, Replay, false) // a panic: answered nothing, passes nothing on
	}
	if p := enter("line"); p.f.after {
		t.Error("a flight after one that answered nothing starts knowing")
	} else {
		p.leave(true, true, Replay, false)
	}
	// A line whose flight answered nothing (a fresh claim rolled back) is not remembered.
	line("unanswered", Claimed, false)
	if n := recent(); n != 0 {
		t.Errorf("an unanswered line left %d memories", n)
	}
	if p := enter("unanswered"); p.f.after {
		t.Error("the flight after a line that answered nothing starts knowing the answer")
	} else {
		p.leave(true, true, Replay, false)
	}
	// A memory nobody reads is swept once it is older than lineMemory.
	line("forgotten", Replay, true)
	time.Sleep(lineMemory + 50*time.Millisecond)
	enter("other").leave(true, true, Replay, false)
	if n := recent(); n != 0 {
		t.Errorf("%d memories older than lineMemory were kept", n)
	}
	if p := enter("forgotten"); p.f.after {
		t.Error("a flight long after its key's line starts knowing the answer")
	}
}

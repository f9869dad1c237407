package idemhttp_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	idemhttp "github.com/pgidem/pgidem/internal/http"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// replayBlocker holds the first "idem.claim" span that ends with outcome replay once armed:
// the span ends inside the claim's unit of work, so the request stays one of the Gate's
// requests of its key (an "open" key's runner, D211) until released.
type replayBlocker struct {
	armed   atomic.Bool
	held    chan struct{}
	release chan struct{}
}

func (b *replayBlocker) OnStart(context.Context, sdktrace.ReadWriteSpan) {}
func (b *replayBlocker) Shutdown(context.Context) error                  { return nil }
func (b *replayBlocker) ForceFlush(context.Context) error                { return nil }
func (b *replayBlocker) OnEnd(s sdktrace.ReadOnlySpan) {
	if s.Name() != "idem.claim" {
		return
	}
	for _, a := range s.Attributes() {
		if string(a.Key) == "idem.outcome" && a.Value.AsString() == "replay" && b.armed.CompareAndSwap(true, false) {
			close(b.held)
			<-b.release
		}
	}
}

// TestFreshClaimInOpenKeyDuplicatesWaitInGo (D211): docs/http.md "Retry storms":
// "a request whose (principal, key) another request of the same process is working on waits in
// Go until that one is done"; the table: "repeat while the first still runs | waits for the
// first's answer, without a connection, up to Options.DuplicateWait". D211: "One that does not
// find the answer (the key expired or was released meanwhile) closes the key again: one flight
// at a time, as before."
//
// A key is answered (F), a duplicate that waited for it replays side by side (W, held in its
// claim's unit by a span processor), the key goes away meanwhile (its TTL ran out and the
// cleaner deleted it), and N1 of this process claims it afresh and runs the handler. Five more
// duplicates of N1 then come to the same process: they wait in Go for N1 and replay its
// answer. In D211's first build the key stayed open while N1 worked, so they claimed at once:
// one waited on N1's row lock in the database (a wait slot, a connection) and the others got
// 409 request_in_progress at once (no slot), though N1 answered well within DuplicateWait.
func TestFreshClaimInOpenKeyDuplicatesWaitInGo(t *testing.T) {
	w := newWaitEnv(t)
	const body = `{"amount":1}`
	blocker := &replayBlocker{held: make(chan struct{}), release: make(chan struct{})}
	t.Cleanup(func() {
		select {
		case <-blocker.release:
		default:
			close(blocker.release)
		}
	})
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(blocker))
	mb, b := w.server(t, 8, func(o *idemhttp.Options) {
		o.MaxWaitingClaims = 1
		o.DuplicateWait = 5 * time.Second
		o.TracerProvider = tp
	})
	ctx := context.Background()
	fDone := make(chan stormReply, 1)
	go func() { fDone <- stormSend(t, ctx, b, "/tx", "open-key", body, "X-Hold", "f") }()
	<-w.started
	wDone := make(chan stormReply, 1)
	go func() { wDone <- stormSend(t, ctx, b, "/tx", "open-key", body) }()
	waitUntilTrue(t, "W waits in Go", 10*time.Second, func() bool { return mb.GateStats().Waiting == 1 })
	blocker.armed.Store(true)
	w.releaseNamed("f")
	if r := <-fDone; r.status != 201 {
		t.Fatalf("F: %d %s", r.status, r.body)
	}
	select {
	case <-blocker.held:
	case <-time.After(10 * time.Second):
		t.Fatal("W never replayed")
	}
	// The key goes away (its TTL ran out, the cleaner deleted it) while W's replay runs.
	dctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	if _, err := w.pool.Exec(dctx, `DELETE FROM idem.idempotency_keys WHERE key = 'open-key'`); err != nil {
		t.Fatal(err)
	}
	cancel()
	n1Done := make(chan stormReply, 1)
	go func() { n1Done <- stormSend(t, ctx, b, "/tx", "open-key", body, "X-Hold", "n1") }()
	select {
	case <-w.started:
	case <-time.After(10 * time.Second):
		t.Fatal("N1 never ran")
	}
	close(blocker.release)
	if r := <-wDone; r.status != 201 {
		t.Fatalf("W: %d %s", r.status, r.body)
	}
	// N1 (this process) works on the key. Its duplicates come.
	const n = 5
	replies := make(chan stormReply, n)
	sent := time.Now()
	for range n {
		go func() { replies <- stormSend(t, ctx, b, "/tx", "open-key", body) }()
	}
	var early []stormReply
	deadline := time.After(700 * time.Millisecond)
collect:
	for len(early) < n {
		select {
		case r := <-replies:
			early = append(early, r)
		case <-deadline:
			break collect
		}
	}
	stats := mb.GateStats()
	w.releaseNamed("n1")
	n1 := <-n1Done
	got := early
	for len(got) < n {
		got = append(got, <-replies)
	}
	t.Logf("N1: %d %s; duplicates: %v; gate while N1 worked: %+v", n1.status, n1.body, stormCodes(t, got), stats)
	if len(early) > 0 {
		for _, r := range early {
			t.Errorf("a duplicate of N1 (this process, working on the key) was answered %d %s after %s (Retry-After %q); "+
				"want a wait in Go for N1's answer (DuplicateWait 5 s)", r.status, r.body, r.at.Sub(sent).Round(time.Millisecond),
				r.header.Get("Retry-After"))
		}
	}
	if stats.LockWaits != 0 || stats.Waiting != int64(n-len(early)) {
		t.Errorf("while N1 worked: %d of its duplicates waited on its row lock in the database, %d in Go; want 0 and %d",
			stats.LockWaits, stats.Waiting, n-len(early))
	}
	if c := pgtest.Count(t, w.pool, `SELECT count(*) FROM effects`); c != 2 {
		t.Errorf("%d effects, want 2 (F's and N1's)", c)
	}
}

package idemhttp_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	idemhttp "github.com/pgidem/pgidem/internal/http"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestGateAbortedHandlerIsNoAnswer: a handler that panics with http.ErrAbortHandler (the
// middleware passes only that panic on; net/http aborts the response) rolls its work back: the
// key has no answer. docs/http.md, top table: a "repeat while the first still runs | waits for
// the first's answer, without a connection, up to Options.DuplicateWait"; "Retry storms": "a
// request whose (principal, key) another request of the same process is working on waits in Go
// until that one is done". After the abort, one duplicate claims the key afresh and runs the
// handler; the other duplicates of this process wait in Go for it and replay its answer. A build
// of D211 read the abort as an answer and let them claim side by side (a wait slot on the key's
// row, and the ones without a slot 409 at once).
func TestGateAbortedHandlerIsNoAnswer(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 12)
	pgtest.Exec(t, pool, `CREATE TABLE effects (id serial PRIMARY KEY, amount int)`)
	var runs atomic.Int32
	fInside, fRelease := make(chan struct{}), make(chan struct{})
	nextInside, nextRelease := make(chan struct{}), make(chan struct{})
	var relOnce sync.Once
	releaseAll := func() {
		relOnce.Do(func() {
			close(nextRelease)
			select {
			case <-fRelease:
			default:
				close(fRelease)
			}
		})
	}
	t.Cleanup(releaseAll)
	handler := http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		n := runs.Add(1)
		_, _ = io.ReadAll(r.Body)
		id := 0
		if err := idemhttp.Tx(r.Context()).QueryRow(r.Context(), `INSERT INTO effects (amount) VALUES (1) RETURNING id`).Scan(&id); err != nil {
			http.Error(rw, err.Error(), 500)
			return
		}
		switch n {
		case 1:
			close(fInside)
			<-fRelease
			panic(http.ErrAbortHandler)
		case 2:
			close(nextInside)
			<-nextRelease
		}
		rw.Header().Set("Content-Type", "application/json")
		rw.WriteHeader(201)
		fmt.Fprintf(rw, `{"id":%d,"run":%d}`, id, n)
	})
	m, err := idemhttp.New(idemhttp.Options{
		DB: pool,
		Principal: func(r *http.Request) (string, bool) {
			return "alice", true
		},
		Logger:           slog.New(slog.NewTextHandler(io.Discard, nil)),
		LockTimeout:      2 * time.Second,
		DuplicateWait:    5 * time.Second,
		MaxWaitingClaims: 1,
	})
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("POST /tx", m.Route(idemhttp.Route{Required: true})(handler))
	srv := httptest.NewServer(mux)
	t.Cleanup(func() { releaseAll(); srv.Close() })
	ctx := context.Background()
	send := func() stormReply {
		return stormSend(t, ctx, srv, "/tx", "aborts", `{"amount":1}`)
	}

	fDone := make(chan stormReply, 1)
	go func() { fDone <- send() }()
	<-fInside
	const dups = 4
	replies := make(chan stormReply, dups)
	for range dups {
		go func() { replies <- send() }()
	}
	waitUntilTrue(t, "the duplicates wait in Go", 10*time.Second, func() bool { return m.GateStats().Waiting == dups })
	sent := time.Now()
	close(fRelease)
	<-fDone // aborted
	select {
	case <-nextInside:
	case <-time.After(10 * time.Second):
		t.Fatal("no duplicate ran the handler after the abort")
	}
	var early []stormReply
	deadline := time.After(700 * time.Millisecond)
collect:
	for len(early) < dups {
		select {
		case r := <-replies:
			early = append(early, r)
		case <-deadline:
			break collect
		}
	}
	stats := m.GateStats()
	releaseAll()
	got := early
	for len(got) < dups {
		got = append(got, <-replies)
	}
	for _, r := range early {
		t.Errorf("while the duplicate that took the key after the abort worked, another was answered %d %s after %s "+
			"(Retry-After %q); want a wait in Go for its answer (DuplicateWait 5 s)", r.status, r.body,
			r.at.Sub(sent).Round(time.Millisecond), r.header.Get("Retry-After"))
	}
	if stats.LockWaits != 0 || stats.Waiting != int64(dups-1-len(early)) {
		t.Errorf("while the next holder worked: LockWaits %d, Waiting %d; want 0 on the key's row, %d in Go",
			stats.LockWaits, stats.Waiting, dups-1-len(early))
	}
	ok := 0
	var codes []int
	for _, r := range got {
		codes = append(codes, r.status)
		if r.status == 201 {
			ok++
		}
	}
	if ok != dups {
		t.Errorf("%d of %d duplicates got the answer 201: statuses %v", ok, dups, codes)
	}
	if c := pgtest.Count(t, pool, `SELECT count(*) FROM effects`); c != 1 {
		t.Errorf("%d effects, want 1", c)
	}
}

package idemhttp_test

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgidem/pgidem/internal/canon"
	"github.com/pgidem/pgidem/internal/dbidem"
	idemhttp "github.com/pgidem/pgidem/internal/http"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestGateRerunAfter40001IsNot409: docs/http.md's table: "deadlock, serialization failure or
// lock timeout (55P03) in the handler's statements ... | the unit of work runs again (3 times at
// most)". A request whose claim waited on another process's uncommitted claim (with the
// process's one wait slot) takes the key when that process rolls back; its handler hits 40001.
// Meanwhile another key's duplicate took the one slot. The rerun finds the key free and runs
// (201). In a build of D211 it was refused for want of a slot (taken again by a rerun): 409
// request_in_progress, at once, for a key nobody held, and the handler never ran again.
func TestGateRerunAfter40001IsNot409(t *testing.T) {
	t.Parallel()
	pool, url := pgtest.NewPool(t, 10)
	ctx := context.Background()

	var runs atomic.Int32
	in, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	t.Cleanup(func() { once.Do(func() { close(release) }) })
	handler := http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		_, _ = io.ReadAll(r.Body)
		tx := idemhttp.Tx(r.Context())
		if r.Header.Get("X-Fail") != "" && runs.Add(1) == 1 {
			close(in)
			<-release
			if _, err := tx.Exec(r.Context(), `DO $$BEGIN RAISE EXCEPTION 'serialization' USING ERRCODE = '40001'; END$$`); err != nil {
				http.Error(rw, err.Error(), 500)
				return
			}
		}
		rw.Header().Set("Content-Type", "application/json")
		rw.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(rw, `{"ok":true}`)
	})
	m, err := idemhttp.New(idemhttp.Options{
		DB: pool,
		Principal: func(r *http.Request) (string, bool) {
			p := r.Header.Get("X-Principal")
			return p, p != ""
		},
		Logger:           slog.New(slog.NewTextHandler(io.Discard, nil)),
		LockTimeout:      5 * time.Second,
		DuplicateWait:    10 * time.Second,
		MaxWaitingClaims: 1,
	})
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("POST /tx", m.Route(idemhttp.Route{Required: true})(handler))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)

	// "Another process" holds h1 and h2, uncommitted.
	hold := func(key string) func() {
		tx, err := pgtest.Connect(t, url).Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		fp := canon.Compute("POST", "/other", []byte(`{}`))
		if d, err := dbidem.Begin(ctx, tx, dbidem.Claim{Principal: "alice", Key: key, Action: "POST /other",
			Fingerprint: fp.Sum, Fields: fp.Fields}); err != nil || d.Outcome != dbidem.Claimed {
			t.Fatalf("the other process's claim of %s: %+v %v", key, d, err)
		}
		return func() { _ = tx.Rollback(ctx) }
	}
	free1 := hold("h1")
	defer free1()

	send := func(key string, headers ...string) chan stormReply {
		ch := make(chan stormReply, 1)
		go func() {
			ch <- stormSend(t, ctx, srv, "/tx", key, `{"amount":1}`, headers...)
		}()
		return ch
	}
	r1 := send("h1", "X-Fail", "1")
	waitUntilTrue(t, "R1 waits on h1's row with the slot", 10*time.Second, func() bool { return m.GateStats().LockWaits == 1 })
	free1() // the other process gives h1 up: R1 claims it and its handler runs
	select {
	case <-in:
	case <-time.After(10 * time.Second):
		t.Fatal("R1's handler never ran")
	}
	waitUntilTrue(t, "R1's slot freed once claimed", 10*time.Second, func() bool { return m.GateStats().LockWaits == 0 })

	free2 := hold("h2")
	defer free2()
	r2 := send("h2")
	waitUntilTrue(t, "R2 waits on h2's row with the slot", 10*time.Second, func() bool { return m.GateStats().LockWaits == 1 })

	once.Do(func() { close(release) }) // R1's handler hits 40001: the unit runs again
	var got stormReply
	select {
	case got = <-r1:
	case <-time.After(15 * time.Second):
		t.Fatal("R1 never answered")
	}
	free2()
	<-r2
	rows := pgtest.Count(t, pool, `SELECT count(*) FROM idem.idempotency_keys WHERE key = 'h1'`)
	t.Logf("R1: %d %s %q (Retry-After %q); handler runs with X-Fail: %d; h1 rows after: %d; gate %+v",
		got.status, got.header.Get("Content-Type"), got.body, got.header.Get("Retry-After"), runs.Load(), rows, m.GateStats())
	if got.status != http.StatusCreated {
		t.Errorf("R1, whose handler hit a serialization failure on a key nobody else held: %d %s; "+
			"want the unit of work run again and 201 (docs/http.md: \"the unit of work runs again (3 times at most)\")", got.status, got.body)
	}
}

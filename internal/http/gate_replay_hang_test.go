package idemhttp_test

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	idemhttp "github.com/pgidem/pgidem/internal/http"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestReplayCommitHangHoldsDuplicates: options.go promises "DuplicateWait bounds how
// long a duplicate of a request that is still running waits for its answer ... before it gets 409
// request_in_progress"; past it only "while the request ahead only reads the answer" (D211,
// D215). A first build of D215 had a flight that decided Replay mark the key answered as it
// decided, before its transaction's COMMIT: a COMMIT that never answers (a black-holed
// connection, which the library does not bound for a transactional claim) held every duplicate
// behind it in Go with no bound; a client with DuplicateWait 1 s still had no answer after 6 s.
func TestReplayCommitHangHoldsDuplicates(t *testing.T) {
	t.Parallel()
	_, url := pgtest.NewPool(t, 2)
	p := pgtest.NewProxy(t, pgtest.TCPAddr(t))
	cfg, err := pgxpool.ParseConfig(pgtest.Via(t, url, p.Addr) + " pool_max_conns=4")
	if err != nil {
		t.Fatal(err)
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	m, err := idemhttp.New(idemhttp.Options{
		DB:            pool,
		Principal:     func(r *http.Request) (string, bool) { return "alice", true },
		Logger:        slog.New(slog.NewTextHandler(io.Discard, nil)),
		LockTimeout:   500 * time.Millisecond,
		DuplicateWait: time.Second,
	})
	if err != nil {
		t.Fatal(err)
	}
	h := m.Route(idemhttp.Route{Required: true})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(201)
		_, _ = w.Write([]byte(`{"ok":true}`))
	}))
	srv := httptest.NewServer(h)
	defer srv.Close()
	defer pool.Close()
	defer p.CloseAll() // unblocks the hung COMMIT first (deferred calls run last-in first-out)
	send := func(timeout time.Duration) (int, error) {
		c := &http.Client{Timeout: timeout}
		req, _ := http.NewRequest("POST", srv.URL+"/x", strings.NewReader(`{"a":1}`))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", "hang")
		resp, err := c.Do(req)
		if err != nil {
			return 0, err
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp.StatusCode, nil
	}
	if st, err := send(5 * time.Second); err != nil || st != 201 {
		t.Fatalf("first: %d %v", st, err)
	}
	if st, err := send(5 * time.Second); err != nil || st != 201 {
		t.Fatalf("warm-up replay: %d %v", st, err)
	}
	p.CommitHole.Store(true)
	go func() { _, _ = send(30 * time.Second) }() // A: replays, then hangs at its COMMIT
	time.Sleep(500 * time.Millisecond)
	start := time.Now()
	st, err := send(6 * time.Second) // B: a duplicate behind A
	took := time.Since(start)
	t.Logf("the duplicate behind: %d %v after %s (Gate waiting %d)", st, err, took.Round(time.Millisecond), m.GateStats().Waiting)
	if err != nil || took > 3*time.Second {
		t.Errorf("a duplicate with DuplicateWait 1 s behind a replay whose COMMIT hangs: %d, %v after %s; "+
			"want 409 request_in_progress at about its DuplicateWait", st, err, took.Round(time.Millisecond))
	}
	p.CommitHole.Store(false)
}

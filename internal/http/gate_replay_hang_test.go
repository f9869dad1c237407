package idemhttp_test

import (
	"bytes"
	"context"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	idemhttp "github.com/pgidem/pgidem/internal/http"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// commitHoleProxy forwards TCP to target; while hole is set, a connection that sends the simple
// query "commit" swallows it and every byte after it (a COMMIT black-holed).
type commitHoleProxy struct {
	addr  string
	hole  atomic.Bool
	mu    sync.Mutex
	conns []net.Conn
}

func newCommitHoleProxy(t *testing.T, target string) *commitHoleProxy {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &commitHoleProxy{addr: ln.Addr().String()}
	t.Cleanup(func() { ln.Close(); p.closeAll() })
	commit := []byte("Q\x00\x00\x00\x0bcommit\x00")
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s, err := net.Dial("tcp", target)
			if err != nil {
				c.Close()
				continue
			}
			p.mu.Lock()
			p.conns = append(p.conns, c, s)
			p.mu.Unlock()
			go func() {
				buf := make([]byte, 32<<10)
				holed := false
				for {
					n, err := c.Read(buf)
					if n > 0 {
						if !holed && p.hole.Load() && bytes.Contains(buf[:n], commit) {
							holed = true
						}
						if !holed {
							if _, werr := s.Write(buf[:n]); werr != nil {
								return
							}
						}
					}
					if err != nil {
						return
					}
				}
			}()
			go func() { _, _ = io.Copy(c, s) }()
		}
	}()
	return p
}

func (p *commitHoleProxy) closeAll() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range p.conns {
		c.Close()
	}
	p.conns = nil
}

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
	p := newCommitHoleProxy(t, pgtest.TCPAddr(t))
	cfg, err := pgxpool.ParseConfig(pgtest.Via(t, url, p.addr) + " pool_max_conns=4")
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
	defer p.closeAll() // unblocks the hung COMMIT first (deferred calls run last-in first-out)
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
	p.hole.Store(true)
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
	p.hole.Store(false)
}

package dbidem_test

import (
	"context"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/internal/dbidem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// stallProxy forwards TCP to the test server until stall is set; from then on it forwards
// nothing in either direction and keeps every connection open: a primary gone without a word,
// or a black-holed network, as the client's kernel sees it (no FIN, no RST).
type stallProxy struct {
	ln    net.Listener
	stall atomic.Bool
	mu    sync.Mutex
	conns []net.Conn
}

func newStallProxy(t *testing.T) *stallProxy {
	t.Helper()
	target := pgtest.TCPAddr(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &stallProxy{ln: ln}
	t.Cleanup(p.closeAll)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s, err := net.Dial("tcp", target)
			if err != nil {
				_ = c.Close()
				continue
			}
			p.mu.Lock()
			p.conns = append(p.conns, c, s)
			p.mu.Unlock()
			go p.pipe(c, s)
			go p.pipe(s, c)
		}
	}()
	return p
}

func (p *stallProxy) pipe(dst, src net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 && !p.stall.Load() {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

func (p *stallProxy) closeAll() {
	_ = p.ln.Close()
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range p.conns {
		_ = c.Close()
	}
}

func (p *stallProxy) addr() string { return p.ln.Addr().String() }

// TestCleanerDefaultsReadIsBounded: with the default options (BatchSize 0, which the
// reference server's CLEANUP_BATCH_SIZE and idem.CleanerOptions{} give) every pass begins with
// a read of idem_defaults(), which had no bound: a network that went silent between two passes
// (a pass runs for milliseconds a minute, so that is where a black hole almost always begins)
// held the pass on that read, with no failed pass and no log, until the kernel gave the
// connection up (about 15 minutes); gocron's singleton mode skipped every pass meanwhile. The
// read is bounded as a batch is now (D177); the bound is 300 ms here (SetBatchBound).
func TestCleanerDefaultsReadIsBounded(t *testing.T) {
	t.Parallel()
	url := pgtest.NewDB(t)
	admin := pgtest.Connect(t, url)
	pgtest.InsertExpired(t, admin, "p", 10)
	proxy := newStallProxy(t)
	cfg, err := pgxpool.ParseConfig(pgtest.Via(t, url, proxy.addr()))
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 2
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	t.Cleanup(proxy.closeAll) // before pool.Close, which would wait on the silent connections
	rec := &passes{}
	c, err := dbidem.NewCleaner(pool, dbidem.CleanerOptions{Observer: rec, SkipVacuum: true})
	if err != nil {
		t.Fatal(err)
	}
	dbidem.SetBatchBound(c, 300*time.Millisecond)
	// A first pass through the healthy network: the pool's connection is open and idle.
	if n, ran, err := c.Pass(context.Background()); err != nil || !ran || n != 10 {
		t.Fatalf("first pass: %d %v %v", n, ran, err)
	}
	// The network goes silent between two passes.
	proxy.stall.Store(true)
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	start := time.Now()
	_, _, err = c.Pass(ctx)
	took := time.Since(start)
	rec.mu.Lock()
	defer rec.mu.Unlock()
	last := rec.results[len(rec.results)-1]
	if took > 5*time.Second || last != dbidem.PassFailed || err == nil {
		t.Fatalf("a pass on a connection that stopped answering: %v after %s, counted %q; want a failed pass within the 0.3 s bound",
			err, took.Round(time.Millisecond), last)
	}
}

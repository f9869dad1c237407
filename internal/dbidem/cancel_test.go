package dbidem_test

import (
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/internal/dbidem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// slowCancelProxy forwards connections to target; a cancel request reaches the server only
// after delay (an overloaded postmaster, a slow network path, a pooler forwarding it).
func slowCancelProxy(t *testing.T, target string, delay time.Duration) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func(c net.Conn) {
				defer c.Close()
				head := make([]byte, 8)
				if _, err := io.ReadFull(c, head); err != nil {
					return
				}
				var rest []byte
				if binary.BigEndian.Uint32(head[4:]) == 80877102 { // CancelRequest
					rest = make([]byte, 8)
					if _, err := io.ReadFull(c, rest); err != nil {
						return
					}
					time.Sleep(delay)
				}
				s, err := net.Dial("tcp", target)
				if err != nil {
					return
				}
				defer s.Close()
				_, _ = s.Write(append(head, rest...))
				go func() { _, _ = io.Copy(s, c) }()
				_, _ = io.Copy(c, s)
			}(c)
		}
	}()
	return l.Addr().String()
}

// TestUnconfirmedCancelClosesTheConnection (review finding): a duplicate waits on a key's row
// lock held by another process; its client leaves (wait ends), so the Gate sends a cancel
// request and waits for it, so that the connection runs nothing more until the server has it.
// It waits at most a second, and went on after that: here the holder rolls back, the claim
// succeeded, the unit committed, the connection went back to the pool, and the cancel, still on
// its way, cancelled the next request's statement on that connection. Now the connection is
// closed, and the claim with it.
func TestUnconfirmedCancelClosesTheConnection(t *testing.T) {
	t.Parallel()
	direct, url := pgtest.NewPool(t, 4)
	ctx := context.Background()
	proxy := slowCancelProxy(t, pgtest.TCPAddr(t), 1500*time.Millisecond)
	cfg, err := pgxpool.ParseConfig(pgtest.Via(t, url, proxy))
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 1
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()

	holder, err := direct.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = holder.Rollback(ctx) }()
	c := claim("late-cancel", `{}`)
	if _, err := dbidem.Begin(ctx, holder, c); err != nil {
		t.Fatal(err)
	}
	c.LockTimeout = 5 * time.Second
	wait, leave := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() {
		done <- dbidem.NewGate(dbidem.GateOptions{}).RunDetached(wait, ctx, pool, dbidem.TxOptions{}, c, 0,
			func(tx *dbidem.Tx, d dbidem.Decision) error {
				tx.CompleteOnCommit(dbidem.Response{Status: 201})
				return errors.New("the work ran for a client that had left")
			})
	}()
	pgtest.WaitFor(t, direct, pgtest.KeyWaiters) // past the probe: the wait that a cancel request ends
	leave()                                      // the client goes away
	time.Sleep(200 * time.Millisecond)
	_ = holder.Rollback(ctx) // the first request fails: the waiting claim gets the key
	if err := <-done; !errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("RunDetached after its client left and its cancel request went unconfirmed: %v, want context.Canceled (the client left), not DeadlineExceeded", err)
	}
	if n := pgtest.Count(t, direct, `SELECT count(*) FROM idem.idempotency_keys WHERE key = 'late-cancel'`); n != 0 {
		t.Errorf("the claim of a request whose client left was kept (%d rows)", n)
	}
	// Another request's statement on the pool's one connection.
	start := time.Now()
	_, err = pool.Exec(ctx, `SELECT pg_sleep(1)`)
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "57014" {
		t.Fatalf("another request's statement on the pooled connection was cancelled after %s: %v",
			time.Since(start).Round(time.Millisecond), err)
	}
	if err != nil {
		t.Fatal(err)
	}
}

package dbidem_test

import (
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/internal/dbidem"
	"github.com/pgidem/pgidem/internal/pgbouncer"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// heldCancelProxy forwards connections to target unchanged, except a cancel request's:
// it forwards the request at once, waits for the far end to close the cancel connection (the
// "confirmation" pgconn.CancelRequest waits for), reports that on confirmed, and passes the
// close on to the client only once release is closed. It models a cancel request whose
// round trip is still under way (a network hop between the application and the pooler) when
// the claim statement it is meant for returns.
func heldCancelProxy(t *testing.T, target string, confirmed chan<- struct{}, release <-chan struct{}) string {
	t.Helper()
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
				rest := make([]byte, binary.BigEndian.Uint32(head[:4])-8) // the whole first packet
				if _, err := io.ReadFull(c, rest); err != nil {
					return
				}
				s, err := net.Dial("tcp", target)
				if err != nil {
					return
				}
				defer s.Close()
				if binary.BigEndian.Uint32(head[4:]) == 80877102 { // CancelRequest
					_, _ = s.Write(append(head, rest...))
					_, _ = io.Copy(io.Discard, s) // until the far end closes: its confirmation
					select {
					case confirmed <- struct{}{}:
					default:
					}
					<-release
					return
				}
				_, _ = s.Write(append(head, rest...))
				go func() { _, _ = io.Copy(s, c) }()
				_, _ = io.Copy(c, s)
			}(c)
		}
	}()
	return l.Addr().String()
}

// bouncerTo starts a PgBouncer 1.18 in transaction mode (the docs' settings) in front of
// hostPort, for url's role, and returns it.
func bouncerTo(t *testing.T, url, hostPort string, settings map[string]string) *pgbouncer.Bouncer {
	t.Helper()
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	host, port, err := net.SplitHostPort(hostPort)
	if err != nil {
		t.Fatal(err)
	}
	p, _ := strconv.Atoi(port)
	all := map[string]string{"admin_users": cfg.User}
	for k, v := range settings {
		all[k] = v
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	b, err := pgbouncer.Start(ctx, pgbouncer.Config{Host: host, Port: p,
		Users: map[string]string{cfg.User: cfg.Password}, Settings: all})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.Stop)
	return b
}

// TestFaultsGateCancelThroughPgBouncerStaysOnItsConnection (checked, correct): behind PgBouncer
// 1.18 in transaction mode (docs/operations.md, "Behind PgBouncer"), a duplicate waits on a
// key's row lock held by another process; its client leaves, so the Gate (gate.go,
// RunDetached's AfterFunc) sends a cancel request, and when the claim statement returned
// meanwhile it runs nothing more on the connection until CancelRequest returns, reasoning
// that the confirmation means the server has acted. The question: does PgBouncer confirm
// before PostgreSQL has the request (then the cancel would land later on whatever the shared
// server connection runs, possibly ANOTHER client's statement)? It does not: 1.18 closes the
// client's cancel connection only after the server closed its own (confirmation 400 ms after
// the client left, the time slowCancelProxy holds the forward), and the claim's transaction
// keeps the server connection linked to this client meanwhile. Here the holder rolls back
// 30 ms after the client left, so the claim succeeds before the cancel reaches PostgreSQL; the
// cancel then finds the backend idle in the transaction and is dropped, and another client's
// statement on the pooler's one server connection runs to its end. "direct" is the same
// sequence without PgBouncer (the cancel arrives while the claim still waits and cancels it).
// heldCancelProxy holds the confirmation 100 ms more on the application's side.
func TestFaultsGateCancelThroughPgBouncerStaysOnItsConnection(t *testing.T) {
	t.Parallel()
	for _, via := range []string{"direct", "pgbouncer"} {
		t.Run(via, func(t *testing.T) {
			t.Parallel()
			direct, url := pgtest.NewPool(t, 4)
			ctx := context.Background()
			target := pgtest.TCPAddr(t)
			if via == "pgbouncer" {
				slow := slowCancelProxy(t, pgtest.TCPAddr(t), 400*time.Millisecond)
				b := bouncerTo(t, url, slow, map[string]string{"default_pool_size": "1"})
				target = b.HostPort()
			}
			confirmed := make(chan struct{}, 1)
			release := make(chan struct{})
			front := heldCancelProxy(t, target, confirmed, release)
			cfg, err := pgxpool.ParseConfig(pgtest.Via(t, url, front))
			if err != nil {
				t.Fatal(err)
			}
			cfg.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeExec
			cfg.MaxConns = 1
			pool, err := pgxpool.NewWithConfig(ctx, cfg)
			if err != nil {
				t.Fatal(err)
			}
			defer pool.Close()
			other, err := pgx.ConnectConfig(ctx, cfg.ConnConfig.Copy()) // another client of the pooler
			if err != nil {
				t.Fatal(err)
			}
			defer other.Close(ctx)

			holder, err := direct.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = holder.Rollback(ctx) }()
			c := claim("pooled-cancel", `{}`)
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
						return nil
					})
			}()
			pgtest.WaitFor(t, direct, pgtest.KeyWaiters) // past the probe: the wait with a slot
			leave()                                      // the client goes away: the Gate sends its cancel request
			left := time.Now()
			time.Sleep(30 * time.Millisecond)
			_ = holder.Rollback(ctx) // the first request fails: the waiting claim gets the key
			select {
			case <-confirmed:
				t.Logf("confirmed %s after the client left", time.Since(left))
			case <-time.After(5 * time.Second):
				t.Fatal("the cancel request was never confirmed")
			}
			time.Sleep(100 * time.Millisecond)
			close(release)
			err = <-done
			t.Logf("RunDetached: %v", err)

			// Another client's statement on the pooler's one server connection.
			start := time.Now()
			_, err = other.Exec(ctx, `SELECT pg_sleep(2.5)`)
			var pgErr *pgconn.PgError
			if errors.As(err, &pgErr) && pgErr.Code == "57014" {
				t.Fatalf("via %s: another client's statement was cancelled after %s by the Gate's cancel request: %v",
					via, time.Since(start).Round(time.Millisecond), err)
			}
			if err != nil {
				t.Fatal(err)
			}
		})
	}
}

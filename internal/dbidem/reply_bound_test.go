package dbidem_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/internal/dbidem"
	"github.com/pgidem/pgidem/internal/pgbouncer"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// replyPool is a pool of one connection through addr, opened and warmed before the test turns
// its link bad: the Gate's reads and the statement cache are done.
func replyPool(t *testing.T, url, addr string) *pgxpool.Pool {
	t.Helper()
	pool, err := pgxpool.New(context.Background(), pgtest.Via(t, url, addr)+" pool_max_conns=1")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

func replyDo(ctx context.Context, pool *pgxpool.Pool, job dbidem.Job) (string, bool, error) {
	if job.Lease == 0 {
		return dbidem.Do(ctx, pool, job, dbidem.TxOptions{}, func(context.Context, pgx.Tx) (string, error) { return "fresh", nil })
	}
	return dbidem.DoLease(ctx, pool, job, func(context.Context, dbidem.LeaseClaim) (string, error) { return "fresh", nil })
}

// A black hole is still detected at the plain bound (the probe's lock timeout, 5 ms, and
// ClaimReplyMargin): a query swallowed after the kernel acked it, and a reply that the
// server sent and the path held. Over TCP, for a transactional and a lease claim's replay.
func TestReplyBlackHolesAtThePlainBound(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	direct, url := pgtest.NewPool(t, 2)
	for _, mode := range []pgtest.Fault{pgtest.Swallow, pgtest.Hold} {
		for _, lease := range []time.Duration{0, 30 * time.Second} {
			name := map[pgtest.Fault]string{pgtest.Swallow: "swallowed-query", pgtest.Hold: "held-reply"}[mode] + "/lease=" + lease.String()
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				job := dbidem.Job{Principal: "alice", Key: "bh-" + name, Action: "a", Lease: lease, LockTimeout: 2 * time.Second}
				if _, _, err := replyDo(ctx, direct, job); err != nil {
					t.Fatal(err)
				}
				p := pgtest.NewProxy(t, pgtest.TCPAddr(t))
				pool := replyPool(t, url, p.Addr)
				if _, replayed, err := replyDo(ctx, pool, job); err != nil || !replayed {
					t.Fatalf("warm-up replay: %v %v", replayed, err)
				}
				p.SetFault(mode)
				start := time.Now()
				_, _, err := replyDo(ctx, pool, job)
				took := time.Since(start)
				if !dbidem.IsNoReply(err) {
					t.Fatalf("black hole (%s) ended after %s with %v, want no reply", name, took, err)
				}
				if took < dbidem.ClaimReplyMargin || took > dbidem.ClaimReplyMargin+1500*time.Millisecond {
					t.Fatalf("black hole (%s) given up after %s; the bound is 5 ms + %s", name, took, dbidem.ClaimReplyMargin)
				}
			})
		}
	}
}

// A lease claim's COMMIT black-holed: ErrCommitUnknown ClaimReplyMargin after the claim's
// answer, the claim given up (on the pool's one connection, opened once the black-holed one
// is closed: up to another margin on a loaded machine).
func TestReplyLeaseCommitBlackHole(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, url := pgtest.NewPool(t, 2)
	p := pgtest.NewProxy(t, pgtest.TCPAddr(t))
	pool := replyPool(t, url, p.Addr)
	warm := dbidem.Job{Principal: "alice", Key: "warm", Action: "a", Lease: 30 * time.Second, LockTimeout: 2 * time.Second}
	if _, _, err := replyDo(ctx, pool, warm); err != nil {
		t.Fatal(err)
	}
	p.CommitHole.Store(true)
	job := dbidem.Job{Principal: "alice", Key: "commit-hole", Action: "a", Lease: 30 * time.Second, LockTimeout: 2 * time.Second}
	start := time.Now()
	_, _, err := replyDo(ctx, pool, job)
	took := time.Since(start)
	if !errors.Is(err, dbidem.ErrCommitUnknown) {
		t.Fatalf("a black-holed lease COMMIT ended after %s with %v, want ErrCommitUnknown", took, err)
	}
	if took < dbidem.ClaimReplyMargin || took > 2*dbidem.ClaimReplyMargin+3*time.Second {
		t.Fatalf("a black-holed lease COMMIT given up after %s, want about %s", took, dbidem.ClaimReplyMargin)
	}
}

// A reply that trickles (one byte every 4 s, under ClaimReplyMargin): every look of the bound
// saw bytes arriving, so it never ended while the trickle went on, and a path that had stopped
// answering in all but name held the request, its connection and its key's place in this
// process. A reply past its bound must bring 64 KiB in each margin (D213): given up within
// two margins.
func TestReplyTrickleIsBounded(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	direct, url := pgtest.NewPool(t, 2)
	for _, lease := range []time.Duration{0, 30 * time.Second} {
		t.Run("lease="+lease.String(), func(t *testing.T) {
			t.Parallel()
			job := dbidem.Job{Principal: "alice", Key: "trickle-" + lease.String(), Action: "a", Lease: lease, LockTimeout: 2 * time.Second}
			if _, _, err := replyDo(ctx, direct, job); err != nil {
				t.Fatal(err)
			}
			p := pgtest.NewProxy(t, pgtest.TCPAddr(t))
			pool := replyPool(t, url, p.Addr)
			if _, _, err := replyDo(ctx, pool, job); err != nil {
				t.Fatal(err)
			}
			p.SetFault(pgtest.Trickle)
			start := time.Now()
			done := make(chan error, 1)
			go func() {
				_, _, err := replyDo(ctx, pool, job)
				done <- err
			}()
			select {
			case err := <-done:
				took := time.Since(start)
				t.Logf("a trickling reply ended after %s: %v", took, err)
				if took > 3*dbidem.ClaimReplyMargin || !dbidem.IsNoReply(err) {
					t.Fatalf("a trickling reply ended after %s with %v, want no reply within about two margins", took, err)
				}
			case <-time.After(30 * time.Second):
				p.CloseAll()
				err := <-done
				t.Fatalf("a reply trickling one byte every 4 s still held the claim after %s (ended only when the test closed the link: %v)",
					time.Since(start), err)
			}
		})
	}
}

// A lease claim's replay of a large answer whose link dies midway is given up within twice
// the margin (D213, as TestReplyThatStopsMidwayIsGivenUp for a transactional claim): the unit
// bound waits for the claim only while its bytes come.
func TestReplyLeaseStopsMidwayIsGivenUp(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	direct, url := pgtest.NewPool(t, 2)
	big := strings.Repeat("x", 12<<20)
	job := dbidem.Job{Principal: "alice", Key: "lease-cut", Action: "a", Lease: 30 * time.Second, LockTimeout: 2 * time.Second}
	if _, _, err := dbidem.DoLease(ctx, direct, job, func(context.Context, dbidem.LeaseClaim) (string, error) { return big, nil }); err != nil {
		t.Fatal(err)
	}
	p := pgtest.NewProxy(t, pgtest.TCPAddr(t))
	p.Rate.Store(3 << 19)
	pool := replyPool(t, url, p.Addr)
	warm := dbidem.Job{Principal: "alice", Key: "warm", Action: "a", Lease: 30 * time.Second, LockTimeout: 2 * time.Second}
	if _, _, err := replyDo(ctx, pool, warm); err != nil {
		t.Fatal(err)
	}
	p.ResetSent()
	p.HoldAfter.Store(3 << 20)
	start := time.Now()
	_, _, err := dbidem.DoLease(ctx, pool, job, func(context.Context, dbidem.LeaseClaim) (string, error) { return "", errors.New("ran again") })
	took := time.Since(start)
	if !dbidem.IsNoReply(err) {
		t.Fatalf("a lease replay cut midway ended after %s with %v, want no reply", took, err)
	}
	if took > 2*dbidem.ClaimReplyMargin+2*time.Second {
		t.Fatalf("a lease replay cut midway was given up after %s", took)
	}
}

// Replays whose transfer ends about when the plain bound (5 ms + ClaimReplyMargin) passes, on
// connections that three callers share (each connection back in the pool as soon as one
// replay is done, and taken by the next), transactional and lease claims mixed, under the race
// detector: the bound's timer fires as statements end and looks at sockets that go back to the
// pool. Every replay arrives whole. (As many connections as callers: with two, a caller waited
// for a transfer of up to 5.5 s for a connection, and on the loaded CI machine a lease claim
// passed its bound on the pool's wait, 8 s; that wait is not what this test is about.)
func TestReplyBoundEndsAsStatementsEndOnReusedConnections(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	direct, url := pgtest.NewPool(t, 2)
	const rate = 3 << 19 // 1.5 MB/s: 7.5 MB take 5 s
	sizes := []int{rate * 45 / 10, rate * 49 / 10, rate * 5, rate * 51 / 10, rate * 55 / 10}
	var jobs []dbidem.Job
	for i, n := range sizes {
		for _, lease := range []time.Duration{0, 30 * time.Second} {
			job := dbidem.Job{Principal: "alice", Key: fmt.Sprintf("edge-%d-%s", i, lease), Action: "a", Lease: lease, LockTimeout: 2 * time.Second}
			v := strings.Repeat("z", n)
			var err error
			if lease == 0 {
				_, _, err = dbidem.Do(ctx, direct, job, dbidem.TxOptions{}, func(context.Context, pgx.Tx) (string, error) { return v, nil })
			} else {
				_, _, err = dbidem.DoLease(ctx, direct, job, func(context.Context, dbidem.LeaseClaim) (string, error) { return v, nil })
			}
			if err != nil {
				t.Fatal(err)
			}
			jobs = append(jobs, job)
		}
	}
	p := pgtest.NewProxy(t, pgtest.TCPAddr(t))
	p.Rate.Store(rate)
	pool, err := pgxpool.New(ctx, pgtest.Via(t, url, p.Addr)+" pool_max_conns=3")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	var wg sync.WaitGroup
	errs := make(chan error, 100)
	const callers = 3
	for g := 0; g < callers; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// each caller its own keys: a replay of the same key by another caller waits in Go
			// behind the first, up to the lock timeout (ErrInProgress), which is the Gate's
			// design, not the bound's
			var mine []int
			for k := g; k < len(jobs); k += callers {
				mine = append(mine, k)
			}
			for i := 0; i < 3; i++ {
				k := mine[rand.IntN(len(mine))]
				job := jobs[k]
				want := sizes[k/2]
				start := time.Now()
				var v string
				var replayed bool
				var err error
				if job.Lease == 0 {
					v, replayed, err = dbidem.Do(ctx, pool, job, dbidem.TxOptions{}, func(context.Context, pgx.Tx) (string, error) { return "", errors.New("ran again") })
				} else {
					v, replayed, err = dbidem.DoLease(ctx, pool, job, func(context.Context, dbidem.LeaseClaim) (string, error) { return "", errors.New("ran again") })
				}
				if err != nil || !replayed || len(v) != want {
					errs <- fmt.Errorf("%s after %s: %d bytes of %d, replayed %v, %v", job.Key, time.Since(start), len(v), want, replayed, err)
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

// Behind PgBouncer (transaction mode; the client reaches it over TCP), a black hole between
// PgBouncer and PostgreSQL is given up at the plain bound; a large answer on a slow link
// between them arrives (its bytes reach the client's socket as PgBouncer forwards them).
func TestReplyThroughPgBouncer(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	direct, url := pgtest.NewPool(t, 2)
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	big := strings.Repeat("x", 12<<20)
	small := dbidem.Job{Principal: "alice", Key: "bouncer-small", Action: "a", LockTimeout: 2 * time.Second}
	large := dbidem.Job{Principal: "alice", Key: "bouncer-large", Action: "a", LockTimeout: 2 * time.Second}
	if _, _, err := replyDo(ctx, direct, small); err != nil {
		t.Fatal(err)
	}
	if _, _, err := dbidem.Do(ctx, direct, large, dbidem.TxOptions{}, func(context.Context, pgx.Tx) (string, error) { return big, nil }); err != nil {
		t.Fatal(err)
	}
	bouncer := func(t *testing.T, p *pgtest.Proxy) *pgxpool.Pool {
		host, port, _ := net.SplitHostPort(p.Addr)
		var pn int
		fmt.Sscan(port, &pn)
		sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		b, err := pgbouncer.Start(sctx, pgbouncer.Config{Host: host, Port: pn, Users: map[string]string{cfg.User: cfg.Password},
			Settings: map[string]string{"admin_users": cfg.User}})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(b.Stop)
		pool, err := pgxpool.New(ctx, pgtest.ThroughPgBouncer(t, url, b)+"&pool_max_conns=1")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(pool.Close)
		return pool
	}
	t.Run("black-hole", func(t *testing.T) {
		p := pgtest.NewProxy(t, pgtest.TCPAddr(t))
		pool := bouncer(t, p)
		if _, _, err := replyDo(ctx, pool, small); err != nil {
			t.Fatal(err)
		}
		p.SetFault(pgtest.Swallow)
		start := time.Now()
		_, _, err := replyDo(ctx, pool, small)
		took := time.Since(start)
		if !dbidem.IsNoReply(err) || took > dbidem.ClaimReplyMargin+1500*time.Millisecond {
			t.Fatalf("a black hole behind PgBouncer ended after %s with %v, want no reply at about %s", took, err, dbidem.ClaimReplyMargin)
		}
	})
	t.Run("slow-link", func(t *testing.T) {
		p := pgtest.NewProxy(t, pgtest.TCPAddr(t))
		pool := bouncer(t, p)
		if _, _, err := replyDo(ctx, pool, small); err != nil {
			t.Fatal(err)
		}
		p.Rate.Store(3 << 19)
		start := time.Now()
		v, replayed, err := dbidem.Do(ctx, pool, large, dbidem.TxOptions{}, func(context.Context, pgx.Tx) (string, error) { return "", errors.New("ran again") })
		took := time.Since(start)
		if err != nil || !replayed || len(v) != len(big) {
			t.Fatalf("12 MB behind PgBouncer on a slow link after %s: %d bytes, replayed %v, %v", took, len(v), replayed, err)
		}
		if took < 7*time.Second {
			t.Fatalf("12 MB in %s: the link is not slow enough to pass the bound", took)
		}
	})
}

// Over a Unix socket (the test cluster's default; here a proxy's socket), a black hole is
// given up at the plain bound and its four graces (D213: 4 x 50 ms).
func TestReplyUnixSocketBlackHole(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	direct, url := pgtest.NewPool(t, 2)
	job := dbidem.Job{Principal: "alice", Key: "unix-bh", Action: "a", LockTimeout: 2 * time.Second}
	if _, _, err := replyDo(ctx, direct, job); err != nil {
		t.Fatal(err)
	}
	dir, err := os.MkdirTemp("", "sock")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	p := pgtest.NewProxyOn(t, "unix", filepath.Join(dir, ".s.PGSQL.5432"), pgtest.TCPAddr(t))
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	dsn := fmt.Sprintf("host=%s port=5432 user=%s dbname=%s sslmode=disable pool_max_conns=1", dir, cfg.User, cfg.Database)
	if cfg.Password != "" {
		dsn += " password=" + cfg.Password
	}
	pool, err := pgxpool.New(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	for _, mode := range []pgtest.Fault{pgtest.Swallow, pgtest.Hold} {
		if _, replayed, err := replyDo(ctx, pool, job); err != nil || !replayed {
			t.Fatalf("warm-up: %v %v", replayed, err)
		}
		p.SetFault(mode)
		start := time.Now()
		_, _, err := replyDo(ctx, pool, job)
		took := time.Since(start)
		if !dbidem.IsNoReply(err) || took < dbidem.ClaimReplyMargin || took > dbidem.ClaimReplyMargin+1500*time.Millisecond {
			t.Fatalf("a black hole (mode %d) over a Unix socket ended after %s with %v, want no reply at about %s", mode, took, err, dbidem.ClaimReplyMargin)
		}
		p.SetFault(pgtest.Forward)
	}
}

// A lease claim that waited for a pool connection until its unit's bound was near, and whose
// statement then waits on the key's row (within its lock timeout) past that bound, is answered:
// the unit's bound defers to the bound of a claim statement under way, which counts from the
// statement's sending. Before, the unit's bound (the lock timeout and about 6 s from the call)
// gave the statement up as "no reply" 1.4 s after it was sent, on a healthy connection: what
// CI saw as a large replay taken for lost when four callers shared two connections.
func TestLeaseClaimSentLateKeepsItsOwnBound(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, url := pgtest.NewPool(t, 1)
	job := dbidem.Job{Principal: "alice", Key: "late-sent", Action: "a", Lease: 30 * time.Second, LockTimeout: 2 * time.Second}
	// The pool's one connection is held for 6.6 s; the key, by another caller's claim in its
	// open transaction, from 6.4 s to 8.4 s (rolled back then): the lease claim is sent at
	// about 6.6 s and waits on the key until 8.4 s, its lock timeout (2 s) not reached; the
	// unit's bound passes at about 8.0 s.
	held, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	release := func() { once.Do(held.Release) }
	t.Cleanup(release) // before the pool's Close, which waits for it
	start := time.Now()
	holder, claimed := holdKey(t, url, job, start, 6400*time.Millisecond, 8400*time.Millisecond)
	// given back at 6.6 s, and never before the holder has the key: on a loaded machine its
	// claim may come late, and the lease claim must not get the key first
	go func() {
		<-claimed
		time.Sleep(time.Until(start.Add(6600 * time.Millisecond)))
		release()
	}()
	v, replayed, err := dbidem.DoLease(ctx, pool, job, func(context.Context, dbidem.LeaseClaim) (string, error) { return "late", nil })
	took := time.Since(start)
	holder()
	if err != nil || replayed || v != "late" {
		t.Fatalf("a lease claim sent at 6.6 s, its key held until 8.4 s: after %s %q, replayed %v, %v; want its own run", took, v, replayed, err)
	}
	if took < 8400*time.Millisecond {
		t.Fatalf("answered after %s, before the key was given up: the test did not hold the gap open", took)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem.idempotency_keys WHERE key = 'late-sent' AND state = 'c'`); n != 1 {
		t.Fatalf("%d completed rows for the key; want the lease's answer stored once", n)
	}
}

// A lease claim that gets no pool connection within its unit's bound is given up as the
// store's failure (IsNoReply: a lease route answers 503 store_unavailable), and says what
// happened: it waited for the pool and sent nothing, no connection was taken for lost.
func TestLeaseClaimWithoutAPoolConnectionSaysSo(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 1)
	held, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	time.AfterFunc(10*time.Second, held.Release)
	job := dbidem.Job{Principal: "alice", Key: "no-conn", Action: "a", Lease: 30 * time.Second, LockTimeout: 2 * time.Second}
	start := time.Now()
	_, _, err = dbidem.DoLease(ctx, pool, job, func(context.Context, dbidem.LeaseClaim) (string, error) { return "ran", nil })
	took := time.Since(start)
	if !dbidem.IsNoReply(err) || !strings.Contains(err.Error(), "no connection from the pool") ||
		strings.Contains(err.Error(), "taken for lost") {
		t.Fatalf("a lease claim without a pool connection for 10 s: after %s %v; want no reply, told as a wait for the pool", took, err)
	}
	if took < 7*time.Second || took > 9500*time.Millisecond {
		t.Fatalf("given up after %s; want the unit's bound, about 8 s", took)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem.idempotency_keys WHERE key = 'no-conn'`); n != 0 {
		t.Fatalf("%d rows for a claim that was never sent", n)
	}
}

// A lease claim whose probe kept the unit's bound going past its end (the probe was sent late,
// after a wait for the pool, and answered late) has ClaimReplyMargin for what follows the probe:
// its ROLLBACK, a connection again, and the claim that waits on the key. Before, the unit's next
// look, a tick after the probe's answer, gave it up while it waited for its connection.
func TestLeaseClaimAfterALateProbeKeepsItsUnit(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, url := pgtest.NewPool(t, 1)
	owner := pgtest.Connect(t, url)
	// Every insert of this key takes a second, before it meets the key's holder.
	pgtest.Exec(t, owner, `CREATE FUNCTION public.slow_insert() RETURNS trigger LANGUAGE plpgsql AS
		$$BEGIN IF NEW.key = 'late-probe' THEN PERFORM pg_sleep(1); END IF; RETURN NEW; END$$`)
	pgtest.Exec(t, owner, `CREATE TRIGGER slow_insert BEFORE INSERT ON idem.idempotency_keys
		FOR EACH ROW EXECUTE FUNCTION public.slow_insert()`)
	job := dbidem.Job{Principal: "alice", Key: "late-probe", Action: "a", Lease: 30 * time.Second, LockTimeout: 2 * time.Second}
	held, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	release := func() { once.Do(held.Release) }
	t.Cleanup(release) // before the pool's Close, which waits for it
	start := time.Now()
	at := func(d time.Duration) { time.Sleep(time.Until(start.Add(d))) }
	// Another caller's claim holds the key, in its open transaction, from about 6 s (its
	// insert takes a second too) to 10 s.
	holder, claimed := holdKey(t, url, job, start, 5*time.Second, 10*time.Second)
	// The pool's one connection: the test's until 7.5 s (the probe is sent then, and answered
	// at about 8.5 s, past the unit's bound at 8.02 s), then the probe's, then the test's again
	// until 9.5 s (asked for at 7.7 s, while the probe runs: first in line), then the claim's.
	go func() {
		<-claimed // never before the holder has the key, however late its claim comes
		at(7500 * time.Millisecond)
		release()
		at(7700 * time.Millisecond)
		c, err := pool.Acquire(ctx)
		if err != nil {
			t.Error(err)
			return
		}
		at(9500 * time.Millisecond)
		c.Release()
	}()
	v, replayed, err := dbidem.DoLease(ctx, pool, job, func(context.Context, dbidem.LeaseClaim) (string, error) { return "late", nil })
	took := time.Since(start)
	holder()
	if err != nil || replayed || v != "late" {
		t.Fatalf("a lease claim whose probe was answered past the unit's bound: after %s %q, replayed %v, %v; want its own run", took, v, replayed, err)
	}
	if took < 9500*time.Millisecond {
		t.Fatalf("answered after %s, before the test gave the connection back: the test did not hold the gap open", took)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem.idempotency_keys WHERE key = 'late-probe' AND state = 'c'`); n != 1 {
		t.Fatalf("%d completed rows for the key; want the lease's answer stored once", n)
	}
}

// holdKey has another caller (a pool of its own on url) claim job's key as a transactional
// claim from..until after start, its transaction open all along, and roll it back then. The
// function it returns waits for the holder and fails the test unless it gave the key up as
// planned; the channel is closed once the holder has the key (or failed to claim it).
func holdKey(t *testing.T, url string, job dbidem.Job, start time.Time, from, until time.Duration) (func(), <-chan struct{}) {
	t.Helper()
	ctx := context.Background()
	other, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(other.Close)
	// connected now: a connection made when the hold starts may come late on a loaded machine,
	// and the claim it should wait for go through first
	if err := other.Ping(ctx); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	claimed := make(chan struct{})
	var once sync.Once
	time.AfterFunc(time.Until(start.Add(from)), func() {
		tx := job
		tx.Lease = 0
		_, _, err := dbidem.Do(ctx, other, tx, dbidem.TxOptions{}, func(context.Context, pgx.Tx) (string, error) {
			once.Do(func() { close(claimed) })
			time.Sleep(time.Until(start.Add(until)))
			return "", errors.New("the holder gives the key up")
		})
		once.Do(func() { close(claimed) }) // a holder that failed to claim lets the test go on, to fail
		done <- err
	})
	return func() {
		t.Helper()
		if err := <-done; err == nil || !strings.Contains(err.Error(), "gives the key up") {
			t.Fatalf("the key's holder: %v; want its own error, the key held until %s", err, until)
		}
	}, claimed
}

// The functions' default lock timeout, which a Gate reads once when a claim names none, is
// read on the caller's context, which may have no deadline (the middleware's work context on
// a lease route, DoLease's): on a link that stops answering it waited for the kernel. It gets
// ClaimReplyMargin now, and says no reply.
func TestGateDefaultLockTimeoutReadIsBounded(t *testing.T) {
	t.Parallel()
	_, url := pgtest.NewPool(t, 1)
	p := pgtest.NewProxy(t, pgtest.TCPAddr(t))
	pool := replyPool(t, url, p.Addr)
	if err := pool.Ping(context.Background()); err != nil {
		t.Fatal(err)
	}
	p.SetFault(pgtest.Hold)
	g := dbidem.NewGate(dbidem.GateOptions{})
	done := make(chan error, 1)
	start := time.Now()
	go func() {
		_, err := g.LockTimeout(context.Background(), pool, dbidem.Claim{Principal: "alice", Key: "k"})
		done <- err
	}()
	select {
	case err := <-done:
		took := time.Since(start)
		if !dbidem.IsNoReply(err) || took < dbidem.ClaimReplyMargin {
			t.Fatalf("the default lock timeout's read on a black-holed link: %v after %s; want no reply after %s", err, took, dbidem.ClaimReplyMargin)
		}
	case <-time.After(dbidem.ClaimReplyMargin + 10*time.Second):
		t.Fatalf("the default lock timeout's read on a black-holed link had no answer after %s", time.Since(start))
	}
	p.SetFault(pgtest.Forward)
}

// TestBoundedAskLeavesItsCommitTheMargin: in a lease claim's unit, a statement fn sends through
// Tx.Bounded (the middleware's asks under an earlier release's fingerprint) that ended just
// inside the unit's bound (5 s from the claim's answer) left its COMMIT only what remained of
// it: a COMMIT of 0.5 s (a deferred trigger here; a synchronous standby, a slow fsync) was
// given up as no reply. What follows such a statement gets ClaimReplyMargin from its end now.
func TestBoundedAskLeavesItsCommitTheMargin(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 4)
	ctx := context.Background()
	gate := dbidem.NewGate(dbidem.GateOptions{})
	c := dbidem.Claim{Principal: "alice", Key: "ask-then-commit", Action: "a", Lease: 30 * time.Second, LockTimeout: 2 * time.Second}
	c.Fingerprint[0] = 1
	ask := dbidem.ClaimReplyMargin - 300*time.Millisecond
	err := gate.RunDetached(ctx, ctx, pool, dbidem.TxOptions{}, c, 0, func(tx *dbidem.Tx, d dbidem.Decision) error {
		if d.Outcome != dbidem.Claimed {
			return fmt.Errorf("outcome %v", d.Outcome)
		}
		sctx, done := tx.Bounded(ctx, 0)
		_, err := tx.Exec(sctx, `CREATE TEMP TABLE slowc(x int) ON COMMIT DROP;
CREATE FUNCTION pg_temp.slowf() RETURNS trigger LANGUAGE plpgsql AS $f$ BEGIN PERFORM pg_sleep(0.5); RETURN NULL; END $f$;
CREATE CONSTRAINT TRIGGER slowt AFTER INSERT ON slowc DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION pg_temp.slowf();
INSERT INTO slowc VALUES (1)`)
		done()
		if err != nil {
			return err
		}
		sctx, done = tx.Bounded(ctx, 8*time.Second) // an ask that may wait 8 s on the key's row
		_, err = tx.Exec(sctx, fmt.Sprintf(`SELECT pg_sleep(%g)`, ask.Seconds()))
		done()
		return err
	})
	if err != nil {
		t.Fatalf("an ask of %s, then a COMMIT of 0.5 s: %v; want the COMMIT given the margin", ask, err)
	}
}

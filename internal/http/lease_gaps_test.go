package idemhttp_test

// A review of the fault paths of lease work left over by review_lease_faults_test.go: a reply
// lost before the work starts, connections black-holed (nothing comes back, nothing closes)
// during the claim, an extension, the answer's recording and the yield, steps under takeovers,
// and contexts ended between statements of DoLease. Where a test's comment tells of a stall,
// a second run or a lost value, it tells what the review found: the test failed then, and
// D168 fixed it (the test asserts the fixed behaviour).

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gorilla/mux"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/internal/canon"
	"github.com/pgidem/pgidem/internal/dbidem"
	idemhttp "github.com/pgidem/pgidem/internal/http"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// gapAction is what gapProxy does to a connection when a rule's trigger goes by.
type gapAction int

const (
	// gapBlackhole forwards the triggering chunk (the statement runs), then nothing more goes
	// either way, and nothing closes: the client's close does not reach the server, the
	// server's replies do not reach the client.
	gapBlackhole gapAction = iota
	// gapBlackholeBefore drops the triggering chunk too (the statement never runs).
	gapBlackholeBefore
	// gapCut forwards the chunk, drops every reply, and closes the client's side 100 ms later
	// (the client loses the reply), the server's 300 ms after that.
	gapCut
	// gapHoldReply forwards the chunk and holds the server's replies until the rule's release.
	gapHoldReply
	// gapHoldRequest holds the triggering chunk (and what follows from the client) until the
	// rule's release, then forwards it.
	gapHoldRequest
)

type gapRule struct {
	trigger string
	action  gapAction
	left    atomic.Int32
	hit     chan struct{}
	release chan struct{}
	once    sync.Once
}

func (r *gapRule) arm(n int32) { r.left.Store(n) }
func (r *gapRule) free()       { r.once.Do(func() { close(r.release) }) }

func (r *gapRule) wait(t *testing.T, what string) {
	t.Helper()
	select {
	case <-r.hit:
	case <-time.After(15 * time.Second):
		t.Fatalf("the proxy saw no %s", what)
	}
}

type gapProxy struct {
	addr     string
	rules    []*gapRule
	done     chan struct{}
	stopOnce sync.Once
}

// stop ends every black hole and hold: their connections close.
func (p *gapProxy) stop() {
	p.stopOnce.Do(func() {
		for _, r := range p.rules {
			r.free()
		}
		close(p.done)
	})
}

// newGapProxy forwards connections to target and applies the first armed rule whose trigger a
// client's chunk carries.
func newGapProxy(t *testing.T, target string) *gapProxy {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &gapProxy{addr: l.Addr().String(), done: make(chan struct{})}
	t.Cleanup(func() {
		p.stop()
		l.Close()
	})
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go p.serve(c, target)
		}
	}()
	return p
}

func (p *gapProxy) rule(trigger string, action gapAction) *gapRule {
	r := &gapRule{trigger: trigger, action: action, hit: make(chan struct{}, 64), release: make(chan struct{})}
	p.rules = append(p.rules, r)
	return r
}

func (p *gapProxy) serve(c net.Conn, target string) {
	s, err := net.Dial("tcp", target)
	if err != nil {
		c.Close()
		return
	}
	go func() { <-p.done; s.Close(); c.Close() }() // the test's end closes every connection
	var holed atomic.Bool
	var holdMu sync.Mutex
	var hold chan struct{}
	closeBoth := func() {
		if holed.Load() {
			<-p.done // a black hole: nothing closes until the test ends
		}
		s.Close()
		c.Close()
	}
	go func() {
		buf := make([]byte, 64<<10)
		for {
			n, err := s.Read(buf)
			if n > 0 && !holed.Load() {
				holdMu.Lock()
				h := hold
				holdMu.Unlock()
				if h != nil {
					select {
					case <-h:
					case <-p.done:
					}
				}
				if !holed.Load() {
					if _, werr := c.Write(buf[:n]); werr != nil {
						closeBoth()
						return
					}
				}
			}
			if err != nil {
				closeBoth()
				return
			}
		}
	}()
	buf := make([]byte, 64<<10)
	for {
		n, err := c.Read(buf)
		if n > 0 && !holed.Load() {
			chunk := buf[:n]
			forward := true
			for _, r := range p.rules {
				if !bytes.Contains(chunk, []byte(r.trigger)) {
					continue
				}
				left := r.left.Load()
				if left <= 0 || !r.left.CompareAndSwap(left, left-1) {
					continue
				}
				switch r.action {
				case gapBlackhole:
					if _, werr := s.Write(chunk); werr != nil {
						break
					}
					forward = false
					holed.Store(true)
				case gapBlackholeBefore:
					forward = false
					holed.Store(true)
				case gapCut:
					if _, werr := s.Write(chunk); werr != nil {
						break
					}
					forward = false
					holed.Store(true)
					go func() {
						time.Sleep(100 * time.Millisecond)
						c.Close()
						time.Sleep(300 * time.Millisecond)
						s.Close()
					}()
				case gapHoldReply:
					holdMu.Lock()
					hold = r.release
					holdMu.Unlock()
				case gapHoldRequest:
					r.hit <- struct{}{}
					select {
					case <-r.release:
					case <-p.done:
					}
				}
				if r.action != gapHoldRequest {
					r.hit <- struct{}{}
				}
				break
			}
			if forward {
				if _, werr := s.Write(chunk); werr != nil {
					break
				}
			}
		}
		if err != nil {
			break
		}
	}
	closeBoth()
}

// gapApp is a lease route POST /work and a stepped lease route POST /steps, whose middleware
// reaches the database through a gapProxy (exec mode: each statement's text goes by).
type gapApp struct {
	leaseWork
	t       *testing.T
	direct  *pgxpool.Pool
	proxied *pgxpool.Pool
	proxy   *gapProxy
	srv     *httptest.Server
	relOnce sync.Once
	steps   atomic.Int32 // step functions run
}

func newGapApp(t *testing.T, lease time.Duration, edit func(*idemhttp.Options)) *gapApp {
	t.Helper()
	direct, _ := pgtest.NewPool(t, 20)
	z := &gapApp{t: t, direct: direct}
	z.init()
	z.proxy = newGapProxy(t, pgtest.TCPAddr(t))
	z.proxied = faultPool(t, direct, z.proxy.addr)
	m := faultMiddleware(t, z.proxied, edit)
	r := mux.NewRouter()
	r.Handle("/work", m.Route(idemhttp.Route{Lease: lease, Required: true})(z.handler())).Methods("POST")
	pgtest.Exec(t, direct, `CREATE TABLE gap_rows (id serial PRIMARY KEY, key text, step text)`)
	z.srv = httptest.NewServer(r)
	t.Cleanup(func() {
		z.proxy.stop() // a request stuck in a black hole ends: its connection closes
		z.unblock()
		z.srv.CloseClientConnections()
		z.srv.Close()
		go z.proxied.Close() // a connection stuck in a black hole would hold Close
	})
	return z
}

func (z *gapApp) unblock() { z.relOnce.Do(func() { close(z.release) }) }

// post sends POST path with the key, giving up after limit (status 0 then).
func (z *gapApp) post(limit time.Duration, key string, headers ...string) (reply, time.Duration) {
	z.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), limit)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, "POST", z.srv.URL+"/work", bytes.NewBufferString(`{}`))
	if err != nil {
		z.t.Fatal(err)
	}
	req.Header.Set("Idempotency-Key", key)
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Set(headers[i], headers[i+1])
	}
	start := time.Now()
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return reply{}, time.Since(start)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return reply{resp.StatusCode, resp.Header, string(b)}, time.Since(start)
}

func (z *gapApp) count(sql string, args ...any) int {
	z.t.Helper()
	return pgtest.Count(z.t, z.direct, sql, args...)
}

// lockKey holds the key's row lock from another session until the returned func is called.
func (z *gapApp) lockKey(key string) func() {
	z.t.Helper()
	return lockRow(z.t, z.direct, `SELECT count(*) FROM (SELECT 1 FROM idem.idempotency_keys WHERE principal_id = 'alice' AND key = $1 FOR UPDATE) x`, key)
}

func lockRow(t *testing.T, pool *pgxpool.Pool, sql string, args ...any) func() {
	t.Helper()
	conn, err := pool.Acquire(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	tx, err := conn.Begin(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, tx, `SET LOCAL statement_timeout = 0`)
	pgtest.Exec(t, tx, `SET LOCAL idle_in_transaction_session_timeout = 0`)
	if n := pgtest.Count(t, tx, sql, args...); n != 1 {
		t.Fatalf("%d rows locked, want 1", n)
	}
	var once atomic.Bool
	unlock := func() {
		if once.CompareAndSwap(false, true) {
			_ = tx.Commit(context.Background())
			conn.Release()
		}
	}
	t.Cleanup(unlock)
	return unlock
}

// strandedClaim leaves a lease claim of key (lease) whose holder is gone: committed, never
// extended, answered or given up. It returns the claim's provider key.
func strandedClaim(t *testing.T, pool *pgxpool.Pool, key string, lease time.Duration) string {
	t.Helper()
	var pk string
	err := dbidem.RunTx(context.Background(), pool, dbidem.TxOptions{}, func(tx *dbidem.Tx) error {
		d, err := tx.Claim(context.Background(), gapClaim(key, lease))
		pk = d.ProviderKey
		if err == nil && d.Outcome != dbidem.Claimed {
			err = fmt.Errorf("outcome %s", d.Outcome)
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return pk
}

// gapClaim is the claim that the route /work makes for key: the fingerprint of its request.
func gapClaim(key string, lease time.Duration) dbidem.Claim {
	return dbidem.Claim{Principal: "alice", Key: key, Action: "POST /work", Fingerprint: gapFingerprint, Lease: lease}
}

// gapFingerprint is the fingerprint of /work's request body `{}`.
var gapFingerprint = canon.Compute("POST", "/work", []byte(`{}`)).Sum

// TestLeasePreWorkExtensionReplyLostIsGivenUp: a claim that came back late (it waited on
// the key's row lock, held by another session, past its lease) extends its lease before the
// work starts (KeepAlive). That extension lands but its reply is lost (the connection is
// black-holed): the lease counts as lost by this process's clock, the handler does not run,
// and the client gets 409. But the database's lease was just extended by a whole lease, and
// the lease route gives nothing up on this path (DoLease does: giveUpRanOut): every retry
// meanwhile waits and gets 409 until the database's lease runs out.
func TestLeasePreWorkExtensionReplyLostIsGivenUp(t *testing.T) {
	t.Parallel()
	const lease = 1500 * time.Millisecond
	// A DuplicateWait past the lease: the claim's wait on the key's row is bounded by it.
	z := newGapApp(t, lease, func(o *idemhttp.Options) { o.DuplicateWait = 5 * time.Second })
	strandedClaim(t, z.direct, "pre-ext", lease)
	time.Sleep(lease + 100*time.Millisecond) // the stranded claim's lease runs out
	unlock := z.lockKey("pre-ext")
	ext := z.proxy.rule("idem_extend", gapBlackhole)
	ext.arm(1)
	first := make(chan reply, 1)
	go func() { r, _ := z.post(20*time.Second, "pre-ext"); first <- r }()
	pgtest.WaitFor(t, z.direct, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
		AND query LIKE '%idem_begin%' AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()`)
	time.Sleep(lease + 200*time.Millisecond) // the claim waits past its lease
	unlock()
	ext.wait(t, "pre-work extension")
	r := <-first
	rest := z.count(`SELECT coalesce(extract(epoch FROM lease_expires_at - clock_timestamp()) * 1000, 0)::int
		FROM idem.idempotency_keys WHERE key = 'pre-ext' AND state = 'p'`)
	t.Logf("the late claim: %d %s (runs %d); the database's lease stands %d ms more", r.status, r.body, z.runs.Load(), rest)
	r2, took := z.post(10*time.Second, "pre-ext")
	t.Logf("the retry: %d %s after %s, runs %d", r2.status, r2.body, took.Round(time.Millisecond), z.runs.Load())
	if r2.status != 202 || took > lease/2 {
		t.Fatalf("the retry of a request whose late claim lost its pre-work extension's reply: %d %s after %s; want the work run at once "+
			"(the claim given up, fenced by its token, as DoLease does), not a wait (409 past DuplicateWait) until the database's lease (extended by the lost reply) runs out",
			r2.status, r2.body, took.Round(time.Millisecond))
	}
}

// TestDoLeasePreWorkExtensionReplyLostIsGivenUp (checked): the same for DoLease, which gives
// the claim up (giveUpRanOut): the next run goes at once with the same provider key.
func TestDoLeasePreWorkExtensionReplyLostIsGivenUp(t *testing.T) {
	t.Parallel()
	const lease = 1500 * time.Millisecond
	z := newGapApp(t, lease, nil)
	job := dbidem.Job{Principal: "alice", Key: "do-pre-ext", Action: "ship", Input: 1, Lease: lease, LockTimeout: 5 * time.Second}
	c := dbidem.Claim{Principal: "alice", Key: "do-pre-ext", Action: "ship", Fingerprint: canon.Compute("DO", "ship", []byte("1")).Sum, Lease: lease}
	var stranded string
	if err := dbidem.RunTx(context.Background(), z.direct, dbidem.TxOptions{}, func(tx *dbidem.Tx) error {
		d, err := tx.Claim(context.Background(), c)
		stranded = d.ProviderKey
		return err
	}); err != nil {
		t.Fatal(err)
	}
	time.Sleep(lease + 100*time.Millisecond)
	unlock := z.lockKey("do-pre-ext")
	ext := z.proxy.rule("idem_extend", gapBlackhole)
	ext.arm(1)
	go func() {
		pgtest.WaitFor(t, z.direct, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
			AND query LIKE '%idem_begin%' AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()`)
		time.Sleep(lease + 200*time.Millisecond)
		unlock()
	}()
	runs := 0
	_, _, err := dbidem.DoLease(context.Background(), z.proxied, job, func(ctx context.Context, c dbidem.LeaseClaim) (int, error) {
		runs++
		return 1, nil
	})
	t.Logf("the late claim: %v, runs %d", err, runs)
	start := time.Now()
	got, replayed, err := dbidem.DoLease(context.Background(), z.proxied, job, func(ctx context.Context, c dbidem.LeaseClaim) (int, error) {
		runs++
		if c.ProviderKey != stranded {
			t.Errorf("provider key %s, want the generation's %s", c.ProviderKey, stranded)
		}
		return 2, nil
	})
	t.Logf("the next run: %d replayed %v %v after %s, runs %d", got, replayed, err, time.Since(start).Round(time.Millisecond), runs)
	if err != nil || runs == 0 {
		t.Fatalf("the next run: %v; want fn run at once", err)
	}
}

// TestLeaseClaimBlackholedEnds: the connection of a lease claim is black-holed after its
// idem_begin_steps went out (the claim ran; nothing comes back, nothing closes). The claim runs
// on the work's context, which has no deadline on a lease route (LeaseTimeout counts from the
// claim, the route's WorkTimeout does not apply): the request should still end within a bound
// (the lock timeout, the lease), and a retry converge once the client gives up.
func TestLeaseClaimBlackholedEnds(t *testing.T) {
	t.Parallel()
	z := newGapApp(t, time.Second, nil)
	claim := z.proxy.rule("idem_begin_steps", gapBlackhole)
	claim.arm(1)
	r, took := z.post(3*dbidem.ClaimReplyMargin, "claim-hole")
	t.Logf("the request whose claim was black-holed: %d %s after %s", r.status, r.body, took.Round(time.Millisecond))
	if r.status != http.StatusServiceUnavailable || took > dbidem.ClaimReplyMargin+3*time.Second {
		t.Fatalf("the request whose lease claim was black-holed: %d %s after %s; want 503 store_unavailable within the claim's bound "+
			"(its lock timeout's probe and ClaimReplyMargin), not an answer the client never gets", r.status, r.body, took.Round(time.Millisecond))
	}
	// The server still holds the uncommitted claim (it never heard the connection close): it
	// ends that transaction once it has been idle for ClaimReplyMargin, and a client that keeps
	// retrying gets the work run, once.
	start := time.Now()
	var r2 reply
	for time.Since(start) < 3*dbidem.ClaimReplyMargin {
		if r2, _ = z.post(5*time.Second, "claim-hole"); r2.status == http.StatusAccepted {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	t.Logf("the retries: %d %s after %s; runs %d", r2.status, r2.body, time.Since(start).Round(time.Millisecond), z.runs.Load())
	if r2.status != http.StatusAccepted || z.runs.Load() != 1 {
		t.Fatalf("retrying after a black-holed lease claim: %d %s after %s, runs %d; want the work run once within %s",
			r2.status, r2.body, time.Since(start).Round(time.Millisecond), z.runs.Load(), 3*dbidem.ClaimReplyMargin)
	}
}

// TestLeaseClaimCommitBlackholedEnds: the same with the claim's COMMIT black-holed (the
// claim committed: the key holds a lease nobody works under). The request should end, and once
// the lease has run out a retry should take the key over and run.
func TestLeaseClaimCommitBlackholedEnds(t *testing.T) {
	t.Parallel()
	const lease = time.Second
	z := newGapApp(t, lease, nil)
	commit := z.proxy.rule("commit\x00", gapBlackhole)
	commit.arm(1)
	r, took := z.post(6*time.Second, "commit-hole")
	t.Logf("the request whose claim's COMMIT was black-holed: %d %s after %s", r.status, r.body, took.Round(time.Millisecond))
	time.Sleep(lease)
	r2, took2 := z.post(6*time.Second, "commit-hole")
	t.Logf("the retry, past the lease: %d %s after %s; runs %d; key rows in progress %d", r2.status, r2.body, took2.Round(time.Millisecond),
		z.runs.Load(), z.count(`SELECT count(*) FROM idem.idempotency_keys WHERE key = 'commit-hole' AND state = 'p'`))
	// Another process (a middleware of its own, on a pool of its own) takes the key over at once.
	other, err := idemhttp.New(idemhttp.Options{DB: z.direct, LockTimeout: 5 * time.Second, DuplicateWait: 300 * time.Millisecond,
		Principal: func(r *http.Request) (string, bool) { return "alice", true },
		Logger:    slog.New(slog.NewTextHandler(io.Discard, nil)), RouteTemplate: muxTemplate})
	if err != nil {
		t.Fatal(err)
	}
	or := mux.NewRouter()
	or.Handle("/work", other.Route(idemhttp.Route{Lease: lease, Required: true})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusAccepted)
		fmt.Fprint(w, `{"run":"other"}`)
	}))).Methods("POST")
	osrv := httptest.NewServer(or)
	defer osrv.Close()
	status, _, body := pgtest.Send(t, context.Background(), "POST", osrv.URL+"/work", `{}`, "Idempotency-Key", "commit-hole", "Content-Type", "application/json")
	t.Logf("the same retry to another process: %d %s", status, body)
	if r.status == 0 {
		t.Errorf("the request whose lease claim's COMMIT was black-holed had no answer after %s: nothing bounds it", took.Round(time.Millisecond))
	}
	if r2.status != 202 {
		t.Errorf("the retry past the lease: %d %s after %s; want a takeover and a run (the key's lease ran out long ago)",
			r2.status, r2.body, took2.Round(time.Millisecond))
	}
}

// TestLeaseExtensionBlackholedKeepsTheLease (checked): one extension's connection is
// black-holed after the statement went out. The extension gives up at its deadline (a third of
// the lease; pgx's deadline handler closes the connection), the next one, on another
// connection, succeeds: the handler, held past a whole lease, keeps its context; one run,
// answered and replayed.
func TestLeaseExtensionBlackholedKeepsTheLease(t *testing.T) {
	t.Parallel()
	z := newGapApp(t, 1500*time.Millisecond, nil)
	ext := z.proxy.rule("idem_extend", gapBlackhole)
	ext.arm(1)
	first := make(chan reply, 1)
	go func() { r, _ := z.post(20*time.Second, "ext-hole", "X-Block", "1"); first <- r }()
	<-z.started
	ext.wait(t, "extension")
	time.Sleep(2500 * time.Millisecond)
	z.unblock()
	r := <-first
	z.kept(t, "after one black-holed extension")
	r2, _ := z.post(5*time.Second, "ext-hole")
	z.answeredOnce(t, r, r2)
}

// TestLeaseCompleteBlackholedIsTriedAgainSoon: the connection of the lease answer's
// idem_complete is black-holed after the statement went out (it landed: the answer is
// stored). Persist gives each try the whole answer deadline (at least a lease): the one try
// waits it out on the dead connection, and the client gets 503 outcome_unknown a lease later,
// for an answer that was stored at once; every other connection of the pool was fine. The
// try's goroutine keeps its pool connection for as long as the connection stays dead.
func TestLeaseCompleteBlackholedIsTriedAgainSoon(t *testing.T) {
	t.Parallel()
	const lease = 15 * time.Second
	z := newGapApp(t, lease, nil)
	complete := z.proxy.rule("idem_complete", gapBlackhole)
	complete.arm(1)
	r, took := z.post(10*time.Second, "complete-hole")
	stored := z.count(`SELECT count(*) FROM idem.idempotency_keys WHERE key = 'complete-hole' AND state = 'c'`)
	r2, _ := z.post(5*time.Second, "complete-hole")
	t.Logf("first %d %s after %s (stored %d); retry %d %s; runs %d; pool connections acquired now %d",
		r.status, r.body, took.Round(time.Millisecond), stored, r2.status, r2.body, z.runs.Load(), z.proxied.Stat().AcquiredConns())
	if r.status != 202 || took > 2*lease/3 {
		t.Fatalf("the answer whose idem_complete was black-holed (it landed): %d %s after %s; want 202 well within the lease "+
			"(a try bounded, then another try on another connection finds it stored)", r.status, r.body, took.Round(time.Millisecond))
	}
}

// TestLeaseCompleteBlackholedBeforeRunsOnce: the same, the statement dropped (it never ran).
// The answer is 503 a lease later; the key stays in progress, the retry takes it over and the
// work runs again, where a second try on another connection would have recorded the answer.
func TestLeaseCompleteBlackholedBeforeRunsOnce(t *testing.T) {
	t.Parallel()
	const lease = 15 * time.Second
	z := newGapApp(t, lease, nil)
	complete := z.proxy.rule("idem_complete", gapBlackholeBefore)
	complete.arm(1)
	r, took := z.post(10*time.Second, "complete-hole-before")
	r2, took2 := z.post(10*time.Second, "complete-hole-before")
	t.Logf("first %d %s after %s; retry %d %s after %s; runs %d", r.status, r.body, took.Round(time.Millisecond),
		r2.status, r2.body, took2.Round(time.Millisecond), z.runs.Load())
	if r.status != 202 || took > 2*lease/3 || z.runs.Load() != 1 {
		t.Fatalf("want the answer recorded on another try (202 within the lease), one run")
	}
}

// TestLeaseYieldBlackholedIsTriedAgainSoon: a handler answers 500; the connection of its
// idem_yield is black-holed. The client waits a whole lease for its 500 (the yield's one try
// takes the whole answer deadline).
func TestLeaseYieldBlackholedIsTriedAgainSoon(t *testing.T) {
	t.Parallel()
	const lease = 15 * time.Second
	z := newGapApp(t, lease, nil)
	y := z.proxy.rule("idem_yield", gapBlackholeBefore)
	y.arm(1)
	r, took := z.post(10*time.Second, "yield-hole", "X-Status", "500")
	r2, took2 := z.post(10*time.Second, "yield-hole")
	t.Logf("first %d after %s; retry %d %s after %s; runs %d", r.status, took.Round(time.Millisecond), r2.status, r2.body,
		took2.Round(time.Millisecond), z.runs.Load())
	if r.status != 500 || took > 2*lease/3 || r2.status != 202 || took2 > lease/2 {
		t.Fatalf("want the 500 at once (the yield tried again on another connection), and the retry run at once")
	}
}

// TestDoLeaseCanceledDuringClaimCommitIsGivenUp: DoLease's context ends while its lease
// claim's COMMIT is out (the reply held by the proxy; the COMMIT lands). DoLease returns
// ErrCommitUnknown and gives nothing up (the middleware gives such a claim up, D163): the key
// holds a lease nobody works under, and the next DoLease of the job gets ErrInProgress until
// it runs out.
func TestDoLeaseCanceledDuringClaimCommitIsGivenUp(t *testing.T) {
	t.Parallel()
	const lease = 3 * time.Second
	z := newGapApp(t, lease, nil)
	hold := z.proxy.rule("commit\x00", gapHoldReply)
	hold.arm(1)
	job := dbidem.Job{Principal: "alice", Key: "do-commit-cancel", Action: "ship", Input: 1, Lease: lease, LockTimeout: time.Second}
	ctx, cancel := context.WithCancel(context.Background())
	go func() { hold.wait(t, "claim COMMIT"); time.Sleep(100 * time.Millisecond); cancel() }()
	runs := 0
	_, _, err := dbidem.DoLease(ctx, z.proxied, job, func(ctx context.Context, c dbidem.LeaseClaim) (int, error) {
		runs++
		return 1, nil
	})
	hold.free()
	t.Logf("DoLease canceled during its claim's COMMIT: %v (runs %d)", err, runs)
	time.Sleep(200 * time.Millisecond)
	start := time.Now()
	got, _, err2 := dbidem.DoLease(context.Background(), z.proxied, job, func(ctx context.Context, c dbidem.LeaseClaim) (int, error) {
		runs++
		return 2, nil
	})
	t.Logf("the next run: %d %v after %s (runs %d)", got, err2, time.Since(start).Round(time.Millisecond), runs)
	if !errors.Is(err, dbidem.ErrCommitUnknown) && err != nil {
		t.Logf("note: the first DoLease said %v", err)
	}
	if err2 != nil {
		t.Fatalf("the next DoLease after one canceled during its claim's COMMIT: %v; want fn run at once "+
			"(the claim, whose token DoLease knows, given up as the middleware does), not ErrInProgress for the whole lease", err2)
	}
}

// gapJob is a DoLease job of its own key on the app's database.
func gapJob(key string, lease time.Duration) dbidem.Job {
	return dbidem.Job{Principal: "alice", Key: key, Action: "ship", Input: 1, Lease: lease, LockTimeout: 5 * time.Second, Timeout: 30 * time.Second}
}

// gapStepFn is a step's function that inserts a row for (key, step) and counts its runs.
func (z *gapApp) gapStepFn(key, step string) func(ctx context.Context, tx pgx.Tx) (int, error) {
	return func(ctx context.Context, tx pgx.Tx) (int, error) {
		z.steps.Add(1)
		var id int
		err := tx.QueryRow(ctx, `INSERT INTO gap_rows (key, step) VALUES ($1, $2) RETURNING id`, key, step).Scan(&id)
		return id, err
	}
}

// TestStepCommitLostThenRetriedReturnsTheSavedValue: a step's COMMIT reply is lost after it landed
// (the row and the recovery point committed); the work calls Step again with the same name in
// the same attempt, as "the same name again returns the saved value" invites. Step runs fn
// again (its writes roll back, an outside call in it repeats) and then fails with
// ErrStepRecorded: the attempt cannot go on, although the step is done and its value saved.
func TestStepCommitLostThenRetriedReturnsTheSavedValue(t *testing.T) {
	t.Parallel()
	z := newGapApp(t, 3*time.Second, nil)
	cut := z.proxy.rule("commit\x00", gapCut)
	var first, second error
	var v1, v2 int
	got, _, err := dbidem.DoLease(context.Background(), z.proxied, gapJob("step-again", 3*time.Second), func(ctx context.Context, c dbidem.LeaseClaim) (int, error) {
		cut.arm(1)
		v1, first = dbidem.Step(ctx, "a", z.gapStepFn("step-again", "a"))
		v2, second = dbidem.Step(ctx, "a", z.gapStepFn("step-again", "a"))
		if second != nil {
			return 0, second
		}
		return v2, nil
	})
	rows := z.count(`SELECT count(*) FROM gap_rows WHERE key = 'step-again'`)
	t.Logf("the first Step: %d %v; the same step again: %d %v; DoLease %d %v; step functions run %d, rows %d",
		v1, first, v2, second, got, err, z.steps.Load(), rows)
	if second != nil || z.steps.Load() != 1 || rows != 1 {
		t.Fatalf("the same step again after a lost COMMIT reply: %v, its function run %d times; want the saved value, "+
			"the function not run again (a step recorded is done: read its saved value back on ErrStepRecorded)", second, z.steps.Load())
	}
}

// TestStepCommitBlackholedIsBounded: a step's COMMIT is black-holed. RunTx
// waits for it on the work's context, which only the lease's loss or its Timeout ends, while
// the heartbeat, on other connections, keeps extending the lease: the work is stuck in Step
// until the Timeout (DefaultLeaseTimeout: 5 minutes), and every duplicate meanwhile is told the
// work is in progress.
func TestStepCommitBlackholedIsBounded(t *testing.T) {
	t.Parallel()
	const lease = 1500 * time.Millisecond
	z := newGapApp(t, lease, nil)
	hole := z.proxy.rule("commit\x00", gapBlackhole)
	job := gapJob("step-hole", lease)
	job.Timeout = 30 * time.Second
	start := time.Now()
	var stepTook time.Duration
	var stepErr error
	done := make(chan error, 1)
	go func() {
		_, _, err := dbidem.DoLease(context.Background(), z.proxied, job, func(ctx context.Context, c dbidem.LeaseClaim) (int, error) {
			hole.arm(1)
			s := time.Now()
			_, stepErr = dbidem.Step(ctx, "a", z.gapStepFn("step-hole", "a"))
			stepTook = time.Since(s)
			return 0, stepErr
		})
		done <- err
	}()
	hole.wait(t, "step COMMIT")
	time.Sleep(3 * lease)
	_, _, dup := dbidem.DoLease(context.Background(), z.direct, job, func(ctx context.Context, c dbidem.LeaseClaim) (int, error) { return 1, nil })
	err := <-done
	t.Logf("a duplicate %s after the step's COMMIT went into the black hole: %v; the Step returned after %s: %v; DoLease %v (after %s)",
		3*lease, dup, stepTook.Round(time.Millisecond), stepErr, err, time.Since(start).Round(time.Millisecond))
	if stepTook > dbidem.ClaimReplyMargin+3*time.Second {
		t.Fatalf("a step whose COMMIT was black-holed held the work %s (its Timeout), the lease extended all along; "+
			"want it bounded (a step's COMMIT abandoned after a bound, ErrCommitUnknown, as a lost reply)", stepTook.Round(time.Millisecond))
	}
}

// TestStepTakeoverWaitsForTheRecoveryPoint (checked): the first holder's step has run its
// idem_step (it holds the key's row) and its COMMIT is held on the way to the server. Its
// extensions wait on that row lock and fail, its lease runs out, its context ends (the Step
// returns ErrCommitUnknown). A second run of the job claims: its takeover waits on the row,
// the held COMMIT then lands, and the takeover is told the step: it skips it. One row, one
// step function run, the second run's answer, the first run's ErrLeaseLost.
func TestStepTakeoverWaitsForTheRecoveryPoint(t *testing.T) {
	t.Parallel()
	const lease = 1500 * time.Millisecond
	z := newGapApp(t, lease, nil)
	hold := z.proxy.rule("commit\x00", gapHoldRequest)
	job := gapJob("step-takeover", lease)
	firstDone := make(chan error, 1)
	var firstStep error
	go func() {
		_, _, err := dbidem.DoLease(context.Background(), z.proxied, job, func(ctx context.Context, c dbidem.LeaseClaim) (int, error) {
			hold.arm(1)
			_, firstStep = dbidem.Step(ctx, "a", z.gapStepFn("step-takeover", "a"))
			if firstStep != nil {
				return 0, firstStep
			}
			_, err := dbidem.Step(ctx, "b", z.gapStepFn("step-takeover", "b"))
			return 1, err
		})
		firstDone <- err
	}()
	hold.wait(t, "step COMMIT")
	time.Sleep(lease + 500*time.Millisecond) // the first run's lease runs out, here and in the database
	second := make(chan error, 1)
	var recovery string
	var got int
	go func() {
		var err error
		got, _, err = dbidem.DoLease(context.Background(), z.direct, job, func(ctx context.Context, c dbidem.LeaseClaim) (int, error) {
			recovery = c.RecoveryPoint
			if _, err := dbidem.Step(ctx, "a", z.gapStepFn("step-takeover", "a")); err != nil {
				return 0, err
			}
			_, err := dbidem.Step(ctx, "b", z.gapStepFn("step-takeover", "b"))
			return 2, err
		})
		second <- err
	}()
	pgtest.WaitFor(t, z.direct, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
		AND query LIKE '%idem_begin%' AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()`)
	hold.free()
	err2 := <-second
	err1 := <-firstDone
	rowsA := z.count(`SELECT count(*) FROM gap_rows WHERE key = 'step-takeover' AND step = 'a'`)
	rowsB := z.count(`SELECT count(*) FROM gap_rows WHERE key = 'step-takeover' AND step = 'b'`)
	t.Logf("first run: step %v, DoLease %v; second run: %d %v, recovery point %q; rows a %d b %d; step functions %d",
		firstStep, err1, got, err2, recovery, rowsA, rowsB, z.steps.Load())
	if err2 != nil || got != 2 || recovery != "a" || rowsA != 1 || rowsB != 1 || z.steps.Load() != 2 {
		t.Fatalf("want the takeover told step a (skipped), one row of each step, the second run's answer")
	}
}

// TestManyStepsResume (checked): 60 steps; the first run fails after 40 (its lease given up);
// the next runs the last 20 only, and gets the first 40's saved values.
func TestManyStepsResume(t *testing.T) {
	t.Parallel()
	z := newGapApp(t, 3*time.Second, nil)
	job := gapJob("many-steps", 3*time.Second)
	run := func(failAt int) (int, error) {
		sum, _, err := dbidem.DoLease(context.Background(), z.proxied, job, func(ctx context.Context, c dbidem.LeaseClaim) (int, error) {
			sum := 0
			for i := 0; i < 60; i++ {
				if i == failAt {
					return 0, errors.New("provider down")
				}
				name := "step-" + strconv.Itoa(i)
				id, err := dbidem.Step(ctx, name, z.gapStepFn("many-steps", name))
				if err != nil {
					return 0, err
				}
				sum += id
			}
			return sum, nil
		})
		return sum, err
	}
	_, err := run(40)
	afterFirst := z.steps.Load()
	sum, err2 := run(-1)
	want := z.count(`SELECT sum(id)::int FROM gap_rows WHERE key = 'many-steps'`)
	rows := z.count(`SELECT count(*) FROM gap_rows WHERE key = 'many-steps'`)
	t.Logf("first %v (%d steps run), second %d %v (%d steps run in all), rows %d, sum %d", err, afterFirst, sum, err2, z.steps.Load(), rows, want)
	if err2 != nil || afterFirst != 40 || z.steps.Load() != 60 || rows != 60 || sum != want {
		t.Fatalf("want 40 then 20 steps run, 60 rows, the saved ids summed")
	}
}

// TestDoCanceledBetweenStatements (checked): Do's context ends while each of its statements is
// out (the reply held by the proxy): the claim, the work's statement, the COMMIT that carries the
// completion. The caller is told the context's error (ErrCommitUnknown for the COMMIT), and the
// next Do either runs fn once (nothing committed) or replays the committed result.
func TestDoCanceledBetweenStatements(t *testing.T) {
	t.Parallel()
	z := newGapApp(t, time.Second, nil)
	for _, c := range []struct{ name, trigger string }{
		{"claim", "idem.idem_begin"}, {"work", "INSERT INTO gap_rows"}, {"commit", "idem_complete"},
	} {
		key := "do-cancel-" + c.name
		hold := z.proxy.rule(c.trigger, gapHoldReply)
		hold.arm(1)
		ctx, cancel := context.WithCancel(context.Background())
		go func() { hold.wait(t, c.name); time.Sleep(100 * time.Millisecond); cancel() }()
		job := dbidem.Job{Principal: "alice", Key: key, Action: "do", Input: 1, LockTimeout: time.Second}
		fns := 0
		fn := func(ctx context.Context, tx pgx.Tx) (int, error) {
			fns++
			var id int
			err := tx.QueryRow(ctx, `INSERT INTO gap_rows (key) VALUES ($1) RETURNING id`, key).Scan(&id)
			return id, err
		}
		_, _, err := dbidem.Do(ctx, z.proxied, job, dbidem.TxOptions{}, fn)
		hold.free()
		time.Sleep(200 * time.Millisecond)
		got, replayed, err2 := dbidem.Do(context.Background(), z.proxied, job, dbidem.TxOptions{}, fn)
		rows := z.count(`SELECT count(*) FROM gap_rows WHERE key = $1`, key)
		t.Logf("%s: canceled: %v; next: %d replayed %v %v; fn runs %d, rows %d", c.name, err, got, replayed, err2, fns, rows)
		if err == nil || err2 != nil || rows != 1 {
			t.Errorf("%s: want an error, then one row (run or replayed)", c.name)
		}
		if c.name == "commit" && (!errors.Is(err, dbidem.ErrCommitUnknown) || !replayed) {
			t.Errorf("commit: want ErrCommitUnknown and a replay")
		}
	}
}

// TestDoLeaseCanceledBetweenStatements: DoLease's context ends while the claim is out, while
// fn runs, and while the answer's idem_complete is out. The first two leave nothing to wait
// for (the claim rolled back; fn's failure yields); the third is recorded on its own context.
func TestDoLeaseCanceledBetweenStatements(t *testing.T) {
	t.Parallel()
	const lease = 3 * time.Second
	z := newGapApp(t, lease, nil)
	for _, c := range []struct{ name, trigger string }{
		{"claim", "idem_begin_steps"}, {"fn", ""}, {"complete", "idem_complete"},
	} {
		key := "dolease-cancel-" + c.name
		ctx, cancel := context.WithCancel(context.Background())
		var hold *gapRule
		if c.trigger != "" {
			hold = z.proxy.rule(c.trigger, gapHoldReply)
			hold.arm(1)
			go func() { hold.wait(t, c.name); time.Sleep(100 * time.Millisecond); cancel() }()
		}
		var keys []string
		_, _, err := dbidem.DoLease(ctx, z.proxied, gapJob(key, lease), func(fctx context.Context, cl dbidem.LeaseClaim) (int, error) {
			keys = append(keys, cl.ProviderKey)
			if c.trigger == "" {
				cancel()
				<-fctx.Done()
				return 0, context.Cause(fctx)
			}
			return 1, nil
		})
		if hold != nil {
			hold.free()
		}
		time.Sleep(200 * time.Millisecond)
		start := time.Now()
		got, replayed, err2 := dbidem.DoLease(context.Background(), z.proxied, gapJob(key, lease), func(fctx context.Context, cl dbidem.LeaseClaim) (int, error) {
			keys = append(keys, cl.ProviderKey)
			return 2, nil
		})
		t.Logf("%s: canceled: %v; next after %s: %d replayed %v %v; provider keys %v", c.name, err, time.Since(start).Round(time.Millisecond),
			got, replayed, err2, keys)
		if err2 != nil || (len(keys) == 2 && keys[0] != keys[1]) {
			t.Errorf("%s: the next run: %v; want it to run at once (or replay), under the same provider key", c.name, err2)
		}
	}
}

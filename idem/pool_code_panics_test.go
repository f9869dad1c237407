package idem_test

// The application's own pool code (a pgx QueryTracer on the pool of Options.DB, or an
// idem.Pool wrapper of its own) running on the library's own goroutines: the lease heartbeat,
// the goroutine that sends a lease answer's idem_complete (sendCommitting), the lease-route
// duplicates' poller, and under the lease slots (slotted). A panic there ended the process, or
// leaked a slot; it is taken as a failed statement now (D225).

import (
	"context"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// pcPanicTracer panics in TraceQueryStart for a statement that contains match, while armed.
// With once set it disarms itself at its first panic.
type pcPanicTracer struct {
	match  string
	armed  atomic.Bool
	once   bool
	panics atomic.Int32
}

func (t *pcPanicTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if t.armed.Load() && strings.Contains(d.SQL, t.match) {
		if t.once {
			t.armed.Store(false)
		}
		t.panics.Add(1)
		panic("the application's pgx QueryTracer panics on " + t.match)
	}
	return ctx
}

func (t *pcPanicTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func pcTracedPool(t *testing.T, url string, tr pgx.QueryTracer, maxConns int32) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = maxConns
	cfg.ConnConfig.Tracer = tr
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	// Not waited for: a connection the tracer's panic left acquired is never given back, and
	// Close would wait for it.
	t.Cleanup(func() { go pool.Close() })
	return pool
}

// pcChild runs the scenario in a child process and fails when the child dies (a panic on one
// of the library's goroutines ends the process).
func pcChild(t *testing.T, name string) {
	t.Helper()
	db := pgtest.NewDB(t)
	cmd := exec.Command(os.Args[0], "-test.run=^"+name+"$", "-test.v", "-test.count=1")
	cmd.Env = append(os.Environ(), "POOL_CODE_CHILD_DB="+db)
	out, err := cmd.CombinedOutput()
	s := string(out)
	if err != nil {
		if i := strings.Index(s, "\ngoroutine "); i > 0 {
			// Keep the panic's message and the first frames.
			s = s[:min(len(s), i+1500)]
		}
		t.Fatalf("the process serving the requests: %v\n%s", err, s)
	}
	t.Logf("child:\n%s", s)
}

func pcServeLease(t *testing.T, pool *pgxpool.Pool, rt idem.Route, opts idem.Options, h http.HandlerFunc) string {
	t.Helper()
	opts.DB = pool
	srv, _ := prServe(t, opts, rt, h)
	return srv.URL
}

// TestPoolCodeTracerPanicOnHeartbeat: a lease route whose handler outlives a third of the
// lease; the pool's QueryTracer panics on the extension (idem_extend), which the heartbeat's
// goroutine sends. The panic ended the process; it is a failed extension now, tried again at
// the next beat, and the request is answered (D225).
func TestPoolCodeTracerPanicOnHeartbeat(t *testing.T) {
	if url := os.Getenv("POOL_CODE_CHILD_DB"); url != "" {
		tr := &pcPanicTracer{match: "idem_extend"}
		tr.armed.Store(true)
		pool := pcTracedPool(t, url, tr, 8)
		srvURL := pcServeLease(t, pool, idem.Route{Required: true, Lease: time.Second}, idem.Options{},
			func(w http.ResponseWriter, r *http.Request) {
				time.Sleep(1500 * time.Millisecond)
				w.WriteHeader(201)
			})
		code, body := prSend(t, srvURL, "/things", "k-beat", `{"a":1}`)
		t.Logf("answered %d %q; tracer panics %d", code, body, tr.panics.Load())
		return
	}
	t.Parallel()
	pcChild(t, "TestPoolCodeTracerPanicOnHeartbeat")
}

// TestPoolCodeTracerPanicOnLeaseComplete: a lease route's handler answers 201 at once; the
// pool's QueryTracer panics on idem_complete, which sendCommitting sends from a goroutine of
// its own (the AnswerDeadline's context can end), where the panic ended the process; it is an
// answer whose recording's outcome is unknown now, tried again (D225).
func TestPoolCodeTracerPanicOnLeaseComplete(t *testing.T) {
	if url := os.Getenv("POOL_CODE_CHILD_DB"); url != "" {
		tr := &pcPanicTracer{match: "idem_complete", once: true}
		tr.armed.Store(true)
		pool := pcTracedPool(t, url, tr, 8)
		var runs atomic.Int32
		srvURL := pcServeLease(t, pool, idem.Route{Required: true, Lease: time.Second}, idem.Options{},
			func(w http.ResponseWriter, r *http.Request) {
				runs.Add(1)
				w.WriteHeader(201)
			})
		code, body := prSend(t, srvURL, "/things", "k-complete", `{"a":1}`)
		t.Logf("answered %d %q; tracer panics %d", code, body, tr.panics.Load())
		// The key must not stay held past its lease: a retry after it gets an answer.
		time.Sleep(1200 * time.Millisecond)
		code2, body2 := prSend(t, srvURL, "/things", "k-complete", `{"a":1}`)
		if code2 != 201 {
			t.Errorf("the retry after the lease got %d %q; want 201", code2, body2)
		}
		t.Logf("retry %d, runs %d", code2, runs.Load())
		return
	}
	t.Parallel()
	pcChild(t, "TestPoolCodeTracerPanicOnLeaseComplete")
}

// TestPoolCodeTracerPanicOnPoller: a duplicate on a lease route whose holder is "another
// process" (a second Middleware on a clean pool) waits on the key's watch; the middleware's
// poller looks at the key (idem_key) on the application's pool, whose QueryTracer panics. The
// poller is a goroutine of the middleware's own, shared by every key waited on: the panic
// ended the process; it is a failed look now, made again at the next round (D225).
func TestPoolCodeTracerPanicOnPoller(t *testing.T) {
	if url := os.Getenv("POOL_CODE_CHILD_DB"); url != "" {
		clean := pcTracedPool(t, url, &pcPanicTracer{match: "never"}, 8)
		tr := &pcPanicTracer{match: "idem_key("}
		tr.armed.Store(true)
		traced := pcTracedPool(t, url, tr, 8)
		release := make(chan struct{})
		started := make(chan struct{}, 1)
		h := func(w http.ResponseWriter, r *http.Request) {
			select {
			case started <- struct{}{}:
			default:
			}
			select {
			case <-release:
			case <-time.After(5 * time.Second):
			}
			w.WriteHeader(201)
		}
		rt := idem.Route{Required: true, Lease: 3 * time.Second}
		holderURL := pcServeLease(t, clean, rt, idem.Options{}, h)
		dupURL := pcServeLease(t, traced, rt, idem.Options{DuplicateWait: 3 * time.Second}, h)
		first := make(chan int, 1)
		go func() { c, _ := prSend(t, holderURL, "/things", "k-poll", `{"a":1}`); first <- c }()
		<-started
		dup := make(chan int, 1)
		go func() { c, _ := prSend(t, dupURL, "/things", "k-poll", `{"a":1}`); dup <- c }()
		time.Sleep(1500 * time.Millisecond) // several poll rounds
		close(release)
		t.Logf("holder %d, duplicate %d, tracer panics %d", <-first, <-dup, tr.panics.Load())
		return
	}
	t.Parallel()
	pcChild(t, "TestPoolCodeTracerPanicOnPoller")
}

// TestPoolCodeYieldPanicLeaksLeaseSlot: the lease slots (Options.MaxWaitingClaims, here 1)
// bound lease work's statements outside the claim. slotted.QueryRow takes a slot and gives it
// back when the row is scanned; when the application's pool panicked inside QueryRow (its
// QueryTracer, once, on a lease's idem_yield, on the request's goroutine, where net/http
// recovers it) the slot was never given back, and every later lease request of the process
// waited for a slot that never came: its answer was not recorded, 503 (D225).
//
// docs (Options.MaxWaitingClaims): "It also bounds the statements lease work runs outside its
// claim (extensions, the recording of answers, yields) at once" — a bound, not a leak.
func TestPoolCodeYieldPanicLeaksLeaseSlot(t *testing.T) {
	t.Parallel()
	_, url := pgtest.NewPool(t, 1)
	tr := &pcPanicTracer{match: "idem_yield", once: true}
	tr.armed.Store(true)
	// A pool of 2: one lease slot (MaxWaitingClaims, and half the pool, D229), so a leaked
	// slot shows.
	pool := pcTracedPool(t, url, tr, 2)
	srvURL := pcServeLease(t, pool, idem.Route{Required: true, Lease: time.Second},
		idem.Options{MaxWaitingClaims: 1},
		func(w http.ResponseWriter, r *http.Request) {
			if strings.Contains(r.Header.Get("Idempotency-Key"), "fail") {
				w.WriteHeader(503) // the work failed: the lease is given up (idem_yield)
				return
			}
			w.WriteHeader(201)
		})
	code1, body1 := prSend(t, srvURL, "/things", "k-fail", `{"a":1}`)
	t.Logf("the failing request: %d %q; tracer panics %d", code1, body1, tr.panics.Load())
	if tr.panics.Load() != 1 {
		t.Fatalf("the tracer panicked %d times; want once (the test did not reach idem_yield)", tr.panics.Load())
	}
	// Now an unrelated key, nothing panics any more.
	began := time.Now()
	code2, body2 := prSend(t, srvURL, "/things", "k-other", `{"a":1}`)
	took := time.Since(began)
	if code2 != 201 || took > 2*time.Second {
		t.Errorf("an unrelated lease request after the panic got %d %q in %v; want 201 at once (a lease slot leaked)", code2, body2, took)
	}
	code3, body3 := prSend(t, srvURL, "/things", "k-other", `{"a":1}`)
	if code3 != 201 {
		t.Errorf("its retry got %d %q; want a 201 replay", code3, body3)
	}
}

// pcPanickyPool is an application's own idem.Pool (a wrapper around pgxpool, as for metrics):
// its Exec panics on a statement that contains match, once.
type pcPanickyPool struct {
	*pgxpool.Pool
	match string
	armed atomic.Bool
}

func (p *pcPanickyPool) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	if strings.Contains(sql, p.match) && p.armed.CompareAndSwap(true, false) {
		panic("the application's pool wrapper panics on " + p.match)
	}
	return p.Pool.Exec(ctx, sql, args...)
}

// TestPoolCodeDoLeaseWrapperPanicOnComplete: DoLease on an application's own Pool wrapper
// whose Exec panics when DoLease records the result (idem_complete). The caller recovers
// panics of what it calls (a job runner such as River recovers a worker's panic), and
// DoLease's doc promises that fn's panic "goes on to the caller". The recording is sent from
// sendCommitting's goroutine (the caller's ctx can end), where the panic reached no caller and
// ended the process. It is an error now (the recording's outcome unknown), and the process
// survives (D225).
func TestPoolCodeDoLeaseWrapperPanicOnComplete(t *testing.T) {
	if url := os.Getenv("POOL_CODE_CHILD_DB"); url != "" {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		pool := pcTracedPool(t, url, &pcPanicTracer{match: "never"}, 4)
		wrapped := &pcPanickyPool{Pool: pool, match: "idem_complete"}
		wrapped.armed.Store(true)
		job := idem.Job{Principal: "alice", Key: "pc-dl", Action: "a", Lease: 2 * time.Second}
		var recovered any
		var err error
		func() {
			defer func() { recovered = recover() }()
			_, _, err = idem.DoLease(ctx, wrapped, job, func(ctx context.Context, c idem.LeaseClaim) (int, error) {
				return 7, nil
			})
		}()
		t.Logf("DoLease: err %v, the caller recovered %v", err, recovered)
		return
	}
	t.Parallel()
	pcChild(t, "TestPoolCodeDoLeaseWrapperPanicOnComplete")
}

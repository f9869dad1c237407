package idemhttp_test

// A review of the fault paths of lease routes left over by review_faults_test.go: a connection
// lost (a reply dropped, a backend terminated) during a lease extension (idem_extend), the
// recording of its answer (idem_complete) and the giving up of its lease (idem_yield), and a
// DBA's statement_timeout on the role or database during those.

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
	"slices"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gorilla/mux"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/internal/dbidem"
	idemhttp "github.com/pgidem/pgidem/internal/http"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// cutProxy forwards connections to target. While cuts > 0, the first chunk from a client
// that carries one of triggers takes one cut: that chunk is forwarded (the statement runs) and the
// server's replies are dropped from then on; 100 ms later the client's side is closed (the
// client loses the reply), the server's side 300 ms after that. Each cut is reported on cut.
func cutProxy(t *testing.T, target string, cuts *atomic.Int32, cut chan<- struct{}, triggers ...string) string {
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
				s, err := net.Dial("tcp", target)
				if err != nil {
					c.Close()
					return
				}
				var drop atomic.Bool
				go func() {
					buf := make([]byte, 64<<10)
					for {
						n, err := s.Read(buf)
						if n > 0 && !drop.Load() {
							if _, werr := c.Write(buf[:n]); werr != nil {
								return
							}
						}
						if err != nil {
							c.Close()
							return
						}
					}
				}()
				buf := make([]byte, 64<<10)
				var hitAt time.Time
				for {
					if !hitAt.IsZero() {
						_ = c.SetReadDeadline(hitAt.Add(100 * time.Millisecond))
					}
					n, err := c.Read(buf)
					if n > 0 {
						chunk := buf[:n]
						if hitAt.IsZero() && slices.ContainsFunc(triggers, func(tr string) bool { return bytes.Contains(chunk, []byte(tr)) }) {
							for {
								left := cuts.Load()
								if left <= 0 {
									break
								}
								if cuts.CompareAndSwap(left, left-1) {
									drop.Store(true)
									hitAt = time.Now()
									break
								}
							}
						}
						if _, werr := s.Write(chunk); werr != nil {
							break
						}
					}
					if err != nil {
						break
					}
				}
				if !hitAt.IsZero() {
					c.Close()
					select {
					case cut <- struct{}{}:
					default:
					}
					time.Sleep(300 * time.Millisecond)
				}
				s.Close()
				c.Close()
			}(c)
		}
	}()
	return l.Addr().String()
}

// cutApp is a lease route POST /work (lease as given) whose middleware reaches the database
// through cutProxy (exec mode, so that each statement's text goes by). Its handler counts its
// runs; with X-Block it signals started and waits for release or its context's end (it then
// reports the cause on causes and answers 503, as a.job does); X-Status sets its status.
type cutApp struct {
	leaseWork
	t       *testing.T
	direct  *pgxpool.Pool // the test's own look at the database
	proxied *pgxpool.Pool // the middleware's
	srv     *httptest.Server
	cuts    *atomic.Int32
	cut     chan struct{}
}

// leaseWork is the lease route's work of the fault tests (this file's and lease_gaps_test.go's):
// it counts its runs, waits for release when the request asks (X-Block), reports its context's
// cause when that ends first, and answers X-Status (202 by default) with the run's number.
type leaseWork struct {
	runs    atomic.Int32
	started chan struct{}
	release chan struct{}
	causes  chan error
}

// kept fails t if the work's context ended (after what: the fault the test made).
func (lw *leaseWork) kept(t *testing.T, what string) {
	t.Helper()
	select {
	case c := <-lw.causes:
		t.Fatalf("the handler's context ended (%v) %s", c, what)
	default:
	}
}

// answeredOnce fails t unless the first answer r was 202, the retry's r2 its replay, and the
// work ran once.
func (lw *leaseWork) answeredOnce(t *testing.T, r, r2 reply) {
	t.Helper()
	if r.status != 202 || r2.status != 202 || r2.body != r.body || r2.header.Get("Idempotent-Replayed") != "true" || lw.runs.Load() != 1 {
		t.Fatalf("first %d %s, retry %d %s (replayed %q), %d runs; want 202, its replay, one run",
			r.status, r.body, r2.status, r2.body, r2.header.Get("Idempotent-Replayed"), lw.runs.Load())
	}
}

func (lw *leaseWork) init() {
	lw.started, lw.release, lw.causes = make(chan struct{}, 10), make(chan struct{}), make(chan error, 10)
}

func (lw *leaseWork) handler() http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		n := lw.runs.Add(1)
		if r.Header.Get("X-Block") != "" {
			lw.started <- struct{}{}
			select {
			case <-lw.release:
			case <-r.Context().Done():
				lw.causes <- context.Cause(r.Context())
				http.Error(w, "stopped", http.StatusServiceUnavailable)
				return
			}
		}
		status := http.StatusAccepted
		if s := r.Header.Get("X-Status"); s != "" {
			status, _ = strconv.Atoi(s)
		}
		w.WriteHeader(status)
		fmt.Fprintf(w, `{"run":%d}`, n)
	}
}

// faultPool is a pool of the database of direct through the proxy at addr, as the fault
// tests' middleware uses it, closed with the test.
func faultPool(t *testing.T, direct *pgxpool.Pool, addr string) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(pgtest.Via(t, pgtest.URLOf(t, direct), addr))
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeExec
	cfg.MaxConns = 20
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	return pool
}

// faultMiddleware is the fault tests' middleware on db, its options changed by edit.
func faultMiddleware(t *testing.T, db *pgxpool.Pool, edit func(*idemhttp.Options)) *idemhttp.Middleware {
	t.Helper()
	o := idemhttp.Options{DB: db, LockTimeout: 5 * time.Second, DuplicateWait: 300 * time.Millisecond,
		Principal: func(r *http.Request) (string, bool) { return "alice", true },
		Logger:    slog.New(slog.NewTextHandler(io.Discard, nil)), RouteTemplate: muxTemplate}
	if edit != nil {
		edit(&o)
	}
	m, err := idemhttp.New(o)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

func newCutApp(t *testing.T, lease time.Duration, trigger string, edit func(*idemhttp.Options)) *cutApp {
	t.Helper()
	direct, _ := pgtest.NewPool(t, 20)
	z := &cutApp{t: t, direct: direct, cuts: new(atomic.Int32), cut: make(chan struct{}, 10)}
	z.init()
	z.proxied = faultPool(t, direct, cutProxy(t, pgtest.TCPAddr(t), z.cuts, z.cut, trigger))
	t.Cleanup(z.proxied.Close)
	m := faultMiddleware(t, z.proxied, edit)
	r := mux.NewRouter()
	r.Handle("/work", m.Route(idemhttp.Route{Lease: lease, Required: true})(z.handler())).Methods("POST")
	pgtest.Exec(t, direct, `CREATE TABLE step_rows (id serial PRIMARY KEY, key text)`)
	r.Handle("/steps", m.Route(idemhttp.Route{Lease: lease, Required: true})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		z.runs.Add(1)
		if r.Header.Get("X-Block") != "" {
			z.started <- struct{}{}
			<-z.release
		}
		sleep, _ := strconv.Atoi(r.Header.Get("X-Step-Sleep-MS"))
		c, _ := idemhttp.ClaimOf(r.Context())
		id, err := dbidem.Step(r.Context(), "a", func(ctx context.Context, tx pgx.Tx) (int, error) {
			var id int
			err := tx.QueryRow(ctx, `INSERT INTO step_rows (key) VALUES ($1) RETURNING id`, c.Key).Scan(&id)
			time.Sleep(time.Duration(sleep) * time.Millisecond)
			return id, err
		})
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"id":%d}`, id)
	}))).Methods("POST")
	z.srv = httptest.NewServer(r)
	t.Cleanup(func() { z.unblock(); z.srv.Close() })
	return z
}

func (z *cutApp) unblock() {
	select {
	case <-z.release:
	default:
		close(z.release)
	}
}

func (z *cutApp) post(key string, headers ...string) reply {
	z.t.Helper()
	return z.postTo("/work", key, headers...)
}

func (z *cutApp) postTo(path, key string, headers ...string) reply {
	z.t.Helper()
	status, header, body := pgtest.Send(z.t, context.Background(), "POST", z.srv.URL+path, `{}`,
		append([]string{"Idempotency-Key", key, "Content-Type", "application/json"}, headers...)...)
	return reply{status, header, body}
}

func (z *cutApp) count(sql string, args ...any) int {
	z.t.Helper()
	return pgtest.Count(z.t, z.direct, sql, args...)
}

// setOnDB sets a parameter on the database (ALTER DATABASE, as a DBA does) and drops the
// middleware's pool's connections, so that every new one has it.
func (z *cutApp) setOnDB(name, value string) {
	z.t.Helper()
	pgtest.Exec(z.t, z.direct, `DO $$ BEGIN EXECUTE format('ALTER DATABASE %I SET `+name+` = %L', current_database(), '`+value+`'); END $$`)
	z.proxied.Reset()
	z.direct.Reset()
}

// lockKey holds the key's row lock from another session until the returned func is called.
func (z *cutApp) lockKey(key string) func() {
	z.t.Helper()
	conn, err := z.direct.Acquire(context.Background())
	if err != nil {
		z.t.Fatal(err)
	}
	tx, err := conn.Begin(context.Background())
	if err != nil {
		z.t.Fatal(err)
	}
	pgtest.Exec(z.t, tx, `SET LOCAL statement_timeout = 0`)
	pgtest.Exec(z.t, tx, `SET LOCAL idle_in_transaction_session_timeout = 0`)
	if n := pgtest.Count(z.t, tx, `SELECT count(*) FROM (SELECT 1 FROM idem.idempotency_keys WHERE principal_id = 'alice' AND key = $1 FOR UPDATE) x`, key); n != 1 {
		z.t.Fatalf("the key %s: %d rows locked", key, n)
	}
	var once atomic.Bool
	return func() {
		if once.CompareAndSwap(false, true) {
			_ = tx.Commit(context.Background())
			conn.Release()
		}
	}
}

func (z *cutApp) waitCut(what string) {
	z.t.Helper()
	select {
	case <-z.cut:
	case <-time.After(10 * time.Second):
		z.t.Fatalf("the proxy cut no %s", what)
	}
}

// TestLeaseFaultsExtensionReplyLostOnceKeepsTheLease (checked, correct): the reply of one extension is
// lost (the statement ran: the lease was extended; the client's connection then closes). The
// next extension, a third of a lease later, succeeds: the handler, held past a whole lease,
// keeps its context, its answer is recorded and sent, and the retry replays it.
func TestLeaseFaultsExtensionReplyLostOnceKeepsTheLease(t *testing.T) {
	t.Parallel()
	z := newCutApp(t, 1500*time.Millisecond, "idem_extend", nil)
	z.cuts.Store(1)
	first := make(chan reply, 1)
	go func() { first <- z.post("ext-lost-once", "X-Block", "1") }()
	<-z.started
	z.waitCut("extension")
	time.Sleep(2 * time.Second) // past the lease the first extension would have given
	z.unblock()
	r := <-first
	z.kept(t, "after one lost extension reply; the lease stood")
	r2 := z.post("ext-lost-once")
	z.answeredOnce(t, r, r2)
}

// TestLeaseFaultsExtensionTerminatedKeepsTheLease (checked, correct): the backend running an extension
// is terminated (pg_terminate_backend) while the extension waits on the key's row lock, held
// by another session. The extension fails (FATAL 57P01, not a lost claim), the next one
// succeeds: the handler, held past a whole lease, keeps its context; answer, replay, one run.
func TestLeaseFaultsExtensionTerminatedKeepsTheLease(t *testing.T) {
	t.Parallel()
	// A lease of 3 s: the next extension, a third of it later, has a second to land before the
	// lease's end under CI's load (with 1.5 s, half a second once was not enough there).
	const lease = 3 * time.Second
	z := newCutApp(t, lease, "no-such-trigger", nil)
	first := make(chan reply, 1)
	go func() { first <- z.post("ext-term", "X-Block", "1") }()
	<-z.started
	unlock := z.lockKey("ext-term")
	defer unlock()
	pgtest.WaitFor(t, z.direct, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
		AND query LIKE '%idem_extend%' AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()`)
	if n := z.count(`SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = current_database()
		AND query LIKE '%idem_extend%' AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()) x`); n != 1 {
		t.Fatalf("%d extensions terminated, want 1", n)
	}
	unlock()
	time.Sleep(lease + 500*time.Millisecond)
	z.unblock()
	r := <-first
	z.kept(t, "after one terminated extension; the lease stood")
	r2 := z.post("ext-term")
	z.answeredOnce(t, r, r2)
}

// TestLeaseFaultsExtensionRepliesLostTwiceStallsTheRetry (D164): the replies of two
// extensions in a row are lost, though both landed: the database's lease stands (to a lease
// after the second), but this process's clock saw none succeed, so at its end the lease counts
// as lost and the handler's context ends with ErrLeaseLost (conservative, and documented: it
// cannot know). The handler answers 503. The middleware stored nothing and answered 409
// request_in_progress, "the attempt that took the key over answers"; but no attempt had taken
// it over, and none could: the claim stayed in progress until the database's lease ran out,
// and every retry meanwhile waited DuplicateWait and got 409 (with a lease of a minute, for up
// to a minute). An attempt whose lease is lost by its own clock only (no extension found the
// key taken over) gives the claim up now, fenced by its token (idem_yield finds nothing if
// another attempt holds the key), so the client's retry runs at once with the same provider
// key.
func TestLeaseFaultsExtensionRepliesLostTwiceStallsTheRetry(t *testing.T) {
	t.Parallel()
	const lease = 1500 * time.Millisecond
	z := newCutApp(t, lease, "idem_extend", nil)
	z.cuts.Store(2)
	first := make(chan reply, 1)
	go func() { first <- z.post("ext-lost-twice", "X-Block", "1") }()
	<-z.started
	var cause error
	select {
	case cause = <-z.causes:
	case <-time.After(5 * time.Second):
		t.Fatal("the handler's context did not end after two lost extension replies")
	}
	standing := z.count(`SELECT count(*) FROM idem.idempotency_keys WHERE key = 'ext-lost-twice' AND state = 'p'
		AND lease_expires_at > clock_timestamp()`)
	rest := z.count(`SELECT coalesce(extract(epoch FROM lease_expires_at - clock_timestamp()) * 1000, 0)::int
		FROM idem.idempotency_keys WHERE key = 'ext-lost-twice'`)
	t.Logf("the handler's context ended with %v; the database's lease stands: %d (for %d ms more)", cause, standing, rest)
	if !errors.Is(cause, idemhttp.ErrLeaseLost) {
		t.Fatalf("cause %v, want ErrLeaseLost", cause)
	}
	r := <-first
	t.Logf("the client: %d %s", r.status, r.body)
	time.Sleep(100 * time.Millisecond)
	start := time.Now()
	r2 := z.post("ext-lost-twice")
	t.Logf("the retry %s later: %d %s (Retry-After %q), %d runs", time.Since(start).Round(time.Millisecond), r2.status, r2.body,
		r2.header.Get("Retry-After"), z.runs.Load())
	if r2.status == 409 {
		t.Fatalf("the retry of a request whose lease was lost by this process's clock only (nobody took the key over): 409 %s; "+
			"want the work run at once (the lost attempt gives its claim up, fenced by its token), not 409 until the database's lease runs out (%d ms more)",
			r2.body, rest)
	}
}

// TestLeaseFaultsDoLeaseExtensionRepliesLostTwice (D164): the same for DoLease. Its lease is
// lost by this process's clock only (two extension replies lost after they landed); fn ends
// with its context and DoLease returns ErrLeaseLost. It used to give nothing up, and the next
// run of the job got ErrInProgress until the database's lease ran out; it runs fn at once now,
// with the same provider key.
func TestLeaseFaultsDoLeaseExtensionRepliesLostTwice(t *testing.T) {
	t.Parallel()
	z := newCutApp(t, 1500*time.Millisecond, "idem_extend", nil)
	z.cuts.Store(2)
	ctx := context.Background()
	job := dbidem.Job{Principal: "alice", Key: "do-ext-lost", Action: "ship", Input: 1, Lease: 1500 * time.Millisecond,
		LockTimeout: 5 * time.Second}
	var keys []string
	_, _, err := dbidem.DoLease(ctx, z.proxied, job, func(ctx context.Context, c dbidem.LeaseClaim) (int, error) {
		keys = append(keys, c.ProviderKey)
		<-ctx.Done()
		return 0, context.Cause(ctx)
	})
	if !errors.Is(err, dbidem.ErrLeaseLost) {
		t.Fatalf("the first run: %v, want ErrLeaseLost", err)
	}
	rest := z.count(`SELECT coalesce(extract(epoch FROM lease_expires_at - clock_timestamp()) * 1000, 0)::int
		FROM idem.idempotency_keys WHERE key = 'do-ext-lost' AND state = 'p'`)
	got, replayed, err := dbidem.DoLease(ctx, z.proxied, job, func(ctx context.Context, c dbidem.LeaseClaim) (int, error) {
		keys = append(keys, c.ProviderKey)
		return 7, nil
	})
	if err != nil || got != 7 || replayed || len(keys) != 2 || keys[0] != keys[1] {
		t.Fatalf("the next run: %d, replayed %v, %v, provider keys %v; want fn run at once under the same provider key "+
			"(the database's lease had %d ms more)", got, replayed, err, keys, rest)
	}
}

// TestLeaseFaultsCompleteReplyLostIsAnswered (checked, correct): the reply of the lease answer's
// idem_complete (an autocommit statement on the pool) is lost after it landed. PersistAnswer
// tries again, finds the claim completed, asks the key (read-only) and finds this attempt's
// answer: the client gets the answer (202), not 503 outcome_unknown or 409, and the retry
// replays it; one run.
func TestLeaseFaultsCompleteReplyLostIsAnswered(t *testing.T) {
	t.Parallel()
	z := newCutApp(t, 5*time.Second, "idem_complete", nil)
	z.cuts.Store(1)
	r := z.post("complete-lost")
	z.waitCut("idem_complete")
	time.Sleep(400 * time.Millisecond)
	t.Logf("the request whose idem_complete reply was lost: %d %s", r.status, r.body)
	r2 := z.post("complete-lost")
	z.answeredOnce(t, r, r2)
}

// TestLeaseFaultsYieldReplyLostConverges (checked, correct): the handler answers 500 and the reply of
// its idem_yield is lost after it landed. The client gets the handler's 500; the retry takes the
// key over at once and runs (202), its replay follows.
func TestLeaseFaultsYieldReplyLostConverges(t *testing.T) {
	t.Parallel()
	z := newCutApp(t, 5*time.Second, "idem_yield", nil)
	z.cuts.Store(1)
	r := z.post("yield-lost", "X-Status", "500")
	z.waitCut("idem_yield")
	time.Sleep(400 * time.Millisecond)
	r2 := z.post("yield-lost")
	r3 := z.post("yield-lost")
	t.Logf("first %d %s, retry %d %s, again %d %s", r.status, r.body, r2.status, r2.body, r3.status, r3.body)
	if r.status != 500 || r2.status != 202 || r3.body != r2.body || r3.header.Get("Idempotent-Replayed") != "true" || z.runs.Load() != 2 {
		t.Fatalf("first %d, retry %d %s, again %d %s (replayed %q), %d runs; want 500, a run (202), its replay; two runs",
			r.status, r2.status, r2.body, r3.status, r3.body, r3.header.Get("Idempotent-Replayed"), z.runs.Load())
	}
}

// TestLeaseFaultsStatementTimeoutDuringLeaseAnswerAndExtension (checked, correct): a DBA's
// statement_timeout of 300 ms on the database; the key's row is locked by another session for
// 1.2 s across an extension and then across the recording of the answer. The extension and
// the tries of idem_complete are cancelled (57014) and tried again: the handler keeps its
// context, the answer lands once the lock goes, the client gets it and the retry replays it.
func TestLeaseFaultsStatementTimeoutDuringLeaseAnswerAndExtension(t *testing.T) {
	t.Parallel()
	z := newCutApp(t, 3*time.Second, "no-such-trigger", nil)
	z.setOnDB("statement_timeout", "300ms")
	first := make(chan reply, 1)
	go func() { first <- z.post("st-lease", "X-Block", "1") }()
	<-z.started
	unlock := z.lockKey("st-lease") // across the extension at 1 s
	time.Sleep(1200 * time.Millisecond)
	unlock()
	unlock = z.lockKey("st-lease")
	defer unlock()
	z.unblock()
	pgtest.WaitFor(t, z.direct, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
		AND query LIKE '%idem_complete%' AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()`)
	time.Sleep(1200 * time.Millisecond) // several statement timeouts
	unlock()
	r := <-first
	z.kept(t, "")
	r2 := z.post("st-lease")
	t.Logf("first %d %s, retry %d %s", r.status, r.body, r2.status, r2.body)
	z.answeredOnce(t, r, r2)
}

// TestLeaseFaultsStatementTimeoutDuringYield (checked, correct): as above, across the idem_yield of a
// handler that answered 500: the yield lands once the lock goes; the client gets its 500 and
// the retry runs at once.
func TestLeaseFaultsStatementTimeoutDuringYield(t *testing.T) {
	t.Parallel()
	z := newCutApp(t, 3*time.Second, "no-such-trigger", nil)
	z.setOnDB("statement_timeout", "300ms")
	first := make(chan reply, 1)
	go func() { first <- z.post("st-yield", "X-Block", "1", "X-Status", "500") }()
	<-z.started
	unlock := z.lockKey("st-yield")
	defer unlock()
	z.unblock()
	pgtest.WaitFor(t, z.direct, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
		AND query LIKE '%idem_yield%' AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()`)
	time.Sleep(1200 * time.Millisecond)
	unlock()
	r := <-first
	r2 := z.post("st-yield")
	t.Logf("first %d %s, retry %d %s", r.status, r.body, r2.status, r2.body)
	if r.status != 500 || r2.status != 202 || z.runs.Load() != 2 {
		t.Fatalf("first %d %s, retry %d %s, %d runs; want 500, then a run (202)", r.status, r.body, r2.status, r2.body, z.runs.Load())
	}
}

// TestLeaseFaultsStatementTimeoutOnALeaseDuplicate (checked, correct): under a 300 ms statement_timeout,
// a duplicate of a running lease request waits (polling idem_key) and gets the answer once the
// first records it, also when the key's row is locked elsewhere for 1.2 s around the answer.
func TestLeaseFaultsStatementTimeoutOnALeaseDuplicate(t *testing.T) {
	t.Parallel()
	z := newCutApp(t, 3*time.Second, "no-such-trigger", func(o *idemhttp.Options) { o.DuplicateWait = 5 * time.Second })
	z.setOnDB("statement_timeout", "300ms")
	first := make(chan reply, 1)
	go func() { first <- z.post("st-dup", "X-Block", "1") }()
	<-z.started
	dup := make(chan reply, 1)
	go func() { dup <- z.post("st-dup") }()
	time.Sleep(500 * time.Millisecond) // the duplicate waits on the key's watch
	unlock := z.lockKey("st-dup")
	defer unlock()
	z.unblock()
	time.Sleep(1200 * time.Millisecond)
	unlock()
	r, d := <-first, <-dup
	t.Logf("first %d %s, duplicate %d %s", r.status, r.body, d.status, d.body)
	if r.status != 202 || d.status != 202 || d.body != r.body || z.runs.Load() != 1 {
		t.Fatalf("first %d %s, duplicate %d %s, %d runs; want 202 and its replay, one run", r.status, r.body, d.status, d.body, z.runs.Load())
	}
}

// TestLeaseFaultsStepCommitReplyLostConverges (checked, correct): the reply of a Step's COMMIT is lost
// after it landed (the step's row and its recovery point committed). Step fails; the handler
// answers 500, which gives the lease up; the retry is told the step, skips it (one row), and
// answers with its saved value; its replay follows.
func TestLeaseFaultsStepCommitReplyLostConverges(t *testing.T) {
	t.Parallel()
	z := newCutApp(t, 5*time.Second, "commit\x00", nil)
	first := make(chan reply, 1)
	go func() { first <- z.postTo("/steps", "step-lost", "X-Block", "1") }()
	<-z.started
	z.cuts.Store(1)
	z.unblock()
	r := <-first
	z.waitCut("step COMMIT")
	time.Sleep(400 * time.Millisecond)
	r2 := z.postTo("/steps", "step-lost")
	r3 := z.postTo("/steps", "step-lost")
	rows := z.count(`SELECT count(*) FROM step_rows WHERE key = 'step-lost'`)
	t.Logf("first %d %s, retry %d %s, again %d %s; rows %d", r.status, r.body, r2.status, r2.body, r3.status, r3.body, rows)
	if r.status < 500 || r2.status != 201 || r3.body != r2.body || r3.header.Get("Idempotent-Replayed") != "true" || rows != 1 {
		t.Fatalf("want a 5xx, then 201 with the step skipped, its replay, one row")
	}
}

// TestLeaseFaultsIdleInTransactionTimeoutInAStepConverges (checked, correct): a DBA's
// idle_in_transaction_session_timeout (300 ms) ends the session of a Step whose function
// holds its transaction idle for 700 ms: the step's row and recovery point roll back, Step
// fails, the handler answers 500 (the lease is given up), the quick retry runs the step once.
func TestLeaseFaultsIdleInTransactionTimeoutInAStepConverges(t *testing.T) {
	t.Parallel()
	z := newCutApp(t, 5*time.Second, "no-such-trigger", nil)
	z.setOnDB("idle_in_transaction_session_timeout", "300ms")
	r := z.postTo("/steps", "step-idle", "X-Step-Sleep-MS", "700")
	r2 := z.postTo("/steps", "step-idle")
	rows := z.count(`SELECT count(*) FROM step_rows WHERE key = 'step-idle'`)
	t.Logf("first %d %s, retry %d %s; rows %d", r.status, r.body, r2.status, r2.body, rows)
	if r.status < 500 || r2.status != 201 || rows != 1 {
		t.Fatalf("want a 5xx, then 201, one row")
	}
}

// TestLeaseFaultsLockTimeoutDuringLeaseAnswerAndExtension (checked, correct): a DBA's lock_timeout of
// 50 ms on the database; the key's row is locked elsewhere for 1.2 s across an extension and
// across the recording of the answer. The SQL API's functions set their own lock timeout
// (2 s), and Persist tries again: the handler keeps its context, the answer lands, the client
// gets it and the retry replays it.
func TestLeaseFaultsLockTimeoutDuringLeaseAnswerAndExtension(t *testing.T) {
	t.Parallel()
	z := newCutApp(t, 3*time.Second, "no-such-trigger", nil)
	z.setOnDB("lock_timeout", "50ms")
	first := make(chan reply, 1)
	go func() { first <- z.post("lt-lease", "X-Block", "1") }()
	<-z.started
	unlock := z.lockKey("lt-lease")
	time.Sleep(1200 * time.Millisecond)
	unlock()
	unlock = z.lockKey("lt-lease")
	defer unlock()
	z.unblock()
	pgtest.WaitFor(t, z.direct, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
		AND query LIKE '%idem_complete%' AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()`)
	time.Sleep(1200 * time.Millisecond)
	unlock()
	r := <-first
	z.kept(t, "")
	r2 := z.post("lt-lease")
	t.Logf("first %d %s, retry %d %s", r.status, r.body, r2.status, r2.body)
	z.answeredOnce(t, r, r2)
}

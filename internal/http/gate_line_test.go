package idemhttp_test

// A review of the Gate's final design (D211) through the middleware: duplicates that wait in
// one process, behind an answer, behind mismatches, and the Gate's bookkeeping after storms.

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	idemhttp "github.com/pgidem/pgidem/internal/http"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// gateEnv is one database with one "process" (a Middleware, its pool and an HTTP server).
type gateEnv struct {
	t     *testing.T
	pool  *pgxpool.Pool
	url   string
	m     *idemhttp.Middleware
	srv   *httptest.Server
	runs  atomic.Int32
	holds sync.Map // X-Hold value -> chan struct{}
	in    chan string
}

func newGateEnv(t *testing.T, edit func(*idemhttp.Options)) *gateEnv {
	t.Helper()
	pool, url := pgtest.NewPool(t, 20)
	return newGateEnvOn(t, pool, url, edit)
}

// newGateEnvOn is newGateEnv on a pool of the test's own (on the database at url).
func newGateEnvOn(t *testing.T, pool *pgxpool.Pool, url string, edit func(*idemhttp.Options)) *gateEnv {
	t.Helper()
	e := &gateEnv{t: t, pool: pool, url: url, in: make(chan string, 1000)}
	pgtest.Exec(t, pool, `CREATE TABLE effects (id serial PRIMARY KEY, amount int)`)
	o := idemhttp.Options{
		DB: pool,
		Principal: func(r *http.Request) (string, bool) {
			p := r.Header.Get("X-Principal")
			return p, p != ""
		},
		Logger:      slog.New(slog.NewTextHandler(io.Discard, nil)),
		LockTimeout: 5 * time.Second,
	}
	if edit != nil {
		edit(&o)
	}
	m, err := idemhttp.New(o)
	if err != nil {
		t.Fatal(err)
	}
	e.m = m
	mux := http.NewServeMux()
	mux.Handle("POST /tx", m.Route(idemhttp.Route{Required: true})(http.HandlerFunc(e.handle)))
	mux.Handle("POST /lease", m.Route(idemhttp.Route{Required: true, Lease: time.Minute})(http.HandlerFunc(e.handle)))
	e.srv = httptest.NewServer(mux)
	t.Cleanup(func() {
		e.holds.Range(func(k, v any) bool {
			select {
			case <-v.(chan struct{}):
			default:
				close(v.(chan struct{}))
			}
			return true
		})
		e.srv.Close()
	})
	return e
}

func (e *gateEnv) hold(name string) chan struct{} {
	c, _ := e.holds.LoadOrStore(name, make(chan struct{}))
	return c.(chan struct{})
}

func (e *gateEnv) release(name string) { close(e.hold(name)) }

// handle writes one effect (through the transaction on /tx), holds while X-Hold names a hold,
// panics on X-Panic, and answers X-Status (default 201).
func (e *gateEnv) handle(w http.ResponseWriter, r *http.Request) {
	n := e.runs.Add(1)
	_, _ = io.ReadAll(r.Body)
	id := 0
	if tx := idemhttp.Tx(r.Context()); tx != nil {
		if err := tx.QueryRow(r.Context(), `INSERT INTO effects (amount) VALUES (1) RETURNING id`).Scan(&id); err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
	} else {
		if _, err := e.pool.Exec(context.Background(), `INSERT INTO effects (amount) VALUES (1)`); err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
	}
	if name := r.Header.Get("X-Hold"); name != "" {
		e.in <- name
		select {
		case <-e.hold(name):
		case <-r.Context().Done():
			http.Error(w, "stopped", http.StatusServiceUnavailable)
			return
		}
	}
	if r.Header.Get("X-Panic") != "" {
		panic("handler panics")
	}
	status := 201
	if s := r.Header.Get("X-Status"); s != "" {
		status, _ = strconv.Atoi(s)
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	fmt.Fprintf(w, `{"id":%d,"run":%d}`, id, n)
}

type gateReply struct {
	status int
	header http.Header
	body   string
	took   time.Duration
}

func (e *gateEnv) send(ctx context.Context, path, key, body string, headers ...string) gateReply {
	start := time.Now()
	st, h, b := pgtest.Send(e.t, ctx, "POST", e.srv.URL+path, body,
		append([]string{"X-Principal", "alice", "Idempotency-Key", key, "Content-Type", "application/json"}, headers...)...)
	return gateReply{st, h, b, time.Since(start)}
}

func (e *gateEnv) waitIn(t *testing.T, name string) {
	t.Helper()
	select {
	case got := <-e.in:
		if got != name {
			t.Fatalf("handler %q started, want %q", got, name)
		}
	case <-time.After(10 * time.Second):
		t.Fatalf("handler %q never started", name)
	}
}

func untilTrue(t *testing.T, what string, d time.Duration, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(d); !cond(); {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting until %s", what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// rowLockTx locks the key's row FOR UPDATE in a transaction of its own connection ("another
// process" reading or claiming the key); the returned function ends that transaction.
func rowLockTx(t *testing.T, url, key string) (pgx.Tx, func()) {
	t.Helper()
	ctx := context.Background()
	tx, err := pgtest.Connect(t, url).Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	end := func() { once.Do(func() { _ = tx.Rollback(ctx) }) }
	t.Cleanup(end)
	if n := pgtest.Count(t, tx, `SELECT count(*) FROM (SELECT 1 FROM idem.idempotency_keys
		WHERE principal_id = 'alice' AND key = $1 FOR UPDATE) x`, key); n != 1 {
		t.Fatalf("locked %d rows of key %q", n, key)
	}
	return tx, end
}

func (e *gateEnv) gateIdle(t *testing.T) {
	t.Helper()
	var s idemhttp.GateStats
	for deadline := time.Now().Add(5 * time.Second); ; {
		s = e.m.GateStats()
		if s.Waiting == 0 && s.WaitingBytes == 0 && s.LockWaits == 0 {
			return
		}
		if time.Now().After(deadline) {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Errorf("after the storm the Gate's bookkeeping is not back to zero: %+v", s)
}

// TestGateLineBehindAnswerIsBounded: DuplicateWait (internal/http/options.go) "bounds how
// long a duplicate of a request that is still running waits for its answer, without a
// connection, before it gets 409 request_in_progress ... the answer reaches the duplicate soon
// after it is stored, even past its wait once it saw the key answered (the replays of this
// process go one at a time; D211)"; docs/http.md "Retry storms": "... unless a request ahead of
// it claims the key afresh".
//
// A storm waits behind the first request; its answer is stored and the line replays it one at
// a time. The answer's TTL then runs out (Options.TTL) while another process holds the key's
// row (a session's FOR UPDATE, standing for another process's fresh claim of the expired key).
// The duplicates still in line had seen the key answered, so their bound no longer ended their
// wait, and nobody of this process claimed the key afresh: each flight ahead waited on the row
// for a whole lock timeout (computed before its wait in Go) and was answered 409, then the
// next: the last of m waited about m lock timeouts past its DuplicateWait, for a 409 all the
// same. Now the wait in Go counts toward the lock timeout, and a flight that finds the key's
// row held elsewhere ends the wait of those behind it at their bound (D215).
func TestGateLineBehindAnswerIsBounded(t *testing.T) {
	t.Parallel()
	const wait = 600 * time.Millisecond
	e := newGateEnv(t, func(o *idemhttp.Options) {
		o.DuplicateWait = wait
		o.LockTimeout = wait
		o.TTL = 40 * time.Millisecond
	})
	ctx := context.Background()
	const key, body = "line-ttl", `{"amount":1}`
	first := make(chan gateReply, 1)
	go func() { first <- e.send(ctx, "/tx", key, body, "X-Hold", "a") }()
	e.waitIn(t, "a")
	const n = 60
	replies := make(chan gateReply, n)
	for range n {
		go func() { replies <- e.send(ctx, "/tx", key, body) }()
	}
	untilTrue(t, "the duplicates wait in Go", 5*time.Second, func() bool { return e.m.GateStats().Waiting == n })
	released := time.Now()
	e.release("a")
	if r := <-first; r.status != 201 {
		t.Fatalf("first: %d %s", r.status, r.body)
	}
	// Another process holds the key's row from now on (replays of the unexpired answer do not
	// wait on it; once the answer expired, a claim must).
	_, end := rowLockTx(t, e.url, key)
	// Every duplicate arrived before the release: by DuplicateWait plus one lock timeout after
	// the release (and a second for a loaded machine) each has its answer or its 409.
	bound := 2*wait + time.Second
	var got []gateReply
	timer := time.After(time.Until(released.Add(bound)))
collect:
	for len(got) < n {
		select {
		case r := <-replies:
			got = append(got, r)
		case <-timer:
			break collect
		}
	}
	still := n - len(got)
	stats := e.m.GateStats()
	end() // let the line go
	codes := map[int]int{}
	for _, r := range got {
		codes[r.status]++
	}
	var late []gateReply
	for len(got)+len(late) < n {
		select {
		case r := <-replies:
			late = append(late, r)
		case <-time.After(60 * time.Second):
			t.Fatal("the line did not end")
		}
	}
	t.Logf("by %s after the release: %d answered %v; %d still waiting (Gate %+v); after the row was let go they got: %d in all",
		bound, len(got), codes, still, stats, len(late))
	if still > 0 {
		t.Errorf("%d of %d duplicates (DuplicateWait %s, lock timeout %s) still had no answer %s after the first's answer was stored: "+
			"behind an answer that expired while another process held the key's row, the line goes one whole lock wait at a time, "+
			"past every duplicate's DuplicateWait", still, n, wait, wait, bound)
	}
	if n := pgtest.Count(t, e.pool, `SELECT count(*) FROM effects`); n < 1 {
		t.Errorf("effects: %d", n)
	}
	e.gateIdle(t)
}

// TestGateMismatchLineHidesAnswer: docs/http.md, "repeat, same request | the stored status,
// headers and body", and "Retry storms": "once the key has its answer, a duplicate in that line
// reads it even past its DuplicateWait". A request ahead that is a mismatch (422, another body
// under the key) reads the key's stored answer too, but its flight left "unanswered" (only a
// Replay and a transactional Claimed counted): a repeat of the answered request that arrived
// behind a line of mismatches saw no answered flight, and its bound ended its wait: 409
// request_in_progress, although nothing was in progress and the answer was stored before it
// arrived. A flight that reads a committed key (Replay, Mismatch) marks it answered as it
// decides (D215).
func TestGateMismatchLineHidesAnswer(t *testing.T) {
	t.Parallel()
	const wait = 150 * time.Millisecond
	e := newGateEnv(t, func(o *idemhttp.Options) { o.DuplicateWait = wait })
	ctx := context.Background()
	run := func(key, ahead string) (int, map[int]int) {
		const body = `{"amount":1}`
		if r := e.send(ctx, "/tx", key, body); r.status != 201 {
			t.Fatalf("first: %d %s", r.status, r.body)
		}
		const nm, nd = 300, 5
		line := make(chan gateReply, nm)
		for range nm {
			go func() { line <- e.send(ctx, "/tx", key, ahead) }()
		}
		untilTrue(t, "the line waits", 5*time.Second, func() bool { return e.m.GateStats().Waiting >= 25 })
		codes := map[int]int{}
		// The repeats come in once the line's first flight has left (its first request of the
		// line read the key): one that came in behind that first flight, which started with no
		// answer behind it, and found it slow (a loaded machine) got 409 at its bound.
		codes[(<-line).status]++
		dups := make(chan gateReply, nd)
		for range nd {
			go func() { dups <- e.send(ctx, "/tx", key, body) }()
		}
		busy := 0
		for range nd {
			d := <-dups
			if d.status == 409 {
				busy++
			} else if d.status != 201 || d.header.Get("Idempotent-Replayed") != "true" {
				t.Errorf("a repeat: %d %s", d.status, d.body)
			}
		}
		for range nm - 1 {
			codes[(<-line).status]++
		}
		return busy, codes
	}
	busyR, codesR := run("mm-replays", `{"amount":1}`)
	busyM, codesM := run("mm-mismatches", `{"amount":2}`)
	t.Logf("behind %v replays: %d of 5 repeats got 409; behind %v mismatches: %d of 5 got 409", codesR, busyR, codesM, busyM)
	if codesM[201] > 0 {
		t.Errorf("the mismatches got %v", codesM)
	}
	if busyM > 0 {
		t.Errorf("%d of 5 repeats of an answered request, behind a line of mismatches, got 409 request_in_progress "+
			"(nothing was in progress; the answer was stored before they arrived); behind a line of replays %d did", busyM, busyR)
	}
	if n := pgtest.Count(t, e.pool, `SELECT count(*) FROM effects`); n != 2 {
		t.Errorf("effects: %d, want 2", n)
	}
	e.gateIdle(t)
}

// TestGateMixedStormBookkeeping: a storm on one key mixing two bodies, clients that leave
// while they wait and a first request that panics (nothing stored): no double effect; the key
// goes to one body, every request of that body gets its one answer (or 409), every request of
// the other body 422 (or 409); and the Gate's gauges return to zero.
func TestGateMixedStormBookkeeping(t *testing.T) {
	t.Parallel()
	e := newGateEnv(t, func(o *idemhttp.Options) { o.DuplicateWait = 5 * time.Second })
	ctx := context.Background()
	const key = "mixed"
	bodies := []string{`{"amount":1}`, `{"amount":2}`}
	first := make(chan gateReply, 1)
	go func() { first <- e.send(ctx, "/tx", key, bodies[0], "X-Hold", "p", "X-Panic", "1") }()
	e.waitIn(t, "p")
	type res struct {
		which int
		r     gateReply
	}
	const n, ng = 40, 10
	out := make(chan res, n)
	gone := make(chan gateReply, ng)
	gctx, cancel := context.WithCancel(ctx)
	for i := range n {
		go func() { out <- res{i % 2, e.send(ctx, "/tx", key, bodies[i%2])} }()
	}
	for i := range ng {
		go func() { gone <- e.send(gctx, "/tx", key, bodies[i%2]) }()
	}
	untilTrue(t, "the storm waits", 5*time.Second, func() bool { return e.m.GateStats().Waiting == n+ng })
	cancel()
	for range ng {
		<-gone
	}
	e.release("p")
	if r := <-first; r.status != 500 {
		t.Errorf("the panicking first: %d %s", r.status, r.body)
	}
	codes := [2]map[int]int{{}, {}}
	answers := map[string]int{}
	fresh := 0
	timeout := time.After(30 * time.Second)
	for range n {
		select {
		case x := <-out:
			codes[x.which][x.r.status]++
			if x.r.status == 201 {
				answers[x.r.body]++
				if x.r.header.Get("Idempotent-Replayed") != "true" {
					fresh++
				}
			}
		case <-timeout:
			t.Fatalf("the storm did not end")
		}
	}
	t.Logf("body 0: %v; body 1: %v; answers %v", codes[0], codes[1], answers)
	// One run of the work, one answer: usually one of these requests ran it; a request whose
	// client had left may have won the key before its server side saw it go (the work then
	// runs to its end for the client's retry, and every request here replays it): a CI run
	// saw that once, 0 fresh runs and 20 replays of the one answer. The effects count below.
	if fresh > 1 || len(answers) != 1 {
		t.Errorf("%d fresh runs, %d different 2xx answers; want at most 1 and 1", fresh, len(answers))
	}
	for w := range 2 {
		if codes[w][201] > 0 && codes[w][422] > 0 {
			t.Errorf("body %d got both 201 and 422: %v", w, codes[w])
		}
		for c := range codes[w] {
			if c != 201 && c != 422 && c != 409 {
				t.Errorf("body %d: unexpected %d", w, c)
			}
		}
	}
	if n := pgtest.Count(t, e.pool, `SELECT count(*) FROM effects`); n != 1 {
		t.Errorf("effects committed: %d, want 1", n)
	}
	e.gateIdle(t)
}

// TestGateBytesFullThenRecovers: MaxWaitingBytes "A duplicate that would pass it gets 409
// request_in_progress with Retry-After at once"; once the storm is over the bound is free again
// (a second storm waits as the first did), and WaitingBytes is back to zero.
func TestGateBytesFullThenRecovers(t *testing.T) {
	t.Parallel()
	pad := make([]byte, 12<<10)
	for i := range pad {
		pad[i] = 'x'
	}
	body := fmt.Sprintf(`{"amount":1,"pad":%q}`, string(pad))
	per := int64(len(body)) + 4<<10
	e := newGateEnv(t, func(o *idemhttp.Options) { o.MaxWaitingBytes = 3 * per; o.DuplicateWait = 10 * time.Second })
	ctx := context.Background()
	for round := range 2 {
		key := fmt.Sprintf("bytes-%d", round)
		hold := fmt.Sprintf("h%d", round)
		first := make(chan gateReply, 1)
		go func() { first <- e.send(ctx, "/tx", key, body, "X-Hold", hold) }()
		e.waitIn(t, hold)
		waiting := make(chan gateReply, 3)
		for range 3 {
			go func() { waiting <- e.send(ctx, "/tx", key, body) }()
		}
		untilTrue(t, "three wait", 5*time.Second, func() bool { return e.m.GateStats().Waiting == 3 })
		r := e.send(ctx, "/tx", key, body)
		if r.status != 409 || r.header.Get("Retry-After") == "" || r.took > time.Second {
			t.Errorf("round %d: the fourth duplicate past MaxWaitingBytes: %d (Retry-After %q) after %s; want 409 with Retry-After at once",
				round, r.status, r.header.Get("Retry-After"), r.took)
		}
		e.release(hold)
		if r := <-first; r.status != 201 {
			t.Errorf("round %d first: %d", round, r.status)
		}
		for range 3 {
			if r := <-waiting; r.status != 201 || r.header.Get("Idempotent-Replayed") != "true" {
				t.Errorf("round %d: a waiting duplicate got %d %s", round, r.status, r.body)
			}
		}
		e.gateIdle(t)
	}
	if n := pgtest.Count(t, e.pool, `SELECT count(*) FROM effects`); n != 2 {
		t.Errorf("effects: %d, want 2", n)
	}
}

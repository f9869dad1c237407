package idem_test

// A review of Middleware.Shutdown and Cleaner.Stop (graceful shutdown, process lifecycle).
// Gaps are held open with channels and real locks.

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

type shutdownResult struct {
	status int
	header http.Header
	body   string
}

func shutdownSend(t *testing.T, url, body, key string) chan shutdownResult {
	out := make(chan shutdownResult, 1)
	go func() {
		st, h, b := pgtest.Send(t, context.Background(), "POST", url, body, "Idempotency-Key", key)
		out <- shutdownResult{st, h, b}
	}()
	return out
}

func shutdownWait(t *testing.T, c <-chan struct{}, what string) {
	t.Helper()
	select {
	case <-c:
	case <-time.After(10 * time.Second):
		t.Fatalf("timed out waiting for %s", what)
	}
}

// TestShutdownWaitsForAKeyedRequestInTheMiddleware: a keyed request that the middleware has
// already received (it is reading its body, or computing its fingerprint) was not counted by
// Shutdown: Shutdown returned nil ("nothing in flight") at once, and the request then claimed
// its key and ran its handler after Shutdown returned (D160). It is counted from the key check
// now. The gap is held open by a Route.Fingerprint that blocks. The request gets its answer:
// Shutdown's drain ends only waits on another holder, not a fresh claim (D161).
func TestShutdownWaitsForAKeyedRequestInTheMiddleware(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	m, err := idem.New(ctx, idem.Options{DB: pool, Principal: alice})
	if err != nil {
		t.Fatal(err)
	}
	fpIn, fpGo := make(chan struct{}), make(chan struct{})
	hIn, hGo := make(chan struct{}), make(chan struct{})
	var cause atomic.Value
	route := idem.Route{Action: "POST /t", Fingerprint: func(r *http.Request, body []byte) idem.Fingerprint {
		close(fpIn)
		<-fpGo
		return idem.ComputeFingerprint(r.Method, r.URL.EscapedPath(), body)
	}}
	srv := httptest.NewServer(m.Route(route)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		close(hIn)
		select {
		case <-hGo:
		case <-r.Context().Done():
			cause.Store(context.Cause(r.Context()))
			w.WriteHeader(500)
			return
		}
		w.WriteHeader(201)
	})))
	defer srv.Close()

	res := shutdownSend(t, srv.URL, `{"a":1}`, "k1")
	shutdownWait(t, fpIn, "the request to reach its fingerprint")

	sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	done := make(chan error, 1)
	start := time.Now()
	go func() { done <- m.Shutdown(sctx) }()
	var early bool
	var serr error
	select {
	case serr = <-done:
		early = true
	case <-time.After(500 * time.Millisecond):
	}
	took := time.Since(start)
	close(fpGo)
	ran := false
	select {
	case <-hIn:
		ran = true
		if early {
			cancel() // the usual caller: Shutdown returned, so its deadline's context is cancelled
		}
		close(hGo)
	case <-time.After(3 * time.Second):
	}
	r := <-res
	if !early {
		if err := <-done; err != nil {
			t.Fatalf("Shutdown: %v", err)
		}
		if r.status != 201 {
			t.Fatalf("Shutdown waited, but the request got %d %s, want 201", r.status, r.body)
		}
		return
	}
	c, _ := cause.Load().(error)
	t.Fatalf("Shutdown returned %v after %v while a keyed request it had received was still in the middleware "+
		"(not yet counted); handler ran after Shutdown returned: %v (its context's cause: %v); the client got %d %s",
		serr, took.Round(time.Millisecond), ran, c, r.status, strings.TrimSpace(r.body))
}

// TestLeaseHandlerThatStopsOnShutdownIsGivenUp: a lease route's handler that reacts to
// ErrShutdown the way the docs say a handler reacts to a lost lease (it returns without
// writing anything) had an empty 200 stored as the key's answer, and the retry (on another
// process) replayed it for work that never happened (D160). The lease is given up now, the
// client told 503 shutting_down, and the retry runs the work under the same provider key.
func TestLeaseHandlerThatStopsOnShutdownIsGivenUp(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 6)
	m, err := idem.New(ctx, idem.Options{DB: pool, Principal: alice})
	if err != nil {
		t.Fatal(err)
	}
	m2, err := idem.New(ctx, idem.Options{DB: pool, Principal: alice}) // the next process
	if err != nil {
		t.Fatal(err)
	}
	var runs atomic.Int32
	var providerKeys sync.Map
	hIn := make(chan struct{}, 2)
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := runs.Add(1)
		ci, _ := idem.ClaimOf(r.Context())
		providerKeys.Store(n, ci.ProviderKey)
		if n > 1 {
			w.WriteHeader(201)
			_, _ = w.Write([]byte(`{"paid":true}`))
			return
		}
		hIn <- struct{}{}
		<-r.Context().Done() // gives up: writes nothing
	})
	route := idem.Route{Action: "POST /pay", Lease: 5 * time.Second}
	srv := httptest.NewServer(m.Route(route)(h))
	defer srv.Close()
	srv2 := httptest.NewServer(m2.Route(route)(h))
	defer srv2.Close()

	res := shutdownSend(t, srv.URL, `{"p":1}`, "L1")
	select {
	case <-hIn:
	case <-time.After(10 * time.Second):
		t.Fatal("no handler")
	}
	sctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel()
	serr := m.Shutdown(sctx)
	first := <-res
	if !errors.Is(serr, context.DeadlineExceeded) {
		t.Errorf("Shutdown: %v, want DeadlineExceeded", serr)
	}
	// The client's retry, against another process.
	st, _, body := pgtest.Send(t, ctx, "POST", srv2.URL, `{"p":1}`, "Idempotency-Key", "L1")
	if first.status != 503 || !strings.Contains(first.body, idem.CodeShuttingDown) {
		t.Errorf("the first attempt's client got %d %s, want 503 %s", first.status, first.body, idem.CodeShuttingDown)
	}
	p1, _ := providerKeys.Load(int32(1))
	p2, _ := providerKeys.Load(int32(2))
	if p1 == nil || p1 != p2 {
		t.Errorf("provider keys: first attempt %v, retry %v; want the same", p1, p2)
	}
	if runs.Load() != 2 || st != 201 {
		t.Fatalf("the first attempt's handler stopped on ErrShutdown without writing; its client got %d %q; "+
			"the retry on another process got %d %q with %d run(s) of the handler: want the lease given up and "+
			"the work run again (201), not an empty 200 stored as the answer",
			first.status, first.body, st, body, runs.Load())
	}
}

// Checked correct: a transactional handler that ignores its context and runs past the five
// extra seconds: Shutdown returns ctx's error after the grace, and the unit of work, returning
// 201 later, rolls back: nothing is stored (neither its write nor the key's answer).
func TestTxHandlerPastTheGraceStoresNothing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	pgtest.Exec(t, pool, `CREATE TABLE shutdown_effects (id int)`)
	m, err := idem.New(ctx, idem.Options{DB: pool, Principal: alice})
	if err != nil {
		t.Fatal(err)
	}
	hIn, hGo := make(chan struct{}), make(chan struct{})
	srv := httptest.NewServer(m.Route(idem.Route{Action: "POST /t"})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if _, err := idem.TxFrom(r.Context()).Exec(r.Context(), `INSERT INTO shutdown_effects VALUES (1)`); err != nil {
			t.Errorf("insert: %v", err)
		}
		close(hIn)
		<-hGo // ignores its context
		w.WriteHeader(201)
	})))
	defer srv.Close()
	res := shutdownSend(t, srv.URL, `{"a":1}`, "T1")
	shutdownWait(t, hIn, "the handler")
	sctx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	defer cancel()
	start := time.Now()
	serr := m.Shutdown(sctx)
	took := time.Since(start)
	if !errors.Is(serr, context.DeadlineExceeded) || took < 5*time.Second || took > 7*time.Second {
		t.Errorf("Shutdown: %v after %v, want DeadlineExceeded after about 5.1s", serr, took)
	}
	// A keyed request after Shutdown returned early: 503 shutting_down, before any claim.
	st, hdr, body := pgtest.Send(t, ctx, "POST", srv.URL, `{"a":2}`, "Idempotency-Key", "T2")
	if st != 503 || !strings.Contains(body, idem.CodeShuttingDown) || hdr.Get("Retry-After") != "1" {
		t.Errorf("a keyed request after Shutdown: %d %s", st, body)
	}
	close(hGo)
	r := <-res
	time.Sleep(200 * time.Millisecond)
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM shutdown_effects`); n != 0 {
		t.Errorf("the effect was committed after Shutdown: %d rows; client got %d %s", n, r.status, r.body)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem.idempotency_keys WHERE key IN ('T1','T2')`); n != 0 {
		t.Errorf("%d keys stored; client got %d %s", n, r.status, r.body)
	}
	t.Logf("first client got %d %s", r.status, strings.TrimSpace(r.body))
}

// Checked correct: a duplicate waiting for the first request's answer gets 409 as soon as
// Shutdown starts; Shutdown waits for the first; two concurrent Shutdowns both return nil;
// after they returned (ctx alive) ... and after ctx ends, keyed requests get 503, unkeyed ones run.
func TestShutdownDrainsDuplicatesAndWaits(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	m, err := idem.New(ctx, idem.Options{DB: pool, Principal: alice})
	if err != nil {
		t.Fatal(err)
	}
	// Shutdown before any request, on a fresh middleware: nil at once.
	m0, _ := idem.New(ctx, idem.Options{DB: pool, Principal: alice})
	if err := m0.Shutdown(ctx); err != nil {
		t.Errorf("Shutdown with nothing in flight: %v", err)
	}
	hIn, hGo := make(chan struct{}, 4), make(chan struct{})
	var runs atomic.Int32
	srv := httptest.NewServer(m.Route(idem.Route{Action: "POST /t"})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		hIn <- struct{}{}
		<-hGo
		w.WriteHeader(201)
	})))
	defer srv.Close()
	first := shutdownSend(t, srv.URL, `{"a":1}`, "D1")
	<-hIn
	dup := shutdownSend(t, srv.URL, `{"a":1}`, "D1")
	// Shutdown starts once the duplicate waits in Go (not after a fixed pause: on a loaded
	// machine its request may reach the middleware after Shutdown began, and be refused 503).
	for deadline := time.Now().Add(10 * time.Second); m.GateStats().Waiting < 1; time.Sleep(2 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the duplicate never waited in Go for the first request")
		}
	}
	sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	done := make(chan error, 2)
	go func() { done <- m.Shutdown(sctx) }()
	go func() { done <- m.Shutdown(sctx) }()
	select {
	case d := <-dup:
		if d.status != 409 || !strings.Contains(d.body, idem.CodeInProgress) {
			t.Errorf("duplicate: %d %s", d.status, d.body)
		}
	case <-time.After(2 * time.Second):
		t.Error("the duplicate did not stop waiting when Shutdown started")
	}
	select {
	case err := <-done:
		t.Fatalf("Shutdown returned %v while the first request ran", err)
	case <-time.After(300 * time.Millisecond):
	}
	close(hGo)
	if f := <-first; f.status != 201 {
		t.Errorf("first: %d %s", f.status, f.body)
	}
	for range 2 {
		if err := <-done; err != nil {
			t.Errorf("Shutdown: %v", err)
		}
	}
	cancel()
	st, _, body := pgtest.Send(t, ctx, "POST", srv.URL, `{"a":3}`, "Idempotency-Key", "D3")
	if st != 503 || !strings.Contains(body, idem.CodeShuttingDown) {
		t.Errorf("keyed request after ctx ended: %d %s", st, body)
	}
	hIn2 := len(hIn)
	st, _, _ = pgtest.Send(t, ctx, "POST", srv.URL, `{"a":4}`)
	if st != 201 {
		t.Errorf("an unkeyed request after Shutdown: %d (runs %d, hIn %d)", st, runs.Load(), hIn2)
	}
}

// Checked: Cleaner.Stop while a pass waits (CleanerOptions.Wait) on the cleanup lock held by
// another session: Stop returns promptly, and the batch does not delete after the lock is
// released.
func TestCleanerStopDuringAPass(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	pgtest.InsertExpired(t, pool, "old", 50)
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock($1)`, idem.CleanupLock); err != nil {
		t.Fatal(err)
	}
	c, err := idem.StartCleaner(ctx, pool, idem.CleanerOptions{Interval: 10 * time.Millisecond, Wait: true, Duty: 1})
	if err != nil {
		t.Fatal(err)
	}
	pgtest.WaitFor(t, pool, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE '%idem_cleanup%'`)
	start := time.Now()
	c.Stop()
	took := time.Since(start)
	if took > 2*time.Second {
		t.Errorf("Stop took %v", took)
	}
	c.Stop() // twice
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond)
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem.idempotency_keys`); n != 50 {
		t.Logf("after Stop and the lock's release: %d keys left (the doc allows a late delete)", n)
	}
	t.Logf("Stop took %v", took)
}

// TestShutdownServesFreshKeysWhileItWaits: while Shutdown waits for a request in flight (its
// context still live), requests with fresh keys are served. Shutdown's drain used to cancel the
// claim statement of every keyed request, not only of duplicates waiting on another holder, so
// a fresh key whose claim was under way got a false 409 request_in_progress (8 of 20 in one
// run; D160, D161). The gap is held open by a trigger that makes one fresh claim's INSERT
// sleep while Shutdown starts. Only waits on another holder end with the drain now: a
// duplicate of the held request still gets 409 at once.
func TestShutdownServesFreshKeysWhileItWaits(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 24)
	pgtest.Exec(t, pool, `CREATE FUNCTION public.slow_claim() RETURNS trigger LANGUAGE plpgsql AS
		$$BEGIN PERFORM pg_sleep(1); RETURN NEW; END$$`)
	pgtest.Exec(t, pool, `CREATE TRIGGER slow_claim BEFORE INSERT ON idem.idempotency_keys
		FOR EACH ROW WHEN (NEW.key = 'slow') EXECUTE FUNCTION public.slow_claim()`)
	m, err := idem.New(ctx, idem.Options{DB: pool, Principal: alice})
	if err != nil {
		t.Fatal(err)
	}
	hIn, hGo := make(chan struct{}), make(chan struct{})
	var runs atomic.Int32
	srv := httptest.NewServer(m.Route(idem.Route{Action: "POST /t"})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		if r.Header.Get("Idempotency-Key") == "held" {
			close(hIn)
			<-hGo
		}
		w.WriteHeader(201)
	})))
	defer srv.Close()
	held := shutdownSend(t, srv.URL, `{"a":1}`, "held")
	shutdownWait(t, hIn, "the held request's handler")
	slow := shutdownSend(t, srv.URL, `{"a":1}`, "slow")
	pgtest.WaitFor(t, pool, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event = 'PgSleep'`)
	sctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- m.Shutdown(sctx) }()
	if r := <-slow; r.status != 201 {
		t.Errorf("a fresh key whose claim was under way when Shutdown started: %d %s, want 201", r.status, strings.TrimSpace(r.body))
	}
	if d := <-shutdownSend(t, srv.URL, `{"a":1}`, "held"); d.status != 409 || !strings.Contains(d.body, idem.CodeInProgress) {
		t.Errorf("a duplicate of the held request during the drain: %d %s, want 409 %s", d.status, d.body, idem.CodeInProgress)
	}
	const n = 20
	var replies []chan shutdownResult
	for i := range n {
		replies = append(replies, shutdownSend(t, srv.URL, `{"a":1}`, "fresh-"+string(rune('a'+i))))
	}
	var refused []string
	for i, c := range replies {
		if r := <-c; r.status != 201 {
			refused = append(refused, string(rune('a'+i))+": "+strings.TrimSpace(r.body))
		}
	}
	if len(refused) > 0 {
		t.Errorf("%d of %d fresh keys sent while Shutdown waited were not served: %v", len(refused), n, refused)
	}
	select {
	case err := <-done:
		t.Fatalf("Shutdown returned %v while the held request ran", err)
	default:
	}
	close(hGo)
	if r := <-held; r.status != 201 {
		t.Errorf("the held request: %d %s", r.status, r.body)
	}
	if err := <-done; err != nil {
		t.Errorf("Shutdown: %v", err)
	}
	if got := runs.Load(); got != n+2 {
		t.Errorf("%d handler runs, want %d", got, n+2)
	}
}

package idemhttp_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2"
	"github.com/gorilla/mux"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"

	idemhttp "github.com/pgidem/pgidem/internal/http"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// provider is a payment provider outside the database: it deduplicates by its own idempotency
// key (the first call with a key creates a payout and takes as long as the work takes; a
// later call with the key answers that payout at once) and counts the calls it received.
type provider struct {
	mu      sync.Mutex
	calls   map[string]int
	payouts map[string]int
}

func newProvider() *provider { return &provider{calls: map[string]int{}, payouts: map[string]int{}} }

func (p *provider) pay(ctx context.Context, key string, work time.Duration) (int, error) {
	p.mu.Lock()
	p.calls[key]++
	id, known := p.payouts[key]
	if !known {
		id = len(p.payouts) + 1
		p.payouts[key] = id
	}
	p.mu.Unlock()
	if known {
		return id, nil
	}
	select {
	case <-time.After(work):
		return id, nil
	case <-ctx.Done():
		return 0, context.Cause(ctx)
	}
}

func (p *provider) counts() (calls, keys, payouts int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, n := range p.calls {
		calls += n
	}
	return calls, len(p.calls), len(p.payouts)
}

// payouts is a lease route (a one-second lease) whose handler calls the provider with the
// claim's provider key, for as long as the body's work_ms says.
type payouts struct {
	t    *testing.T
	srv  *httptest.Server
	obs  *observer
	runs atomic.Int32
	// causes receives, for every handler run that did not finish its work, its context's cause.
	causes chan error
	// finished receives, for every handler run that finished its work, its context's error.
	finished chan error
}

// servePayouts serves the payouts route; its duplicates wait 0.4 s for an answer
// (Options.DuplicateWait), so that the tests of the lease itself see their 409s.
func servePayouts(t *testing.T, pool *pgxpool.Pool, prov *provider) *payouts {
	return servePayoutsWith(t, pool, prov, func(o *idemhttp.Options) { o.DuplicateWait = 400 * time.Millisecond })
}

// servePayoutsWith is servePayouts with its options edited by edit.
func servePayoutsWith(t *testing.T, pool *pgxpool.Pool, prov *provider, edit func(*idemhttp.Options)) *payouts {
	t.Helper()
	return servePayoutsLease(t, pool, prov, time.Second, edit)
}

// servePayoutsLease is servePayoutsWith with a route lease of its own.
func servePayoutsLease(t *testing.T, pool *pgxpool.Pool, prov *provider, lease time.Duration, edit func(*idemhttp.Options)) *payouts {
	t.Helper()
	p := &payouts{t: t, obs: newObserver(), causes: make(chan error, 10), finished: make(chan error, 10)}
	o := idemhttp.Options{DB: pool, LockTimeout: 300 * time.Millisecond,
		Principal: func(r *http.Request) (string, bool) { return "alice", true },
		Logger:    slog.New(slog.NewTextHandler(io.Discard, nil)),
		Metrics:   p.obs, RouteTemplate: muxTemplate}
	if edit != nil {
		edit(&o)
	}
	m, err := idemhttp.New(o)
	if err != nil {
		t.Fatal(err)
	}
	r := mux.NewRouter()
	r.Handle("/payouts", m.Route(idemhttp.Route{Lease: lease, Required: true})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p.runs.Add(1)
		var in struct {
			WorkMS int `json:"work_ms"`
		}
		if !idemhttp.DecodeJSON(w, r, &in) {
			return
		}
		c, _ := idemhttp.ClaimOf(r.Context())
		id, err := prov.pay(r.Context(), c.ProviderKey, time.Duration(in.WorkMS)*time.Millisecond)
		if err != nil {
			p.causes <- context.Cause(r.Context())
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		p.finished <- r.Context().Err()
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"payout":%d,"attempt":%d}`, id, c.Attempt)
	}))).Methods("POST")
	p.srv = httptest.NewServer(r)
	t.Cleanup(p.srv.Close)
	return p
}

func (p *payouts) post(ctx context.Context, key string, workMS int) reply {
	p.t.Helper()
	status, header, body := pgtest.Send(p.t, ctx, "POST", p.srv.URL+"/payouts", fmt.Sprintf(`{"work_ms":%d}`, workMS),
		"Idempotency-Key", key, "Content-Type", "application/json")
	return reply{status, header, body}
}

// TestLeaseOutlastsTheWork: work that takes three times its lease, with a duplicate every half
// second the whole time (each waits 0.4 s for the answer). The heartbeat keeps the lease: every
// duplicate gets 409 with Retry-After until the work is done, and the recorded answer after; the work and the
// provider call happen once. (Without the heartbeat, the duplicate after the lease's end took
// the key over and paid again.) The lease is 2 s: each extension may take a third of it, and
// under the race detector on a loaded 2-core CI machine 333 ms (a 1 s lease) was once not
// enough for two in a row.
func TestLeaseOutlastsTheWork(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 10)
	prov := newProvider()
	p := servePayoutsLease(t, pool, prov, 2*time.Second, func(o *idemhttp.Options) { o.DuplicateWait = 400 * time.Millisecond })
	first := make(chan reply, 1)
	go func() { first <- p.post(context.Background(), "long", 6000) }()
	var answer reply
	dups := 0
wait:
	for {
		select {
		case answer = <-first:
			break wait
		case <-time.After(500 * time.Millisecond):
		}
		if p.runs.Load() == 0 {
			continue
		}
		dups++
		r := p.post(context.Background(), "long", 6000)
		if r.status == http.StatusCreated && r.header.Get("Idempotent-Replayed") == "true" {
			// The work ended between this duplicate's send and the first's answer reaching
			// the test: the duplicate got the recorded answer, which must be the first's.
			answer = <-first
			if r.body != answer.body {
				t.Fatalf("duplicate %d, right after the work: %s, want the replay of %s", dups, r.body, answer.body)
			}
			break wait
		}
		if r.status != http.StatusConflict || r.header.Get("Retry-After") == "" || problemCode(t, r) != idemhttp.CodeInProgress {
			t.Fatalf("duplicate %d during the work: %+v, want 409 request_in_progress with Retry-After", dups, r)
		}
	}
	if answer.status != http.StatusCreated || dups < 3 {
		t.Fatalf("the work: %+v after %d duplicates", answer, dups)
	}
	again := p.post(context.Background(), "long", 6000)
	if again.status != http.StatusCreated || again.body != answer.body || again.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("after the work: %+v, want the replay of %s", again, answer.body)
	}
	if calls, _, payouts := prov.counts(); calls != 1 || payouts != 1 || p.runs.Load() != 1 {
		t.Fatalf("%d provider calls, %d payouts, %d runs; want one of each", calls, payouts, p.runs.Load())
	}
	if n, _ := p.obs.leases(); n < 6 {
		t.Fatalf("%v lease extensions in 6 s of a 2 s lease, want about 9", n)
	}
}

// TestLeaseWorkOutlivesTheClient: the client goes away while the work runs. The work is not
// cancelled, its answer is recorded, and the client's retry replays it: one provider call.
func TestLeaseWorkOutlivesTheClient(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 10)
	prov := newProvider()
	p := servePayoutsLease(t, pool, prov, 2*time.Second, func(o *idemhttp.Options) { o.DuplicateWait = 400 * time.Millisecond })
	// The client leaves once the work runs (a fixed deadline could end it before the claim,
	// on a loaded machine, and then no work would ever start).
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		for p.runs.Load() == 0 && ctx.Err() == nil {
			time.Sleep(5 * time.Millisecond)
		}
		time.Sleep(100 * time.Millisecond)
		cancel()
	}()
	if r := p.post(ctx, "gone", 2500); r.status != -1 {
		t.Fatalf("the client that went away got %+v", r)
	}
	select {
	case err := <-p.finished:
		if err != nil {
			t.Fatalf("the work's context ended when the client left: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the work never finished")
	}
	pgtest.WaitFor(t, pool, `SELECT count(*) FROM idem.idempotency_keys WHERE key = 'gone' AND state = 'c'`)
	r := p.post(context.Background(), "gone", 2500)
	if r.status != http.StatusCreated || r.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("the retry: %+v, want the recorded answer", r)
	}
	if calls, _, _ := prov.counts(); calls != 1 || p.runs.Load() != 1 {
		t.Fatalf("%d provider calls, %d runs; want 1 and 1", calls, p.runs.Load())
	}
}

// TestLeaseAnswerRecordedPastTheLeasesEnd: the key's row is locked from the work's start (no
// extension lands) until 1.3 s after the work ended, past the 2 s lease's end by the server's
// clock. Nothing took the key over, so the answer, fenced by the attempt, is still recorded and
// sent: the client gets 201 and its retry the replay. (Before D143 the recording stopped at the
// lease's end and the client got 503 outcome_unknown.)
func TestLeaseAnswerRecordedPastTheLeasesEnd(t *testing.T) {
	t.Parallel()
	pool, url := pgtest.NewPool(t, 10)
	prov := newProvider()
	p := servePayoutsLease(t, pool, prov, 2*time.Second, func(o *idemhttp.Options) { o.DuplicateWait = 400 * time.Millisecond })
	locker := pgtest.Connect(t, url)
	released := make(chan time.Time, 1)
	lockErr := make(chan error, 1)
	go func() {
		for p.runs.Load() == 0 {
			time.Sleep(time.Millisecond)
		}
		ctx := context.Background()
		tx, err := locker.Begin(ctx)
		if err == nil {
			_, err = tx.Exec(ctx, `SELECT 1 FROM idem.idempotency_keys WHERE key = 'late' FOR UPDATE`)
		}
		if err != nil {
			lockErr <- err
			return
		}
		lockErr <- nil
		<-p.finished
		time.Sleep(1300 * time.Millisecond)
		at := time.Now()
		if err := tx.Rollback(ctx); err != nil {
			t.Error(err)
		}
		released <- at
	}()
	began := time.Now()
	r := p.post(context.Background(), "late", 1000)
	if err := <-lockErr; err != nil {
		t.Fatal(err)
	}
	if n, _ := p.obs.leases(); n != 0 {
		t.Fatalf("%v extensions landed while the key's row was locked; the lease's end did not pass", n)
	}
	if at := <-released; at.Sub(began) < 2*time.Second {
		t.Fatalf("the row was released %v after the claim, before the lease's end", at.Sub(began))
	}
	if r.status != http.StatusCreated || r.header.Get("Idempotent-Replayed") != "" {
		t.Fatalf("the client: %+v, want the answer, recorded past the lease's end", r)
	}
	again := p.post(context.Background(), "late", 1000)
	if again.status != http.StatusCreated || again.body != r.body || again.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("the retry: %+v, want the replay of %s", again, r.body)
	}
	if calls, _, _ := prov.counts(); calls != 1 || p.runs.Load() != 1 {
		t.Fatalf("%d provider calls, %d runs; want 1 and 1", calls, p.runs.Load())
	}
}

// TestLeaseLostToATakeover: the first attempt's heartbeat cannot reach the database (a stall
// between its server and PostgreSQL) for longer than the lease. A duplicate at another server
// takes the key over; the first attempt's context ends with the lease-lost cause, its client
// gets 409 (not an answer that was never recorded), and the provider sees one key for both
// attempts and pays once. The client's retry gets the second attempt's answer.
func TestLeaseLostToATakeover(t *testing.T) {
	t.Parallel()
	direct, url := pgtest.NewPool(t, 10)
	proxy := toxiproxy.NewProxy(toxiproxy.NewServer(toxiproxy.NewMetricsContainer(prometheus.NewRegistry()), zerolog.Nop()),
		"postgres-"+t.Name(), "127.0.0.1:0", pgtest.TCPAddr(t))
	if err := proxy.Start(); err != nil {
		t.Fatal(err)
	}
	defer proxy.Stop()
	cfg, err := pgxpool.ParseConfig(pgtest.Via(t, url, proxy.Listen))
	if err != nil {
		t.Fatal(err)
	}
	stalled, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer stalled.Close()
	prov := newProvider()
	a, b := servePayouts(t, stalled, prov), servePayouts(t, direct, prov)

	first := make(chan reply, 1)
	go func() { first <- a.post(context.Background(), "taken", 6000) }()
	pgtest.WaitFor(t, direct, `SELECT count(*) FROM idem.idempotency_keys WHERE key = 'taken'`)
	for a.runs.Load() == 0 {
		time.Sleep(5 * time.Millisecond)
	}
	for _, stream := range []string{"upstream", "downstream"} {
		if _, err := proxy.Toxics.AddToxicJson(strings.NewReader(
			`{"name":"stall-` + stream + `","type":"timeout","stream":"` + stream + `","toxicity":1,"attributes":{"timeout":0}}`)); err != nil {
			t.Fatal(err)
		}
	}
	// The lease runs out at most a second after its last extension; the duplicate takes over.
	var second reply
	for deadline := time.Now().Add(5 * time.Second); ; {
		second = b.post(context.Background(), "taken", 6000)
		if second.status != http.StatusConflict || time.Now().After(deadline) {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if second.status != http.StatusCreated {
		t.Fatalf("the takeover: %+v", second)
	}
	select {
	case cause := <-a.causes:
		if !errors.Is(cause, idemhttp.ErrLeaseLost) {
			t.Fatalf("the first attempt's context ended with %v, want ErrLeaseLost", cause)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the first attempt's work was not stopped")
	}
	for _, stream := range []string{"upstream", "downstream"} {
		_ = proxy.Toxics.RemoveToxic(context.Background(), "stall-"+stream)
	}
	if r := <-first; r.status != http.StatusConflict || problemCode(t, r) != idemhttp.CodeInProgress {
		t.Fatalf("the first attempt's client got %+v, want 409 request_in_progress", r)
	}
	if again := b.post(context.Background(), "taken", 6000); again.status != http.StatusCreated || again.body != second.body {
		t.Fatalf("the retry: %+v, want the takeover's answer %s", again, second.body)
	}
	var ans struct{ Payout int }
	_ = json.Unmarshal([]byte(second.body), &ans)
	if calls, keys, payouts := prov.counts(); keys != 1 || payouts != 1 || calls != 2 || ans.Payout != 1 {
		t.Fatalf("the provider saw %d calls under %d keys and made %d payouts (answer %s); want 2 calls, 1 key, 1 payout",
			calls, keys, payouts, second.body)
	}
	if _, n := a.obs.leases(); n != 1 {
		t.Fatalf("leases lost: %v, want 1", n)
	}
}

// TestUnkeyedLeaseRequestsGetProviderKeysOfTheirOwn: on a lease route whose key is optional,
// a request without a key has no claim, but its handler still gets a provider key, one of its
// own: two such requests never share one (they used to share "", which a provider would
// deduplicate into one payout).
func TestUnkeyedLeaseRequestsGetProviderKeysOfTheirOwn(t *testing.T) {
	t.Parallel()
	a := newApp(t, nil)
	seen := map[string]bool{}
	for range 2 {
		if r := a.do("POST", "/jobs", "alice", "", `{"status":201}`); r.status != 201 {
			t.Fatalf("an unkeyed job: %+v", r)
		}
		pk := *a.provider.Load()
		if a.keyed.Load() || len(pk) != 64 || seen[pk] {
			t.Fatalf("an unkeyed request's provider key %q (keyed %v), seen before: %v", pk, a.keyed.Load(), seen[pk])
		}
		seen[pk] = true
	}
	if n := a.count(`SELECT count(*) FROM idem.idempotency_keys`); n != 0 {
		t.Fatalf("%d keys stored for unkeyed requests", n)
	}
}

// TestShutdownEndsLeaseWork: lease work outlives its client, so an HTTP server's Shutdown does
// not end it; the middleware's Shutdown does when its deadline passes: the work's context ends
// with cause ErrShutdown, its lease is given up at once (not left to run out), and the key
// stays with its request, whose retry takes it over.
func TestShutdownEndsLeaseWork(t *testing.T) {
	t.Parallel()
	a := newApp(t, nil)
	go a.do("POST", "/jobs", "alice", "sd", `{"block":true}`)
	<-a.started
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	began := time.Now()
	if err := a.m.Shutdown(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Shutdown with lease work still running: %v, want its deadline", err)
	}
	if took := time.Since(began); took > 3*time.Second {
		t.Fatalf("Shutdown took %v", took)
	}
	select {
	case cause := <-a.jobCauses:
		if !errors.Is(cause, idemhttp.ErrShutdown) {
			t.Fatalf("the work's context ended with %v, want ErrShutdown", cause)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the lease work was not ended")
	}
	pgtest.WaitFor(t, a.pool, `SELECT count(*) FROM idem.idempotency_keys WHERE key = 'sd' AND state = 'p' AND lease_expires_at <= now()`)
	// After its Shutdown the middleware starts no work (a request gets 503 at once); the
	// key stays with its request: another request under it is refused.
	if r := a.do("POST", "/jobs", "alice", "sd", `{"status":201}`); r.status != http.StatusServiceUnavailable {
		t.Fatalf("a request after the shutdown: %+v, want 503", r)
	}
	if n := a.count(`SELECT count(*) FROM idem.idem_begin('alice', 'sd', 'POST /jobs', sha256('another'))
		WHERE outcome = 'mismatch'`); n != 1 {
		t.Fatal("another request under the key after the shutdown is not refused: the key left its request")
	}
}

// TestLeaseGivenUpThroughALockTimeout: a lease route's handler fails (503), and the key's row
// is locked from just before it returns until 2.5 s after, longer than idem_yield's own lock
// timeout (2 s). The claim must still be given up (the yield is tried again until the
// lease's AnswerDeadline), so that the client's retry runs the work at once. Before, the
// yield was tried once: it failed on the lock, and the key stayed in progress for the whole
// 10 s lease, every retry answered 409.
func TestLeaseGivenUpThroughALockTimeout(t *testing.T) {
	t.Parallel()
	pool, url := pgtest.NewPool(t, 10)
	locker := pgtest.Connect(t, url)
	// A duplicate waits at most 400 ms for the key: the retry must not wait out the lease.
	m, err := idemhttp.New(idemhttp.Options{DB: pool, LockTimeout: 300 * time.Millisecond, DuplicateWait: 400 * time.Millisecond,
		Principal: func(r *http.Request) (string, bool) { return "alice", true },
		Logger:    slog.New(slog.NewTextHandler(io.Discard, nil)), RouteTemplate: muxTemplate})
	if err != nil {
		t.Fatal(err)
	}
	var runs atomic.Int32
	released := make(chan time.Time, 1)
	var failed time.Time
	r := mux.NewRouter()
	r.Handle("/payouts", m.Route(idemhttp.Route{Lease: 10 * time.Second, Required: true})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if runs.Add(1) == 1 {
			ctx := context.Background()
			tx, err := locker.Begin(ctx)
			if err == nil {
				_, err = tx.Exec(ctx, `SELECT 1 FROM idem.idempotency_keys WHERE key = 'yield' FOR UPDATE`)
			}
			if err != nil {
				t.Error(err)
			}
			failed = time.Now()
			go func() {
				time.Sleep(2500 * time.Millisecond)
				at := time.Now()
				if err := tx.Rollback(ctx); err != nil {
					t.Error(err)
				}
				released <- at
			}()
			http.Error(w, "the provider is down", http.StatusServiceUnavailable)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprint(w, `{"payout":1}`)
	}))).Methods("POST")
	srv := httptest.NewServer(r)
	defer srv.Close()
	post := func() *http.Response {
		req, _ := http.NewRequest("POST", srv.URL+"/payouts", strings.NewReader(`{"amount":5}`))
		req.Header.Set("Idempotency-Key", "yield")
		req.Header.Set("Content-Type", "application/json")
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, res.Body)
		_ = res.Body.Close()
		return res
	}
	if res := post(); res.StatusCode != http.StatusServiceUnavailable {
		t.Fatalf("the first attempt: %d, want the handler's 503", res.StatusCode)
	}
	if at := <-released; at.Sub(failed) < 2*time.Second {
		t.Fatalf("the row was released %v after the handler failed, within one lock timeout", at.Sub(failed))
	}
	if res := post(); res.StatusCode != http.StatusCreated || runs.Load() != 2 {
		t.Fatalf("the retry: %d after %d runs; want the work run again at once (201)", res.StatusCode, runs.Load())
	}
}

// serveLate serves a lease route (a one-second lease). On its first run for a key the handler
// locks the key's row on a connection of its own, so that no extension lands, waits for its
// lease to be lost and then calls afterLoss with a function that releases the row; every later
// run answers 201 at once. Each 201 names its run.
func serveLate(t *testing.T, pool *pgxpool.Pool, url string, obs *observer, runs *atomic.Int32,
	afterLoss func(w http.ResponseWriter, release func())) *httptest.Server {
	t.Helper()
	m, err := idemhttp.New(idemhttp.Options{DB: pool, LockTimeout: 300 * time.Millisecond, DuplicateWait: 100 * time.Millisecond,
		Principal: func(r *http.Request) (string, bool) { return "alice", true },
		Logger:    slog.New(slog.NewTextHandler(io.Discard, nil)), Metrics: obs, RouteTemplate: muxTemplate})
	if err != nil {
		t.Fatal(err)
	}
	// The connection that locks the key's row is opened here, not in the handler: opening one
	// on a loaded machine can take longer than the lease's first extension.
	locker := pgtest.Connect(t, url)
	r := mux.NewRouter()
	r.Handle("/late", m.Route(idemhttp.Route{Lease: time.Second, Required: true})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		run := runs.Add(1)
		if run == 1 {
			ctx := context.Background()
			tx, err := locker.Begin(ctx)
			if err == nil {
				_, err = tx.Exec(ctx, `SELECT 1 FROM idem.idempotency_keys WHERE key = $1 FOR UPDATE`, r.Header.Get("Idempotency-Key"))
			}
			if err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
			select {
			case <-r.Context().Done():
			case <-time.After(10 * time.Second):
			}
			if cause := context.Cause(r.Context()); !errors.Is(cause, idemhttp.ErrLeaseLost) {
				t.Errorf("the handler's context ended with %v, want ErrLeaseLost", cause)
			}
			afterLoss(w, func() {
				if err := tx.Rollback(ctx); err != nil {
					t.Error(err)
				}
			})
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"run":%d}`, run)
	}))).Methods("POST")
	srv := httptest.NewServer(r)
	t.Cleanup(srv.Close)
	return srv
}

// lateAnswer is an afterLoss of serveLate: it releases the row after 200 ms, calls then (when
// not nil) and answers 201 {"run":1}.
func lateAnswer(then func()) func(http.ResponseWriter, func()) {
	return func(w http.ResponseWriter, release func()) {
		time.Sleep(200 * time.Millisecond)
		release()
		if then != nil {
			then()
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprint(w, `{"run":1}`)
	}
}

// TestLeaseAnswerAfterItsLeaseRanOut (D149): the handler's lease runs out with no extension
// landing (its key's row is locked), so its context ends with ErrLeaseLost.
//
//   - It answers 201 all the same and nobody took the key over: the answer is recorded,
//     fenced by the token, and sent; the retry replays it and the work ran once. Before, the
//     client got 409 and its retry ran the work again.
//   - A request at another server took the key over and answered first: the late answer is
//     refused, its client gets 409, and the retry replays the takeover's answer.
//   - It returns without writing anything (docs/http.md's reaction to a lost lease, which
//     net/http would send as an empty 200): nothing is recorded, the client gets 409, and the
//     retry runs the work again (found by review: the first build stored the empty 200).
//   - It answers 201, and the row stays locked past the answer's deadline: the client gets
//     503 outcome_unknown, and the lease counts as lost (idempotency_leases_lost_total), as
//     any lost lease whose answer was not recorded (found by review).
func TestLeaseAnswerAfterItsLeaseRanOut(t *testing.T) {
	t.Parallel()
	pool, url := pgtest.NewPool(t, 16)
	post := func(srv *httptest.Server, key string) reply {
		status, header, body := pgtest.Send(t, context.Background(), "POST", srv.URL+"/late", `{}`,
			"Idempotency-Key", key, "Content-Type", "application/json")
		return reply{status, header, body}
	}
	t.Run("recorded", func(t *testing.T) {
		t.Parallel()
		var runs atomic.Int32
		obs := newObserver()
		a := serveLate(t, pool, url, obs, &runs, lateAnswer(nil))
		r := post(a, "ran-out")
		if r.status != http.StatusCreated || r.body != `{"run":1}` || r.header.Get("Idempotent-Replayed") != "" {
			t.Fatalf("the client: %+v, want the late answer, recorded", r)
		}
		if again := post(a, "ran-out"); again.status != http.StatusCreated || again.body != r.body || again.header.Get("Idempotent-Replayed") != "true" {
			t.Fatalf("the retry: %+v, want the replay of %s", again, r.body)
		}
		// Extensions may land before the handler's lock does (a loaded machine); none matters
		// here, only that the recorded answer does not count as a lost lease.
		if _, lost := obs.leases(); runs.Load() != 1 || lost != 0 {
			t.Fatalf("%d runs, %v leases lost; want 1 and 0", runs.Load(), lost)
		}
	})
	t.Run("taken over", func(t *testing.T) {
		t.Parallel()
		// b's request claims the key once a's row lock is gone and its lease has run out in
		// the database too, and answers before a's handler does.
		var runsA, runsB atomic.Int32
		runsB.Store(1) // b's runs answer at once
		var b *httptest.Server
		var second reply
		obsA := newObserver()
		a := serveLate(t, pool, url, obsA, &runsA, lateAnswer(func() {
			for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
				second = post(b, "taken-over")
				if second.status != http.StatusConflict || time.Now().After(deadline) {
					return
				}
			}
		}))
		b = serveLate(t, pool, url, newObserver(), &runsB, nil)
		first := post(a, "taken-over")
		if second.status != http.StatusCreated || second.body != `{"run":2}` {
			t.Fatalf("the takeover: %+v, want b's answer", second)
		}
		if first.status != http.StatusConflict || problemCode(t, first) != idemhttp.CodeInProgress {
			t.Fatalf("the client of the attempt taken over: %+v, want 409 request_in_progress", first)
		}
		if again := post(a, "taken-over"); again.status != http.StatusCreated || again.body != second.body || again.header.Get("Idempotent-Replayed") != "true" {
			t.Fatalf("the retry: %+v, want the replay of the takeover's %s", again, second.body)
		}
		if _, lost := obsA.leases(); lost != 1 {
			t.Fatalf("a's leases lost: %v, want 1", lost)
		}
	})
	t.Run("nothing written", func(t *testing.T) {
		t.Parallel()
		var runs atomic.Int32
		obs := newObserver()
		srv := serveLate(t, pool, url, obs, &runs, func(w http.ResponseWriter, release func()) {
			time.Sleep(200 * time.Millisecond)
			release()
		})
		if first := post(srv, "silent"); first.status != http.StatusConflict || problemCode(t, first) != idemhttp.CodeInProgress {
			t.Fatalf("the client of a lost lease whose handler wrote nothing: %+v, want 409 request_in_progress", first)
		}
		if _, lost := obs.leases(); lost != 1 {
			t.Fatalf("leases lost: %v, want 1", lost)
		}
		// The lease has run out in the database too within a second; then the retry takes
		// the key over and runs the work again.
		var again reply
		for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(50 * time.Millisecond) {
			again = post(srv, "silent")
			if again.status != http.StatusConflict || time.Now().After(deadline) {
				break
			}
		}
		if again.status != http.StatusCreated || again.body != `{"run":2}` || again.header.Get("Idempotent-Replayed") != "" {
			t.Fatalf("the retry: %+v after %d runs, want the work run again (201 {\"run\":2})", again, runs.Load())
		}
	})
	t.Run("not recorded by the deadline", func(t *testing.T) {
		t.Parallel()
		var runs atomic.Int32
		obs := newObserver()
		release := make(chan func(), 1)
		srv := serveLate(t, pool, url, obs, &runs, func(w http.ResponseWriter, r func()) {
			release <- r // the row stays locked until the client has its answer
			w.WriteHeader(http.StatusCreated)
			fmt.Fprint(w, `{"run":1}`)
		})
		first := post(srv, "unrecorded")
		(<-release)()
		if first.status != http.StatusServiceUnavailable || problemCode(t, first) != idemhttp.CodeOutcomeUnknown {
			t.Fatalf("the client: %+v, want 503 outcome_unknown", first)
		}
		if _, lost := obs.leases(); lost != 1 {
			t.Fatalf("leases lost: %v, want 1 (the lease was lost and its answer not recorded)", lost)
		}
	})
}

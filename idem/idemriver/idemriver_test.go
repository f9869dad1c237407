package idemriver_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"
	"github.com/riverqueue/river/rivertype"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/idem/idemriver"
	"github.com/pgidem/pgidem/idem/idemtest"
)

func TestMain(m *testing.M) { os.Exit(idemtest.Main(m)) }

// quietLog is the logger of River's clients and migrator in these tests.
var quietLog = slog.New(slog.DiscardHandler)

// migrateRiver installs River's tables next to schema idem.
func migrateRiver(ctx context.Context, pool *pgxpool.Pool) error {
	m, err := rivermigrate.New(riverpgxv5.New(pool), &rivermigrate.Config{Logger: quietLog})
	if err != nil {
		return err
	}
	_, err = m.Migrate(ctx, rivermigrate.DirectionUp, nil)
	return err
}

// newPool is a fresh database with schema idem and River's tables.
func newPool(t *testing.T) *pgxpool.Pool {
	t.Helper()
	pool := idemtest.NewPool(t)
	if err := migrateRiver(context.Background(), pool); err != nil {
		t.Fatal(err)
	}
	return pool
}

// ReceiptArgs is the job of the tests: send the receipt of an order.
type ReceiptArgs struct {
	Order int64 `json:"order"`
}

func (ReceiptArgs) Kind() string { return "receipt" }

// provider is an outside receiver that deduplicates by the idempotency key it is given, as
// a payment provider or a webhook receiver does: the first call with a key has an effect,
// every later one with the key is a repeat. It counts both.
type provider struct {
	mu      sync.Mutex
	calls   map[string]int // per key, every call
	effects int            // calls that had an effect (the first of each key)
}

func newProvider() *provider { return &provider{calls: map[string]int{}} }

func (p *provider) send(key string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.calls[key] == 0 {
		p.effects++
	}
	p.calls[key]++
}

func (p *provider) figures() (effects int, calls map[string]int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	calls = map[string]int{}
	for k, v := range p.calls {
		calls[k] = v
	}
	return p.effects, calls
}

// fastRetry retries a failed job after 50 ms: the tests do not wait for River's backoff.
type fastRetry struct{}

func (fastRetry) NextRetry(*rivertype.JobRow) time.Time { return time.Now().Add(50 * time.Millisecond) }

// newClient is a River client on pool with workers (nil: insert only).
func newClient(t *testing.T, pool *pgxpool.Pool, workers *river.Workers, mw ...rivertype.Middleware) *river.Client[pgx.Tx] {
	t.Helper()
	cfg := &river.Config{Logger: quietLog, Workers: workers, RetryPolicy: fastRetry{}, Middleware: mw,
		FetchCooldown: 5 * time.Millisecond, FetchPollInterval: 50 * time.Millisecond}
	if workers != nil {
		cfg.Queues = map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: 2}}
	}
	client, err := river.NewClient(riverpgxv5.New(pool), cfg)
	if err != nil {
		t.Fatal(err)
	}
	if workers != nil {
		if err := client.Start(context.Background()); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			_ = client.StopAndCancel(ctx)
		})
	}
	return client
}

func count(t *testing.T, pool *pgxpool.Pool, sql string, args ...any) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), sql, args...).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// waitFor polls sql (a count) until it is above zero, for up to 20 s.
func waitFor(t *testing.T, pool *pgxpool.Pool, sql string, args ...any) {
	t.Helper()
	for deadline := time.Now().Add(20 * time.Second); count(t, pool, sql, args...) == 0; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("never true: %s %v", sql, args)
		}
	}
}

func post(t *testing.T, url, key, body string) (int, string) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", key)
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	_, _ = io.Copy(io.Discard, res.Body)
	return res.StatusCode, res.Header.Get("Idempotent-Replayed")
}

// TestInsertCommitsWithTheKey: a keyed request that enqueues with Insert enqueues one job,
// however often it is retried (a replay runs no handler); a request whose work rolls back
// enqueues none; a lease route's handler (no transaction) gets ErrNoTx and enqueues none.
func TestInsertCommitsWithTheKey(t *testing.T) {
	ctx := context.Background()
	pool := newPool(t)
	pgExec(t, pool, `CREATE TABLE orders (id bigserial PRIMARY KEY, sku text NOT NULL)`)
	client := newClient(t, pool, nil)
	m, err := idem.New(ctx, idem.Options{DB: pool, Principal: func(*http.Request) (string, bool) { return "alice", true }})
	if err != nil {
		t.Fatal(err)
	}
	var leaseErr error
	mux := http.NewServeMux()
	mux.Handle("POST /orders", m.Route(idem.Route{Required: true})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var o struct {
			SKU string `json:"sku"`
		}
		if !idem.DecodeJSON(w, r, &o) {
			return
		}
		var id int64
		if err := idem.TxFrom(r.Context()).QueryRow(r.Context(), `INSERT INTO orders (sku) VALUES ($1) RETURNING id`, o.SKU).Scan(&id); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		if _, err := idemriver.Insert(r.Context(), client, ReceiptArgs{Order: id}, nil); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		if o.SKU == "fails-later" { // the work fails after the enqueue: all of it rolls back
			http.Error(w, "try again", http.StatusServiceUnavailable)
			return
		}
		w.WriteHeader(http.StatusCreated)
	})))
	mux.Handle("POST /payouts", m.Route(idem.Route{Required: true, Lease: 5 * time.Second})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, leaseErr = idemriver.Insert(r.Context(), client, ReceiptArgs{Order: 0}, nil)
		w.WriteHeader(http.StatusCreated)
	})))
	srv := httptest.NewServer(mux)
	defer srv.Close()

	for i, want := range []string{"", "true", "true"} {
		if status, replayed := post(t, srv.URL+"/orders", "o-1", `{"sku":"a1"}`); status != 201 || replayed != want {
			t.Fatalf("attempt %d: %d replayed %q", i+1, status, replayed)
		}
	}
	if n := count(t, pool, `SELECT count(*) FROM river_job WHERE kind = 'receipt'`); n != 1 {
		t.Fatalf("%d receipt jobs after a request and two retries, want 1", n)
	}
	if n := count(t, pool, `SELECT count(*) FROM river_job WHERE args->>'order' = (SELECT id::text FROM orders WHERE sku = 'a1')`); n != 1 {
		t.Fatalf("the job is not the order's: %d", n)
	}
	if status, _ := post(t, srv.URL+"/orders", "o-2", `{"sku":"fails-later"}`); status != http.StatusServiceUnavailable {
		t.Fatalf("the failing request: %d", status)
	}
	if n := count(t, pool, `SELECT count(*) FROM river_job`); n != 1 {
		t.Fatalf("%d jobs after a request that rolled back, want the first request's 1", n)
	}
	if n := count(t, pool, `SELECT count(*) FROM orders`); n != 1 {
		t.Fatalf("%d orders, want 1", n)
	}
	if status, _ := post(t, srv.URL+"/payouts", "p-1", `{}`); status != 201 || !errors.Is(leaseErr, idemriver.ErrNoTx) {
		t.Fatalf("a lease route: %d, Insert's error %v, want ErrNoTx", status, leaseErr)
	}
	if n := count(t, pool, `SELECT count(*) FROM river_job`); n != 1 {
		t.Fatalf("%d jobs after the lease route, want 1", n)
	}
}

func pgExec(t *testing.T, pool *pgxpool.Pool, sql string, args ...any) {
	t.Helper()
	if _, err := pool.Exec(context.Background(), sql, args...); err != nil {
		t.Fatal(err)
	}
}

// receiptWorker sends a receipt through the provider under the claim of the middleware
// (ClaimOf); its first run fails after the provider took the call (the answer was lost).
type receiptWorker struct {
	river.WorkerDefaults[ReceiptArgs]
	p       *provider
	mu      sync.Mutex
	runs    int
	noClaim bool
}

func (w *receiptWorker) Work(ctx context.Context, job *river.Job[ReceiptArgs]) error {
	claim, ok := idemriver.ClaimOf(ctx)
	w.mu.Lock()
	w.runs++
	first := w.runs == 1
	w.noClaim = w.noClaim || !ok
	w.mu.Unlock()
	w.p.send(claim.ProviderKey)
	if first {
		return errors.New("the provider's answer was lost")
	}
	return nil
}

// TestRetryReachesTheProviderOnce: a job whose first run fails after the provider took its
// call is retried by River; the retry calls the provider again under the same provider key,
// so the provider acts once; the job completes, and its key holds the result.
func TestRetryReachesTheProviderOnce(t *testing.T) {
	ctx := context.Background()
	pool := newPool(t)
	p := newProvider()
	w := &receiptWorker{p: p}
	workers := river.NewWorkers()
	river.AddWorker(workers, w)
	client := newClient(t, pool, workers, idemriver.Middleware(idemriver.Options{DB: pool, Lease: 2 * time.Second}))
	res, err := client.Insert(ctx, ReceiptArgs{Order: 7}, nil)
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, pool, `SELECT count(*) FROM river_job WHERE id = $1 AND state = 'completed'`, res.Job.ID)
	effects, calls := p.figures()
	if effects != 1 || len(calls) != 1 {
		t.Fatalf("the provider: %d effects, calls per key %v; want one effect under one key", effects, calls)
	}
	for key, n := range calls {
		if n != 2 || key == "" {
			t.Fatalf("the provider: %d calls under key %q, want the failed run's and the retry's", n, key)
		}
	}
	if w.noClaim {
		t.Fatal("the worker ran without a claim (ClaimOf false)")
	}
	var attempt int
	if err := pool.QueryRow(ctx, `SELECT attempt FROM river_job WHERE id = $1`, res.Job.ID).Scan(&attempt); err != nil || attempt != 2 {
		t.Fatalf("the job's attempts: %d (%v), want 2", attempt, err)
	}
	if n := count(t, pool, `SELECT count(*) FROM idem.idempotency_keys WHERE principal_id = 'river' AND key = $1 AND state = 'c'`,
		fmt.Sprintf("receipt/%d", res.Job.ID)); n != 1 {
		t.Fatalf("the job's key is not completed: %d", n)
	}
}

// jobRow inserts a River job (not worked: no client runs) and reads its row back.
func jobRow(t *testing.T, client *river.Client[pgx.Tx], args ReceiptArgs) *rivertype.JobRow {
	t.Helper()
	res, err := client.Insert(context.Background(), args, nil)
	if err != nil {
		t.Fatal(err)
	}
	return res.Job
}

// TestHungWorkerIsTakenOver: a run whose worker hangs after the provider took its call (it
// ignores its context) keeps the job's key while its lease is extended; a second run of the
// job meanwhile is snoozed, not run. Once the hung run's context ends (River's job timeout)
// its lease runs out, and the next run takes the key over with the same provider key: the
// provider acts once. When the hung worker wakes up, its lease is lost and nothing of it is
// stored.
func TestHungWorkerIsTakenOver(t *testing.T) {
	pool := newPool(t)
	client := newClient(t, pool, nil)
	job := jobRow(t, client, ReceiptArgs{Order: 9})
	p := newProvider()
	// A 2 s lease: each extension may take a third of it (a loaded CI machine under the race
	// detector once took longer than a third of 1 s twice in a row).
	opts := idemriver.Options{DB: pool, Lease: 2 * time.Second}

	hungCtx, die := context.WithCancel(context.Background())
	called, wake := make(chan struct{}), make(chan struct{})
	first := make(chan error, 1)
	go func() {
		first <- idemriver.Work(hungCtx, job, opts, func(ctx context.Context, claim idem.LeaseClaim) error {
			p.send(claim.ProviderKey)
			close(called)
			<-wake // hung: ignores its context
			return nil
		})
	}()
	<-called
	time.Sleep(3 * time.Second) // past a lease: the heartbeat keeps the key
	second := *job
	second.Attempt, second.AttemptedBy = 2, []string{"a", "b"}
	ran := false
	err := idemriver.Work(context.Background(), &second, opts, func(context.Context, idem.LeaseClaim) error { ran = true; return nil })
	var snooze *river.JobSnoozeError
	if !errors.As(err, &snooze) || ran || snooze.Duration != 2*time.Second {
		t.Fatalf("a run while the first holds the key: %v (ran %v), want a snooze of a lease", err, ran)
	}

	die() // the job timeout: the heartbeat stops, the worker stays hung
	var takeover string
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		err = idemriver.Work(context.Background(), &second, opts, func(ctx context.Context, claim idem.LeaseClaim) error {
			takeover = claim.ProviderKey
			p.send(claim.ProviderKey)
			return nil
		})
		if err == nil {
			break
		}
		if !errors.As(err, &snooze) || time.Now().After(deadline) {
			t.Fatalf("the run after the lease ran out: %v", err)
		}
	}
	effects, calls := p.figures()
	if effects != 1 || len(calls) != 1 || calls[takeover] != 2 {
		t.Fatalf("the provider: %d effects, calls %v; want one effect, two calls under the takeover's key %q", effects, calls, takeover)
	}
	close(wake)
	// Its lease ended long ago: it stores nothing (the deadline of its lease's end, or
	// ErrLeaseLost), and River retries it.
	if err := <-first; !errors.Is(err, idem.ErrLeaseLost) && !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("the hung run when it wakes: %v, want its lease's end", err)
	}
	// A third run (River's retry of the hung run's error) finds the result: it does not run.
	third := second
	third.Attempt = 3
	if err := idemriver.Work(context.Background(), &third, opts, func(context.Context, idem.LeaseClaim) error {
		t.Error("a run after the result was stored ran the work")
		return nil
	}); err != nil {
		t.Fatalf("the run after the result: %v", err)
	}
}

// TestWorkCancels: a job that ran before and is older than its key's TTL is cancelled without
// running (its key may be gone, and a new provider key would repeat the effect), while its
// first run goes ahead; two jobs that a Key function gives one key are one unit of work (the
// second with the same arguments does not run, one with other arguments is cancelled with
// ErrMismatch); a failing run's error reaches River, and its retry runs under the same
// provider key; PrincipalOf names a job's principal.
func TestWorkCancels(t *testing.T) {
	ctx := context.Background()
	pool := newPool(t)
	client := newClient(t, pool, nil)
	opts := idemriver.Options{DB: pool, Lease: time.Second, TTL: 24 * time.Hour}

	old := jobRow(t, client, ReceiptArgs{Order: 1})
	old.CreatedAt = time.Now().Add(-24 * time.Hour)
	runs := 0
	work := func(context.Context, idem.LeaseClaim) error { runs++; return nil }
	if err := idemriver.Work(ctx, old, opts, work); err != nil || runs != 1 {
		t.Fatalf("the first run of an old job: %v, %d runs", err, runs)
	}
	retried := *old
	retried.Attempt = 2
	err := idemriver.Work(ctx, &retried, opts, work)
	var cancel *river.JobCancelError
	if !errors.As(err, &cancel) || !errors.Is(err, idemriver.ErrKeyExpired) || runs != 1 {
		t.Fatalf("a later run of a job older than the TTL: %v, %d runs; want a cancel with ErrKeyExpired", err, runs)
	}
	retried.CreatedAt = time.Now().Add(-22 * time.Hour)
	if err := idemriver.Work(ctx, &retried, opts, work); err != nil || runs != 1 {
		t.Fatalf("a later run within the TTL: %v, %d runs; want the stored result, no run", err, runs)
	}

	byOrder := opts
	byOrder.Key = func(job *rivertype.JobRow) string { return "order-receipt" }
	a, b, c := jobRow(t, client, ReceiptArgs{Order: 5}), jobRow(t, client, ReceiptArgs{Order: 5}), jobRow(t, client, ReceiptArgs{Order: 6})
	runs = 0
	for _, j := range []*rivertype.JobRow{a, b} {
		if err := idemriver.Work(ctx, j, byOrder, work); err != nil {
			t.Fatal(err)
		}
	}
	if runs != 1 {
		t.Fatalf("two jobs under one key ran %d times, want 1", runs)
	}
	err = idemriver.Work(ctx, c, byOrder, work)
	if !errors.As(err, &cancel) || !errors.Is(err, idem.ErrMismatch) || runs != 1 {
		t.Fatalf("other arguments under the key: %v; want a cancel with ErrMismatch", err)
	}

	failing := jobRow(t, client, ReceiptArgs{Order: 8})
	var keys []string
	boom := errors.New("boom")
	for i, want := range []error{boom, nil} {
		err := idemriver.Work(ctx, failing, opts, func(_ context.Context, claim idem.LeaseClaim) error {
			keys = append(keys, claim.ProviderKey)
			if i == 0 {
				return boom
			}
			return nil
		})
		if !errors.Is(err, want) || (want == nil && err != nil) {
			t.Fatalf("run %d: %v, want %v", i+1, err, want)
		}
	}
	if len(keys) != 2 || keys[0] != keys[1] || keys[0] == "" {
		t.Fatalf("the provider keys of a failed run and its retry: %q, want one", keys)
	}
	bobs := opts
	bobs.PrincipalOf = func(*rivertype.JobRow) string { return "bob" }
	if err := idemriver.Work(ctx, jobRow(t, client, ReceiptArgs{Order: 10}), bobs, work); err != nil {
		t.Fatal(err)
	}
	if n := count(t, pool, `SELECT count(*) FROM idem.idempotency_keys WHERE principal_id = 'bob' AND key LIKE 'receipt/%' AND state = 'c'`); n != 1 {
		t.Fatalf("PrincipalOf: %d keys of bob, want 1", n)
	}
	if err := idemriver.Work(ctx, failing, idemriver.Options{}, work); err == nil {
		t.Fatal("Work without a DB succeeded")
	}
}

// TestRiverStaysOutOfIdem: `go list -deps` of package idem holds no River module (River is
// this package's dependency only), and this package's does.
func TestRiverStaysOutOfIdem(t *testing.T) {
	for pkg, want := range map[string]bool{"..": false, ".": true, "../../idemclient": false} {
		out, err := exec.Command("go", "list", "-deps", pkg).CombinedOutput()
		if err != nil {
			t.Fatalf("go list -deps %s: %v\n%s", pkg, err, out)
		}
		if has := strings.Contains(string(out), "github.com/riverqueue/"); has != want {
			t.Errorf("go list -deps %s holds River: %v, want %v", pkg, has, want)
		}
	}
}

// TestLockedKeyTableSnoozes: a run that finds the key table locked for maintenance (a
// migration's swap, VACUUM FULL, pg_repack) wrote nothing and did not run; the job waits a few
// seconds without spending an attempt (a snooze), and runs once the table is free. When
// idem.ErrStoreBusy stopped also matching idem.ErrInProgress (D182), such a run went to River's
// retry policy as a failure.
func TestLockedKeyTableSnoozes(t *testing.T) {
	ctx := context.Background()
	pool := newPool(t)
	client := newClient(t, pool, nil)
	job := jobRow(t, client, ReceiptArgs{Order: 11})
	opts := idemriver.Options{DB: pool, Lease: time.Minute}
	locker, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = locker.Rollback(ctx) }()
	if _, err := locker.Exec(ctx, `LOCK TABLE idem.idempotency_keys IN ACCESS EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	runs := 0
	work := func(context.Context, idem.LeaseClaim) error { runs++; return nil }
	err = idemriver.Work(ctx, job, opts, work)
	var snooze *river.JobSnoozeError
	if !errors.As(err, &snooze) || snooze.Duration > 5*time.Second || runs != 0 {
		t.Fatalf("a run under a locked key table: %v (%d runs), want a snooze of at most 5 s and no run", err, runs)
	}
	_ = locker.Rollback(ctx)
	if err := idemriver.Work(ctx, job, opts, work); err != nil || runs != 1 {
		t.Fatalf("the run after the table is free: %v, %d runs", err, runs)
	}
}

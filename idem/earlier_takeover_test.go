package idem_test

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/canon"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// etSetup: a JSON request's lease claim (canonical-JSON fingerprint, as this release and
// the releases before D178 both store it) whose process died after step "reserve"; the lease
// has run out. It returns the pool, the server and the original claim's decision.
type etJob struct {
	pool       *pgxpool.Pool
	srv        *httptest.Server
	first      idem.Decision
	reserveRun atomic.Int32
	payRun     atomic.Int32
	plainGate  chan struct{} // closed: the text/plain handler answers (415)
	plainIn    chan struct{} // the text/plain handler started
	jsonKeys   chan string   // the provider key each JSON run saw
	plainKeys  chan string
	metrics    *etObs
	m          *idem.Middleware
}

type etObs struct {
	mu     sync.Mutex
	counts map[idem.State]int
	ended  []bool
}

func (o *etObs) Count(action string, s idem.State) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.counts[s]++
}
func (o *etObs) Done(idem.State, time.Duration) {}
func (o *etObs) LeaseExtended(string)           {}
func (o *etObs) LeaseEnded(action string, lost bool, worked time.Duration) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.ended = append(o.ended, lost)
}

const etBody = `{"account":7,"amount":700}`

func etSetup(t *testing.T, key string, status int) *etJob {
	t.Helper()
	url := pgtest.NewDB(t)
	pool, err := pgxpool.New(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	ctx := context.Background()
	z := &etJob{pool: pool, plainGate: make(chan struct{}), plainIn: make(chan struct{}, 4),
		jsonKeys: make(chan string, 8), plainKeys: make(chan string, 8),
		metrics: &etObs{counts: map[idem.State]int{}}}
	fp := canon.Compute("POST", "/pay", []byte(etBody))
	z.first, err = idem.Begin(ctx, pool, idem.Claim{Principal: "alice", Key: key, Action: "POST /pay",
		Fingerprint: fp.Sum, Fields: fp.Fields, Lease: time.Second})
	if err != nil || z.first.Outcome != idem.Claimed {
		t.Fatalf("the JSON request's claim: %+v %v", z.first, err)
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := idem.RecordStep(ctx, tx, "alice", key, z.first.Attempt, "reserve", json.RawMessage(`41`)); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	m, err := idem.New(ctx, idem.Options{DB: pool, Principal: alice, Logger: auditQuiet, Metrics: z.metrics})
	if err != nil {
		t.Fatal(err)
	}
	z.m = m
	mux := http.NewServeMux()
	mux.Handle("POST /pay", m.Route(idem.Route{Action: "POST /pay", Required: true, Lease: 10 * time.Second})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		c, _ := idem.ClaimOf(r.Context())
		if r.Header.Get("Content-Type") != "application/json" {
			z.plainKeys <- c.ProviderKey
			z.plainIn <- struct{}{}
			select {
			case <-z.plainGate:
			case <-r.Context().Done():
			}
			w.WriteHeader(status)
			_, _ = w.Write([]byte(`refused`))
			return
		}
		z.jsonKeys <- c.ProviderKey
		if _, err := idem.Step(r.Context(), "reserve", func(ctx context.Context, tx pgx.Tx) (int, error) {
			z.reserveRun.Add(1)
			return 41, nil
		}); err != nil {
			w.WriteHeader(500)
			return
		}
		if _, err := idem.Step(r.Context(), "pay", func(ctx context.Context, tx pgx.Tx) (int, error) {
			z.payRun.Add(1)
			return 1, nil
		}); err != nil {
			w.WriteHeader(500)
			return
		}
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte(`paid`))
	})))
	z.srv = httptest.NewServer(mux)
	t.Cleanup(z.srv.Close)
	// The lease (1 s) runs out: the process that held it is gone.
	pgtest.WaitFor(t, pool, `SELECT count(*) FROM idem.idempotency_keys WHERE principal_id = 'alice' AND key = $1
		AND lease_expires_at < clock_timestamp()`, key)
	return z
}

// TestEarlierTakeoverTakeoverRefusalUnstoredJSONGoesOnAtOnce: docs/http.md "The fingerprint": a
// text/plain takeover under the earlier releases' fingerprint stores only a 2xx; "Any other
// answer ... is sent as it is, not stored, and the lease is given up, so the request the key
// was claimed for takes it over at once and goes on after the steps it recorded". Checked for
// each kind of non-2xx answer (final 415 and 409, a 3xx, a 408, a 5xx): the refusal is sent as
// it is, not replayed; the JSON retry right after (no wait) runs, under the same provider key,
// skipping the recorded step, and gets 201; a later text/plain replays the 201.
func TestEarlierTakeoverTakeoverRefusalUnstoredJSONGoesOnAtOnce(t *testing.T) {
	t.Parallel()
	for _, status := range []int{415, 409, 303, 408, 502} {
		t.Run(http.StatusText(status), func(t *testing.T) {
			t.Parallel()
			key := "d205"
			z := etSetup(t, key, status)
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			close(z.plainGate)
			st, h, body := pgtest.Send(t, ctx, "POST", z.srv.URL+"/pay", etBody, "Idempotency-Key", key, "Content-Type", "text/plain")
			if st != status || body != "refused" || h.Get("Idempotent-Replayed") == "true" {
				t.Fatalf("text/plain takeover: %d %q replayed=%q, want its own %d sent as it is", st, body, h.Get("Idempotent-Replayed"), status)
			}
			if pk := <-z.plainKeys; pk != z.first.ProviderKey {
				t.Errorf("text/plain takeover's provider key %q, want the generation's %q", pk, z.first.ProviderKey)
			}
			var state string
			var resp *int
			if err := z.pool.QueryRow(ctx, `SELECT state::text, response_status::int FROM idem.idempotency_keys WHERE principal_id = 'alice' AND key = $1`, key).Scan(&state, &resp); err != nil {
				t.Fatal(err)
			}
			if state == "c" || resp != nil {
				t.Fatalf("after the text/plain takeover's %d the key is %q with a stored status %v: stored", status, state, resp)
			}
			// At once: no sleep, one try.
			st, h, body = pgtest.Send(t, ctx, "POST", z.srv.URL+"/pay", etBody, "Idempotency-Key", key, "Content-Type", "application/json")
			if st != http.StatusCreated || body != "paid" || h.Get("Idempotent-Replayed") == "true" {
				t.Errorf("the JSON retry right after: %d %q replayed=%q, want 201 paid at once", st, body, h.Get("Idempotent-Replayed"))
			}
			select {
			case pk := <-z.jsonKeys:
				if pk != z.first.ProviderKey {
					t.Errorf("JSON retry's provider key %q, want the generation's %q", pk, z.first.ProviderKey)
				}
			default:
				t.Errorf("the JSON retry's handler did not run")
			}
			if z.reserveRun.Load() != 0 || z.payRun.Load() != 1 {
				t.Errorf("reserve ran %d times, pay %d: want the recorded step skipped and pay run once", z.reserveRun.Load(), z.payRun.Load())
			}
			st, h, body = pgtest.Send(t, ctx, "POST", z.srv.URL+"/pay", etBody, "Idempotency-Key", key, "Content-Type", "text/plain")
			if st != http.StatusCreated || h.Get("Idempotent-Replayed") != "true" {
				t.Errorf("text/plain after the JSON 201: %d %q replayed=%q, want the 201 replayed", st, body, h.Get("Idempotent-Replayed"))
			}
			z.metrics.mu.Lock()
			defer z.metrics.mu.Unlock()
			for _, lost := range z.metrics.ended {
				if lost {
					t.Errorf("LeaseEnded reported a lost lease: %v", z.metrics.ended)
				}
			}
			if z.metrics.counts[idem.StateStoreError] != 0 {
				t.Errorf("store_error counted: %v", z.metrics.counts)
			}
		})
	}
}

// TestEarlierTakeoverWaitingJSONDuplicateGetsTheWork: a JSON retry that arrives while the text/plain
// takeover's handler still runs waits in this process (docs/http.md: a duplicate waits up to
// DuplicateWait, then answers as the first did); once the takeover's 415 is sent unstored and
// the lease given up, the waiting JSON request takes it over and goes on: 201, not the 415,
// not 409.
func TestEarlierTakeoverWaitingJSONDuplicateGetsTheWork(t *testing.T) {
	t.Parallel()
	key := "d205-wait"
	z := etSetup(t, key, http.StatusUnsupportedMediaType)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	var plainSt int
	var plainBody string
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		plainSt, _, plainBody = pgtest.Send(t, ctx, "POST", z.srv.URL+"/pay", etBody, "Idempotency-Key", key, "Content-Type", "text/plain")
	}()
	<-z.plainIn
	var jsonSt int
	var jsonH http.Header
	var jsonBody string
	wg.Add(1)
	go func() {
		defer wg.Done()
		jsonSt, jsonH, jsonBody = pgtest.Send(t, ctx, "POST", z.srv.URL+"/pay", etBody, "Idempotency-Key", key, "Content-Type", "application/json")
	}()
	time.Sleep(500 * time.Millisecond) // the JSON duplicate is waiting on the text/plain's lease
	close(z.plainGate)
	wg.Wait()
	if plainSt != 415 || plainBody != "refused" {
		t.Errorf("text/plain: %d %q, want its 415", plainSt, plainBody)
	}
	if jsonSt != http.StatusCreated || jsonBody != "paid" || jsonH.Get("Idempotent-Replayed") == "true" {
		t.Errorf("the JSON duplicate that waited: %d %q replayed=%q, want 201 paid", jsonSt, jsonBody, jsonH.Get("Idempotent-Replayed"))
	}
	if z.reserveRun.Load() != 0 || z.payRun.Load() != 1 {
		t.Errorf("reserve ran %d times, pay %d: want the recorded step skipped and pay run once", z.reserveRun.Load(), z.payRun.Load())
	}
}

// TestEarlierTakeoverTakeoverRefusedAtShutdown: the text/plain takeover's handler still runs when
// Shutdown's deadline ends its context, and it answers its 415 then. D205: only a 2xx of such a
// takeover is stored; the lease is given up, so the JSON request's retry (on another process,
// here a second middleware on the same database) goes on at once under the same provider key.
func TestEarlierTakeoverTakeoverRefusedAtShutdown(t *testing.T) {
	t.Parallel()
	key := "d205-shutdown"
	z := etSetup(t, key, http.StatusUnsupportedMediaType)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	var plainSt int
	var plainBody string
	done := make(chan struct{})
	go func() {
		defer close(done)
		plainSt, _, plainBody = pgtest.Send(t, ctx, "POST", z.srv.URL+"/pay", etBody, "Idempotency-Key", key, "Content-Type", "text/plain")
	}()
	<-z.plainIn
	sctx, scancel := context.WithTimeout(ctx, 200*time.Millisecond)
	_ = z.m.Shutdown(sctx)
	scancel()
	<-done
	if plainSt != 415 || plainBody != "refused" {
		t.Errorf("text/plain at shutdown: %d %q, want its 415 sent as it is", plainSt, plainBody)
	}
	var state string
	var resp *int
	if err := z.pool.QueryRow(ctx, `SELECT state::text, response_status::int FROM idem.idempotency_keys WHERE principal_id = 'alice' AND key = $1`, key).Scan(&state, &resp); err != nil {
		t.Fatal(err)
	}
	if state == "c" || resp != nil {
		t.Fatalf("after the text/plain takeover's 415 at shutdown the key is %q with a stored status %v", state, resp)
	}
	// Another process of this release.
	m2, err := idem.New(ctx, idem.Options{DB: z.pool, Principal: alice, Logger: auditQuiet})
	if err != nil {
		t.Fatal(err)
	}
	var pk string
	mux := http.NewServeMux()
	mux.Handle("POST /pay", m2.Route(idem.Route{Action: "POST /pay", Required: true, Lease: 10 * time.Second})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		c, _ := idem.ClaimOf(r.Context())
		pk = c.ProviderKey
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte("paid"))
	})))
	srv := httptest.NewServer(mux)
	defer srv.Close()
	st, _, body := pgtest.Send(t, ctx, "POST", srv.URL+"/pay", etBody, "Idempotency-Key", key, "Content-Type", "application/json")
	if st != http.StatusCreated || body != "paid" || pk != z.first.ProviderKey {
		t.Errorf("the JSON retry on another process right after: %d %q provider key %q; want 201 paid at once under %q", st, body, pk, z.first.ProviderKey)
	}
}

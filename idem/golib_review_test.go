package idem_test

// Fresh eyes on package idem as another module adopts it (topic GoLib): combinations of the
// public API that a Go service writes naturally.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/big"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

func glAlice(*http.Request) (string, bool) { return "alice", true }

func glPost(t *testing.T, url, key, body string) (int, string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		t.Error(err)
		return 0, ""
	}
	req.Header.Set("Content-Type", "application/json")
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Error(err)
		return 0, ""
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// glCoalescedDo runs two idem.Do calls of one job (Gate g) at once, through call, which runs
// its argument the way the test wants (plainly, or from a keyed request's handler): the second
// must wait in Go for the first. It returns when both ended.
func glCoalescedDo(t *testing.T, pool idem.Pool, g *idem.Gate, call func(key string, do func(ctx context.Context) (int, error))) {
	t.Helper()
	release := make(chan struct{})
	entered := make(chan struct{}, 2)
	var runs atomic.Int32
	do := func(ctx context.Context) (int, error) {
		v, _, err := idem.Do(ctx, pool, idem.Job{Principal: "worker", Key: "shared", Action: "sync", Gate: g}, idem.TxOptions{},
			func(ctx context.Context, tx pgx.Tx) (int, error) {
				runs.Add(1)
				entered <- struct{}{}
				<-release
				return 7, nil
			})
		return v, err
	}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); call("a", do) }()
	select {
	case <-entered:
	case <-time.After(10 * time.Second):
		close(release)
		t.Fatal("the first Do never ran fn")
	}
	wg.Add(1)
	go func() { defer wg.Done(); call("b", do) }()
	deadline := time.Now().Add(5 * time.Second)
	for g.Stats().Waiting != 1 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	waiting := g.Stats().Waiting
	close(release)
	wg.Wait()
	if waiting != 1 {
		t.Fatalf("the second Do did not wait in the Gate (Waiting %d)", waiting)
	}
	if n := runs.Load(); n != 1 {
		t.Fatalf("fn ran %d times, want 1", n)
	}
}

// TestGoLibDoCoalescedCountsInItsGate is the control: two Do calls of one job at once, the
// second waits in Go for the first, and the job's Gate counts it (GateStats.Coalesced: "counts
// the requests that found their key in flight in this process and waited in line for it").
func TestGoLibDoCoalescedCountsInItsGate(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 6)
	g := idem.NewGate(idem.GateOptions{})
	glCoalescedDo(t, pool, g, func(_ string, do func(ctx context.Context) (int, error)) {
		if v, err := do(context.Background()); err != nil || v != 7 {
			t.Errorf("Do: %d, %v", v, err)
		}
	})
	if c := g.Stats().Coalesced; c != 1 {
		t.Fatalf("Gate.Stats().Coalesced = %d, want 1", c)
	}
}

// TestGoLibDoInHandlerCountsInItsGate: the same two Do calls, each made by the handler of a
// keyed request (r.Context(), as every handler passes its context on), on a transactional
// route. The requests have different keys: no request coalesced in the middleware's Gate; the
// second Do coalesced in its job's Gate. The Gate of the Do must count it, and the middleware's
// GateStats must not: "Coalesced counts the requests that found their key in flight in this
// process and waited in line for it" (GateStats), "Job.Gate coalesces concurrent calls of this
// process with the same key" and Gate.Stats "reads the Gate's figures".
func TestGoLibDoInHandlerCountsInItsGate(t *testing.T) {
	t.Parallel()
	for _, route := range []struct {
		name string
		rt   idem.Route
	}{{"transactional", idem.Route{}}, {"lease", idem.Route{Lease: 5 * time.Second}}} {
		t.Run(route.name, func(t *testing.T) {
			ctx := context.Background()
			pool, _ := pgtest.NewPool(t, 8)
			m, err := idem.New(ctx, idem.Options{DB: pool, Principal: glAlice})
			if err != nil {
				t.Fatal(err)
			}
			g := idem.NewGate(idem.GateOptions{})
			var do func(ctx context.Context) (int, error)
			var mu sync.Mutex
			h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				mu.Lock()
				f := do
				mu.Unlock()
				v, err := f(r.Context())
				if err != nil {
					http.Error(w, err.Error(), http.StatusInternalServerError)
					return
				}
				w.Header().Set("Content-Type", "application/json")
				fmt.Fprintf(w, `{"v":%d}`, v)
			})
			mux := http.NewServeMux()
			mux.Handle("POST /v1/sync", m.Route(route.rt)(h))
			srv := httptest.NewServer(mux)
			defer srv.Close()
			glCoalescedDo(t, pool, g, func(key string, d func(ctx context.Context) (int, error)) {
				mu.Lock()
				do = d
				mu.Unlock()
				if code, body := glPost(t, srv.URL+"/v1/sync", key, `{}`); code != 200 || body != `{"v":7}` {
					t.Errorf("request %s: %d %s", key, code, body)
				}
			})
			if c := m.GateStats().Coalesced; c != 0 {
				t.Errorf("Middleware.GateStats().Coalesced = %d, want 0: no HTTP request waited for another with its key", c)
			}
			if c := g.Stats().Coalesced; c != 1 {
				t.Errorf("the job's Gate.Stats().Coalesced = %d, want 1: the second Do waited in line for the first", c)
			}
		})
	}
}

// TestGoLibDecodeJSONLargeIntegers: DecodeJSON reads "the request's JSON body into v
// strictly", refusing only what its doc lists (unknown, duplicate and case-folded members,
// invalid UTF-8, trailing data, deep nesting, exponents of more than 16 digits) "as is any body
// that does not decode into v". A plain integer of 22 digits (1000 ether in wei) is strictly
// valid JSON, exactly representable, and decodes into a *big.Int with encoding/json and with
// go-json-experiment alike; the canonical text DecodeJSON decodes instead writes it as 1e+21,
// which big.Int's UnmarshalJSON refuses: the request got a final 400 malformed_body (stored for
// its key) until D233, whose *big.Int reads both layouts.
func TestGoLibDecodeJSONLargeIntegers(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	m, err := idem.New(ctx, idem.Options{DB: pool, Principal: glAlice})
	if err != nil {
		t.Fatal(err)
	}
	type payout struct {
		Wei *big.Int `json:"wei"`
	}
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var p payout
		if !idem.DecodeJSON(w, r, &p) {
			return
		}
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"wei":"%s"}`, p.Wei)
	})
	mux := http.NewServeMux()
	mux.Handle("POST /v1/payouts", m.Route(idem.Route{})(h))
	srv := httptest.NewServer(mux)
	defer srv.Close()
	for i, wei := range []string{"999000000000000000000", "1000000000000000000000", "12345678901234567890123"} {
		body := `{"wei":` + wei + `}`
		var direct payout
		if err := json.Unmarshal([]byte(body), &direct); err != nil || direct.Wei.String() != wei {
			t.Fatalf("encoding/json: %v %v", direct.Wei, err)
		}
		for _, key := range []string{fmt.Sprintf("k%d", i), ""} {
			code, got := glPost(t, srv.URL+"/v1/payouts", key, body)
			if want := `{"wei":"` + wei + `"}`; code != 200 || got != want {
				t.Errorf("wei %s (key %q): %d %s, want 200 %s", wei, key, code, bytes.TrimSpace([]byte(got)), want)
			}
		}
	}
}

// glDecodeServer serves POST /v1/x on a transactional route whose handler decodes the body
// into a new value of newV() with DecodeJSON and answers it as encoding/json writes it.
func glDecodeServer(t *testing.T, newV func() any) *httptest.Server {
	t.Helper()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	m, err := idem.New(ctx, idem.Options{DB: pool, Principal: glAlice})
	if err != nil {
		t.Fatal(err)
	}
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		v := newV()
		if !idem.DecodeJSON(w, r, v) {
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(v)
	})
	mux := http.NewServeMux()
	mux.Handle("POST /v1/x", m.Route(idem.Route{})(h))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return srv
}

// TestGoLibDecodeJSONNumberField: json.Number is encoding/json's own way to take an amount
// without a float64's rounding. DecodeJSON's go doc lists what it refuses (unknown, duplicate
// and case-folded members, invalid UTF-8, trailing data, deep nesting, long exponents); a
// struct with a json.Number member is none of them, and encoding/json decodes {"amount":12.50}
// into it. Until D233 DecodeJSON answered every such body 400 malformed_body (final, stored for
// the key); it reads the canonical text into a json.Number now.
func TestGoLibDecodeJSONNumberField(t *testing.T) {
	t.Parallel()
	type order struct {
		Amount json.Number `json:"amount"`
	}
	srv := glDecodeServer(t, func() any { return new(order) })
	var direct order
	if err := json.Unmarshal([]byte(`{"amount":12.50}`), &direct); err != nil || direct.Amount != "12.50" {
		t.Fatalf("encoding/json: %q %v", direct.Amount, err)
	}
	for _, key := range []string{"k1", ""} {
		code, body := glPost(t, srv.URL+"/v1/x", key, `{"amount":12.50}`)
		if code != 200 || strings.TrimSpace(body) != `{"amount":12.5}` {
			t.Errorf("key %q: %d %s, want 200 {\"amount\":12.5} (the canonical 12.5)", key, code, strings.TrimSpace(body))
		}
	}
}

// TestGoLibDecodeJSONDurationField: a time.Duration member, which encoding/json takes as a
// number of nanoseconds, made DecodeJSON refuse every body that carried it (go-json-experiment
// has "no default representation" for it): 400 malformed_body, final. Read as encoding/json
// reads it since D233.
func TestGoLibDecodeJSONDurationField(t *testing.T) {
	t.Parallel()
	type job struct {
		Timeout time.Duration `json:"timeout"`
	}
	srv := glDecodeServer(t, func() any { return new(job) })
	var direct job
	if err := json.Unmarshal([]byte(`{"timeout":5000000000}`), &direct); err != nil || direct.Timeout != 5*time.Second {
		t.Fatalf("encoding/json: %v %v", direct.Timeout, err)
	}
	code, body := glPost(t, srv.URL+"/v1/x", "k1", `{"timeout":5000000000}`)
	if code != 200 || strings.TrimSpace(body) != `{"timeout":5000000000}` {
		t.Errorf("%d %s, want 200 {\"timeout\":5000000000}", code, strings.TrimSpace(body))
	}
}

// TestGoLibStepOutsideLeaseWork: "Step outside the work of a lease returns ErrNoSteps", and
// so does ErrNoSteps's own doc ("Step called outside the work of a lease (a lease route's
// handler, DoLease's fn)"): a transactional route's handler and Do's fn are not the work of a
// lease, and fn must not run.
func TestGoLibStepOutsideLeaseWork(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 6)
	m, err := idem.New(ctx, idem.Options{DB: pool, Principal: glAlice})
	if err != nil {
		t.Fatal(err)
	}
	var ran atomic.Int32
	step := func(ctx context.Context) error {
		_, err := idem.Step(ctx, "s", func(ctx context.Context, tx pgx.Tx) (int, error) { ran.Add(1); return 1, nil })
		return err
	}
	var got []error
	var mu sync.Mutex
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		err := step(r.Context())
		mu.Lock()
		got = append(got, err)
		mu.Unlock()
		w.WriteHeader(http.StatusCreated)
	})
	mux := http.NewServeMux()
	mux.Handle("POST /v1/tx", m.Route(idem.Route{})(h))
	srv := httptest.NewServer(mux)
	defer srv.Close()
	glPost(t, srv.URL+"/v1/tx", "k1", `{}`)
	glPost(t, srv.URL+"/v1/tx", "", `{}`)
	_, _, err = idem.Do(ctx, pool, idem.Job{Principal: "p", Key: "k", Action: "a"}, idem.TxOptions{},
		func(ctx context.Context, tx pgx.Tx) (int, error) {
			mu.Lock()
			got = append(got, step(ctx))
			mu.Unlock()
			return 1, nil
		})
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 3 {
		t.Fatalf("%d calls, want 3", len(got))
	}
	for i, err := range got {
		if !errors.Is(err, idem.ErrNoSteps) {
			t.Errorf("call %d: %v, want ErrNoSteps", i, err)
		}
	}
	if ran.Load() != 0 {
		t.Errorf("fn ran %d times outside the work of a lease", ran.Load())
	}
}

// TestGoLibRefuseInProgressIsNotStored: a keyed request's handler calls idem.Do for work that
// another caller still runs, and gets ErrInProgress, whose doc says "Answer 409 and let the
// client retry"; the handler answers it with the middleware's own problem for that case,
// Refuse(CodeInProgress) ("409 with Retry-After, a request with the key is still running";
// Refuse takes any Code constant). The client's retry, once the other run ended, must run the
// request: a "request_in_progress" answer is not the request's outcome. Until D233 the 409 was
// stored as the key's final answer (409 is in DefaultFinalStatus) and every retry got it
// replayed, for the key's TTL; the first 409 also had no Retry-After.
func TestGoLibRefuseInProgressIsNotStored(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 8)
	m, err := idem.New(ctx, idem.Options{DB: pool, Principal: glAlice})
	if err != nil {
		t.Fatal(err)
	}
	job := idem.Job{Principal: "sync", Key: "nightly", Action: "sync", LockTimeout: 200 * time.Millisecond}
	work := func(ctx context.Context, tx pgx.Tx) (int, error) { return 7, nil }
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		v, _, err := idem.Do(r.Context(), pool, job, idem.TxOptions{}, work)
		switch {
		case errors.Is(err, idem.ErrInProgress):
			idem.Refuse(w, r, idem.CodeInProgress, "the sync is running; retry")
			return
		case err != nil:
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"v":%d}`, v)
	})
	mux := http.NewServeMux()
	mux.Handle("POST /v1/sync", m.Route(idem.Route{})(h))
	srv := httptest.NewServer(mux)
	defer srv.Close()

	// Another caller holds the job: its fn runs until released.
	release, entered := make(chan struct{}), make(chan struct{})
	done := make(chan error, 1)
	go func() {
		_, _, err := idem.Do(ctx, pool, job, idem.TxOptions{}, func(ctx context.Context, tx pgx.Tx) (int, error) {
			close(entered)
			<-release
			return 7, nil
		})
		done <- err
	}()
	<-entered
	req, _ := http.NewRequest(http.MethodPost, srv.URL+"/v1/sync", strings.NewReader(`{}`))
	req.Header.Set("Idempotency-Key", "k1")
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		close(release)
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	close(release)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != http.StatusConflict {
		t.Fatalf("first: %d, want 409", resp.StatusCode)
	}
	if resp.Header.Get("Retry-After") == "" {
		t.Errorf("the 409 request_in_progress has no Retry-After (CodeInProgress: \"409 with Retry-After\")")
	}
	code, body := glPost(t, srv.URL+"/v1/sync", "k1", `{}`)
	if code != 200 || body != `{"v":7}` {
		t.Errorf("the retry after the other run ended: %d %s, want 200 {\"v\":7}: the key kept request_in_progress as its answer", code, strings.TrimSpace(body))
	}
}

type glEmbedded struct {
	Inner string `json:"inner"`
}

type glExotic struct {
	glEmbedded
	At    time.Time       `json:"at"`
	N     *big.Int        `json:"n"`
	Raw   json.RawMessage `json:"raw"`
	S     int64           `json:"s,string"`
	Empty string          `json:"empty,omitempty"`
	F     float64         `json:"f"`
	M     map[string]int  `json:"m"`
}

// TestGoLibDoExoticResultReplays: a Do result of types a Go service returns (an embedded
// struct, time.Time with its monotonic reading, *big.Int past 2^64, json.RawMessage, ",string"
// and ",omitempty" tags, -0 and large floats) replays as the same JSON, and NaN is refused.
func TestGoLibDoExoticResultReplays(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	n, _ := new(big.Int).SetString("123456789012345678901234567890", 10)
	first := glExotic{glEmbedded: glEmbedded{"x"}, At: time.Now(), N: n, Raw: json.RawMessage(`{"b":1,"a":[1,2]}`),
		S: 1 << 60, F: 1e300, M: map[string]int{"z": 1, "a": 2}}
	job := idem.Job{Principal: "p", Key: "exotic", Action: "a"}
	got1, replayed, err := idem.Do(ctx, pool, job, idem.TxOptions{}, func(ctx context.Context, tx pgx.Tx) (glExotic, error) { return first, nil })
	if err != nil || replayed {
		t.Fatal(err, replayed)
	}
	got2, replayed, err := idem.Do(ctx, pool, job, idem.TxOptions{}, func(ctx context.Context, tx pgx.Tx) (glExotic, error) {
		t.Error("fn ran again")
		return glExotic{}, nil
	})
	if err != nil || !replayed {
		t.Fatal(err, replayed)
	}
	j1, _ := json.Marshal(got1)
	j2, _ := json.Marshal(got2)
	if !bytes.Equal(j1, j2) || !got1.At.Equal(got2.At) || got1.N.Cmp(got2.N) != 0 {
		t.Errorf("replay differs:\n%s\n%s", j1, j2)
	}
	_, _, err = idem.Do(ctx, pool, idem.Job{Principal: "p", Key: "nan", Action: "a"}, idem.TxOptions{},
		func(ctx context.Context, tx pgx.Tx) (float64, error) { return glNaN(), nil })
	if !errors.Is(err, idem.ErrInvalidArgument) {
		t.Errorf("NaN result: %v, want ErrInvalidArgument", err)
	}
}

func glNaN() float64 { var z float64; return z / z }

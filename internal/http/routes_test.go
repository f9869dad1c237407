package idemhttp_test

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/gorilla/mux"

	"github.com/pgidem/pgidem/internal/canon"
	idemhttp "github.com/pgidem/pgidem/internal/http"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestEveryFinalStatusIsStored: each status of the final list is rolled back and stored
// (and replayed); a 2xx answered after a step-up 401 is stored like any other.
func TestEveryFinalStatusIsStored(t *testing.T) {
	t.Parallel()
	a := newApp(t, nil)
	for _, status := range []int{400, 403, 404, 409, 410, 412, 413, 415, 422} {
		key := fmt.Sprintf("final-%d", status)
		body := fmt.Sprintf(`{"amount":%d,"status":%d}`, status, status)
		first := a.do("POST", "/transfers", "alice", key, body)
		again := a.do("POST", "/transfers", "alice", key, body)
		if first.status != status || again.status != status || again.body != first.body || again.header.Get("Idempotent-Replayed") != "true" {
			t.Errorf("%d: first %+v, again %+v", status, first, again)
		}
	}
	if a.effects() != 0 || a.runs.Load() != 9 {
		t.Fatalf("%d effects, %d runs; want 0 and 9", a.effects(), a.runs.Load())
	}
	if r := a.do("POST", "/transfers", "alice", "up", `{"amount":7,"step_up":true}`); r.status != 401 {
		t.Fatalf("step-up: %+v", r)
	}
	ok := a.do("POST", "/transfers", "alice", "up", `{"amount":7,"step_up":true}`, "X-Step-Up", "otp")
	again := a.do("POST", "/transfers", "alice", "up", `{"amount":7,"step_up":true}`)
	if ok.status != 201 || again.status != 201 || again.body != ok.body || again.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("after the step-up: %+v then %+v, want the stored 201", ok, again)
	}
}

// TestStoredProblemKeepsItsCorrelationID: a replayed stored problem carries the first
// request's correlation id in its body (it is that request's answer), while the replay's
// header names the current request.
func TestStoredProblemKeepsItsCorrelationID(t *testing.T) {
	t.Parallel()
	a := newApp(t, nil)
	a.do("POST", "/transfers", "alice", "p1", `{"status":422,"problem":true}`, "X-Request-Id", "first-req")
	r := a.do("POST", "/transfers", "alice", "p1", `{"status":422,"problem":true}`, "X-Request-Id", "second-req")
	if r.status != 422 || !strings.Contains(r.body, `"correlation_id":"first-req"`) || r.header.Get("X-Request-Id") != "second-req" {
		t.Fatalf("%+v", r)
	}
}

// TestETagIsReplayed: ETag is among the stored headers.
func TestETagIsReplayed(t *testing.T) {
	t.Parallel()
	a := newApp(t, nil)
	first := a.do("POST", "/transfers", "alice", "e1", `{"amount":1,"etag":"\"v7\""}`)
	again := a.do("POST", "/transfers", "alice", "e1", `{"amount":1,"etag":"\"v7\""}`)
	if first.header.Get("ETag") != `"v7"` || again.header.Get("ETag") != `"v7"` || again.header.Get("X-Not-Stored") != "" {
		t.Fatalf("first %v, again %v", first.header, again.header)
	}
}

// TestCustomFingerprint: a route whose meaning is narrower than its body fingerprints only
// what matters: two bodies that differ in an ignored member are the same request.
func TestCustomFingerprint(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 8)
	m, err := idemhttp.New(idemhttp.Options{DB: pool, Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
		Principal: func(*http.Request) (string, bool) { return "alice", true }})
	if err != nil {
		t.Fatal(err)
	}
	amountOnly := func(r *http.Request, body []byte) canon.Fingerprint {
		var v struct{ Amount int }
		_ = json.Unmarshal(body, &v)
		return canon.Compute(r.Method, r.URL.EscapedPath(), []byte(fmt.Sprint(v.Amount)))
	}
	runs := 0
	h := m.Route(idemhttp.Route{Fingerprint: amountOnly})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs++
		w.WriteHeader(201)
		fmt.Fprintf(w, "run %d", runs)
	}))
	r := mux.NewRouter()
	r.Handle("/pay", h).Methods("POST")
	srv := httptest.NewServer(r)
	defer srv.Close()
	post := func(body string) (int, string) {
		req, _ := http.NewRequest("POST", srv.URL+"/pay", strings.NewReader(body))
		req.Header.Set("Idempotency-Key", "k")
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer res.Body.Close()
		b, _ := io.ReadAll(res.Body)
		return res.StatusCode, string(b)
	}
	s1, b1 := post(`{"Amount":5,"note":"a"}`)
	s2, b2 := post(`{"Amount":5,"note":"b"}`)
	s3, _ := post(`{"Amount":6,"note":"a"}`)
	if s1 != 201 || s2 != 201 || b2 != b1 || s3 != 422 || runs != 1 {
		t.Fatalf("%d %q, %d %q, %d; %d runs", s1, b1, s2, b2, s3, runs)
	}
}

// TestLeaseRouteLifecycle: a lease route ends its lease on a 5xx without freeing the key (the
// retry of the same request runs at once, in the same generation, with the same provider key;
// another request under the key is refused), stores an answer even when the client went away
// meanwhile, and answers 409 while the lease runs.
func TestLeaseRouteLifecycle(t *testing.T) {
	t.Parallel()
	obs := newObserver()
	a := newApp(t, func(o *idemhttp.Options) { o.Metrics = obs })
	if r := a.do("POST", "/jobs", "alice", "j1", `{"status":503}`); r.status != 503 {
		t.Fatalf("failing job: %+v", r)
	}
	if n := a.count(`SELECT count(*) FROM idem.idempotency_keys WHERE key = 'j1' AND state = 'p' AND lease_expires_at <= now()`); n != 1 {
		t.Fatal("a 5xx did not end the lease (or freed the key)")
	}
	first := a.provider.Load()
	if r := a.do("POST", "/jobs", "alice", "j1", `{"status":503}`); r.status != 503 || a.runs.Load() != 2 {
		t.Fatalf("the retry after a failed lease did not run at once: %+v, %d runs", r, a.runs.Load())
	}
	if again := a.provider.Load(); first == nil || again == nil || *first != *again || len(*first) != 64 {
		t.Fatalf("the retry's provider key %v, want the failed attempt's %v", again, first)
	}
	if r := a.do("POST", "/jobs", "alice", "j1", `{"status":201}`); r.status != 422 {
		t.Fatalf("another request under a failed lease's key: %+v, want 422", r)
	}

	// The client goes away while the job works; the job's answer is still recorded.
	ctx, cancel := context.WithCancel(context.Background())
	gone := make(chan reply, 1)
	go func() { gone <- a.doCtx(ctx, "POST", "/jobs", "alice", "j2", `{"block":true}`) }()
	<-a.started
	busy := a.do("POST", "/jobs", "alice", "j2", `{"block":true}`)
	if busy.status != 409 || problemCode(t, busy) != idemhttp.CodeInProgress || busy.header.Get("Retry-After") == "" {
		t.Fatalf("while the lease runs: %+v", busy)
	}
	cancel()
	<-gone
	a.unblock()
	deadline := time.Now().Add(5 * time.Second)
	for a.count(`SELECT count(*) FROM idem.idempotency_keys WHERE key = 'j2' AND state = 'c'`) == 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	r := a.do("POST", "/jobs", "alice", "j2", `{"block":true}`)
	if r.status != 202 || r.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("after the cancelled client: %+v, want the recorded 202", r)
	}
	if got := obs.counts(); got["busy"] != 1 || got["acquired"] != 3 || got["replayed"] != 1 {
		t.Fatalf("states %v", got)
	}
}

// TestMetricStatesForBusyAndOversize: a request refused while another holds its key counts
// busy; a response too large to store counts oversize on top of acquired.
func TestMetricStatesForBusyAndOversize(t *testing.T) {
	t.Parallel()
	obs := newObserver()
	a := newApp(t, func(o *idemhttp.Options) {
		o.Metrics = obs
		o.LockTimeout = 100 * time.Millisecond
	})
	done := make(chan reply, 1)
	go func() { done <- a.do("POST", "/transfers", "alice", "k1", `{"amount":1,"block":true}`) }()
	<-a.started
	if r := a.do("POST", "/transfers", "alice", "k1", `{"amount":1,"block":true}`); r.status != 409 {
		t.Fatalf("%+v", r)
	}
	a.unblock()
	<-done
	a.do("POST", "/transfers", "alice", "big", `{"big":true}`)
	if got := obs.counts(); got["busy"] != 1 || got["oversize"] != 1 || got["acquired"] != 2 {
		t.Fatalf("states %v", got)
	}
}

// TestGoldenFingerprint: the exact fingerprint of a fixed request, so that a change to the
// canonical form cannot pass unnoticed (it would turn every stored key into a mismatch).
func TestGoldenFingerprint(t *testing.T) {
	t.Parallel()
	fp := canon.Compute("post", "/v1/transfers", []byte(`{ "to": 2, "amount": 1.50, "from": 1, "memo": "caf\u00e9 \ud83d\ude00" }`))
	want := sha256.Sum256([]byte("POST\n/v1/transfers\n" + `{"amount":1.5,"from":1,"memo":"café 😀","to":2}`))
	if fp.Sum != want {
		t.Fatalf("fingerprint %x, want %x", fp.Sum, want)
	}
	const golden = "f4174b65a6e98b50b4a6312c89d9bf909c821f2e67816d68f9a829b5353004bb"
	if got := fmt.Sprintf("%x", fp.Sum); got != golden {
		t.Fatalf("fingerprint %s, want the golden %s", got, golden)
	}
	if fp.Fields["amount"] != fmt.Sprintf("%x", sha256.Sum256([]byte("1.5"))) {
		t.Fatalf("field hash of amount: %s", fp.Fields["amount"])
	}
}

package idem_test

import (
	"context"
	"errors"
	"fmt"
	"io"
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

// TestUnkeyedLeaseRequestAfterShutdownDoesNotStart: a request without a key on a lease route
// that came after Shutdown's deadline had passed ran its handler on a work context that the
// tracker ended only through context.AfterFunc, which on an already-ended tracker calls back
// in a goroutine of its own: the handler started with a live context (and called its provider)
// and had it ended under it a moment later with ErrShutdown, in 50 of 50 rounds (D179). Such a
// request is refused before its handler now, 503 shutting_down, as a keyed one is.
func TestUnkeyedLeaseRequestAfterShutdownDoesNotStart(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	const rounds = 50
	var live, ended, endedLater int
	var answers = map[string]int{}
	for range rounds {
		m, err := idem.New(ctx, idem.Options{DB: pool, Principal: alice})
		if err != nil {
			t.Fatal(err)
		}
		var sawLive atomic.Bool
		var laterCause atomic.Value
		h := m.Route(idem.Route{Action: "POST /pay", Lease: 5 * time.Second})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.Context().Err() != nil {
				return // the work was ended before it began: answer nothing
			}
			sawLive.Store(true) // the "provider" is called here
			select {
			case <-r.Context().Done():
				laterCause.Store(context.Cause(r.Context()))
				return
			case <-time.After(300 * time.Millisecond):
			}
			w.WriteHeader(201)
		}))
		sctx, cancel := context.WithCancel(ctx)
		cancel()
		if err := m.Shutdown(sctx); !errors.Is(err, context.Canceled) {
			t.Fatalf("Shutdown: %v", err)
		}
		req := httptest.NewRequest("POST", "/pay", strings.NewReader(`{"a":1}`))
		req.Header.Set("Content-Type", "application/json")
		w := httptest.NewRecorder()
		h.ServeHTTP(w, req)
		answers[strings.TrimSpace(w.Result().Status)+" "+codeOf(w.Body.String())]++
		if sawLive.Load() {
			live++
			if c, _ := laterCause.Load().(error); errors.Is(c, idem.ErrShutdown) {
				endedLater++
			}
		} else {
			ended++
		}
	}
	t.Logf("after Shutdown's deadline, %d rounds: handler saw a live context in %d (its context then ended with ErrShutdown under it in %d), an ended one in %d; answers %v",
		rounds, live, endedLater, ended, answers)
	if live > 0 {
		t.Errorf("an unkeyed lease request that came after Shutdown's deadline started its handler on a live context in %d of %d rounds "+
			"(then ended with ErrShutdown mid-work in %d); answers %v", live, rounds, endedLater, answers)
	}
	if n := answers["503 Service Unavailable "+idem.CodeShuttingDown]; n != rounds {
		t.Errorf("%d of %d rounds answered 503 %s: %v", n, rounds, idem.CodeShuttingDown, answers)
	}
}

// codeOf extracts a problem's code from a body, or "".
func codeOf(body string) string {
	i := strings.Index(body, `"code":"`)
	if i < 0 {
		return ""
	}
	rest := body[i+len(`"code":"`):]
	if j := strings.IndexByte(rest, '"'); j >= 0 {
		return rest[:j]
	}
	return ""
}

// blockingObserver blocks Count(acquired) of the first fresh claim until released: it holds
// open the gap between a lease claim's COMMIT and the start of its work.
type blockingObserver struct {
	recorder
	in, release chan struct{}
	once        sync.Once
}

func (b *blockingObserver) Count(a string, s idem.State) {
	if s == idem.StateAcquired && a == "POST /pay" {
		b.once.Do(func() {
			close(b.in)
			<-b.release
		})
	}
	b.recorder.Count(a, s)
}

// TestLeaseWorkDoesNotStartAfterShutdownsDeadline: a keyed lease request whose claim committed
// just before Shutdown's deadline, and whose work started after it (the gap held open by an
// observer that takes its time over Count(acquired); it exists without one, between the claim's
// COMMIT and the work's start), ran its handler on a context not ended yet: the tracker reached
// it only through an AfterFunc goroutine. A handler that checked its context first went on to
// do the work, and its 201 was recorded after the deadline, in 26 to 29 of 30 rounds (D179).
// The work does not start now: the claim is given up, and the client told 503 shutting_down.
func TestLeaseWorkDoesNotStartAfterShutdownsDeadline(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	const rounds = 30
	var live int
	var answers = map[string]int{}
	for i := range rounds {
		obs := &blockingObserver{in: make(chan struct{}), release: make(chan struct{})}
		m, err := idem.New(ctx, idem.Options{DB: pool, Principal: alice, Metrics: obs})
		if err != nil {
			t.Fatal(err)
		}
		var sawLive atomic.Bool
		h := m.Route(idem.Route{Action: "POST /pay", Lease: 5 * time.Second})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.Context().Err() != nil {
				return // ended before it began: nothing done
			}
			sawLive.Store(true)
			w.WriteHeader(201) // the provider was paid
		}))
		probeH := m.Route(idem.Route{Action: "POST /probe"})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.WriteHeader(201)
		}))
		key := "L" + string(rune('a'+i%26)) + string(rune('a'+i/26))
		req := httptest.NewRequest("POST", "/pay", strings.NewReader(`{"a":1}`))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", key)
		w := httptest.NewRecorder()
		served := make(chan struct{})
		go func() { defer close(served); h.ServeHTTP(w, req) }()
		shutdownWait(t, obs.in, "the claim's count")
		sctx, cancel := context.WithCancel(ctx)
		serr := make(chan error, 1)
		go func() { serr <- m.Shutdown(sctx) }()
		cancel()
		// Shutdown's deadline has passed; wait until the tracker is stopped for sure.
		deadline := time.Now().Add(5 * time.Second)
		for n := 0; ; n++ {
			probe := httptest.NewRequest("POST", "/probe", strings.NewReader(`{"a":2}`))
			probe.Header.Set("Idempotency-Key", fmt.Sprintf("probe-%s-%d", key, n))
			pw := httptest.NewRecorder()
			probeH.ServeHTTP(pw, probe)
			if pw.Code == 503 || time.Now().After(deadline) {
				break
			}
		}
		close(obs.release)
		<-served
		<-serr
		answers[strings.TrimSpace(w.Result().Status)+" "+codeOf(w.Body.String())]++
		if sawLive.Load() {
			live++
		}
	}
	stored := pgtest.Count(t, pool, `SELECT count(*) FROM idem.idempotency_keys WHERE key LIKE 'L%' AND state = 'completed'`)
	held := pgtest.Count(t, pool, `SELECT count(*) FROM idem.idempotency_keys WHERE key LIKE 'L%' AND state <> 'completed' AND lease_expires_at > now()`)
	t.Logf("%d rounds: the handler saw a live context in %d; answers %v; %d answers stored", rounds, live, answers, stored)
	if live > 0 || stored > 0 {
		t.Errorf("lease work that began after Shutdown's deadline ran on a live context in %d of %d rounds; answers %v; %d 201s stored after the deadline",
			live, rounds, answers, stored)
	}
	if n := answers["503 Service Unavailable "+idem.CodeShuttingDown]; n != rounds || held > 0 {
		t.Errorf("%d of %d rounds answered 503 %s (%v); %d claims still held: not given up", n, rounds, idem.CodeShuttingDown, answers, held)
	}
}

// TestShutdownWaitsForAKeyedRequestInItsPrincipal: the middleware counted a keyed request for
// Shutdown from its key check, after Options.Principal ran. A principal function that reads the
// body (a form's access_token, RFC 6750 section 2.2, which the middleware supports, D178) of a
// slow upload, or looks its token up in a database, left a received request uncounted:
// Shutdown returned nil ("nothing in flight"), and the request then claimed its key and ran its
// handler (D160's window, before the key check; D179). A request carrying a key is counted
// before its principal function now. The gap is held open by the request's body, which the
// test sends in two parts.
func TestShutdownWaitsForAKeyedRequestInItsPrincipal(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	principalIn := make(chan struct{})
	var once sync.Once
	m, err := idem.New(ctx, idem.Options{DB: pool, Principal: func(r *http.Request) (string, bool) {
		once.Do(func() { close(principalIn) })
		tok := r.FormValue("access_token") // reads the body to its end
		return "alice", tok != ""
	}})
	if err != nil {
		t.Fatal(err)
	}
	var ranAt atomic.Int64
	h := m.Route(idem.Route{Action: "POST /t"})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ranAt.Store(time.Now().UnixNano())
		w.WriteHeader(201)
	}))
	pr, pw := io.Pipe()
	req := httptest.NewRequest("POST", "/t", pr)
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	req.Header.Set("Idempotency-Key", "P1")
	w := httptest.NewRecorder()
	served := make(chan struct{})
	go func() { defer close(served); h.ServeHTTP(w, req) }()
	shutdownWait(t, principalIn, "the principal function")
	if _, err := pw.Write([]byte("access_token=t0k")); err != nil {
		t.Fatal(err)
	}
	sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- m.Shutdown(sctx) }()
	var serr error
	var returnedAt time.Time
	early := false
	select {
	case serr = <-done:
		early, returnedAt = true, time.Now()
	case <-time.After(500 * time.Millisecond):
	}
	_, _ = pw.Write([]byte("&amount=1"))
	_ = pw.Close()
	<-served
	if !early {
		if err := <-done; err != nil {
			t.Fatalf("Shutdown: %v", err)
		}
		return
	}
	ran := ranAt.Load()
	t.Logf("Shutdown returned %v at once; the request got %d %s; handler ran after it: %v", serr, w.Code, strings.TrimSpace(w.Body.String()),
		ran != 0 && time.Unix(0, ran).After(returnedAt))
	if serr == nil && ran != 0 && time.Unix(0, ran).After(returnedAt) {
		t.Errorf("Shutdown returned nil while a keyed request it had received was in its principal function (reading its body); "+
			"the request then claimed its key and ran its handler after Shutdown returned nil (answer %d, %d key(s) stored)",
			w.Code, pgtest.Count(t, pool, `SELECT count(*) FROM idem.idempotency_keys WHERE key = 'P1'`))
	}
}

// TestShutdownWaitsForAnUnkeyedLeaseRequestReadingItsBody: a request without a key on a lease
// route was counted for Shutdown only once its body had been read (request.unkeyed), so one
// whose body was still arriving when Shutdown was called was not waited for: Shutdown returned
// nil at once, and the handler then ran after it, its lease work on a context that the
// caller's cancel of Shutdown's context ended at once with ErrShutdown, without the grace
// (D179). Every request to a lease route is counted from its start now. The gap is held open by
// the body, sent in two parts.
func TestShutdownWaitsForAnUnkeyedLeaseRequestReadingItsBody(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	m, err := idem.New(ctx, idem.Options{DB: pool, Principal: alice})
	if err != nil {
		t.Fatal(err)
	}
	hIn, hGo := make(chan struct{}), make(chan struct{})
	var cause atomic.Value
	var ranAt atomic.Int64
	h := m.Route(idem.Route{Action: "POST /pay", Lease: 5 * time.Second})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ranAt.Store(time.Now().UnixNano())
		close(hIn)
		select {
		case <-hGo:
			w.WriteHeader(201)
		case <-r.Context().Done():
			cause.Store(context.Cause(r.Context()))
		}
	}))
	pr, pw := io.Pipe()
	req := httptest.NewRequest("POST", "/pay", pr)
	req.Header.Set("Content-Type", "application/json")
	w := httptest.NewRecorder()
	served := make(chan struct{})
	go func() { defer close(served); h.ServeHTTP(w, req) }()
	if _, err := pw.Write([]byte(`{"amount":`)); err != nil { // the middleware is reading the body
		t.Fatal(err)
	}
	sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- m.Shutdown(sctx) }()
	var serr error
	var returnedAt time.Time
	early := false
	select {
	case serr = <-done:
		early, returnedAt = true, time.Now()
	case <-time.After(500 * time.Millisecond):
	}
	_, _ = pw.Write([]byte(`1}`))
	_ = pw.Close()
	shutdownWait(t, hIn, "the handler")
	if early {
		cancel() // the usual caller: Shutdown returned, its deadline's context is cancelled
	}
	select {
	case <-served:
	case <-time.After(2 * time.Second):
		close(hGo)
		<-served
	}
	if !early {
		if err := <-done; err != nil {
			t.Fatalf("Shutdown: %v", err)
		}
		return
	}
	c, _ := cause.Load().(error)
	t.Logf("Shutdown returned %v at once; handler ran after it: %v; its context's cause: %v; answer %d %s", serr,
		time.Unix(0, ranAt.Load()).After(returnedAt), c, w.Code, strings.TrimSpace(w.Body.String()))
	if serr == nil && time.Unix(0, ranAt.Load()).After(returnedAt) {
		t.Errorf("Shutdown returned nil while an unkeyed lease request was reading its body; its handler ran after Shutdown returned "+
			"and was ended by the caller's cancel (cause %v, no grace): answer %d %s", c, w.Code, strings.TrimSpace(w.Body.String()))
	}
}

package idemclient_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pgidem/pgidem/idemclient"
)

// TestConvergesThroughEveryFault: one operation meets, in turn,
// 409 request_in_progress (five times), 503 with odd Retry-After values, proxy 500/502/504
// without problem JSON, a connection cut after the body was read, a response cut mid-body
// (Content-Length and chunked), a 200 that is a replay; over HTTP/1.1 and HTTP/2. Every
// attempt carries the same key and the same body bytes; the answer is the replay.
func TestConvergesThroughEveryFault(t *testing.T) {
	steps := []func(w http.ResponseWriter){}
	inProgress := func(w http.ResponseWriter) {
		w.Header().Set("Content-Type", "application/problem+json")
		w.Header().Set("Retry-After", "0")
		w.WriteHeader(409)
		io.WriteString(w, `{"status":409,"code":"request_in_progress"}`)
	}
	for range 5 {
		steps = append(steps, inProgress)
	}
	for _, ra := range []string{"1e12", "-3", "0.5", "Tue, 01 Jan 1980 00:00:00 GMT", "soon"} {
		steps = append(steps, func(w http.ResponseWriter) { w.Header().Set("Retry-After", ra); w.WriteHeader(503) })
	}
	for _, st := range []int{500, 502, 504} {
		steps = append(steps, func(w http.ResponseWriter) {
			w.Header().Set("Content-Type", "text/html")
			w.WriteHeader(st)
			io.WriteString(w, "<html>Bad Gateway</html>")
		})
	}
	steps = append(steps,
		func(w http.ResponseWriter) { panic(http.ErrAbortHandler) }, // cut after the body was read, nothing answered
		func(w http.ResponseWriter) { // a final answer cut mid-body, with a Content-Length
			w.Header().Set("Content-Length", "100")
			w.WriteHeader(201)
			io.WriteString(w, `{"id":`)
			w.(http.Flusher).Flush()
			panic(http.ErrAbortHandler)
		},
		func(w http.ResponseWriter) { // chunked, cut
			w.WriteHeader(201)
			io.WriteString(w, `{"id":`)
			w.(http.Flusher).Flush()
			panic(http.ErrAbortHandler)
		},
		func(w http.ResponseWriter) {
			w.Header().Set("Idempotent-Replayed", "true")
			w.WriteHeader(201)
			io.WriteString(w, `{"id":7}`)
		})
	for _, h2 := range []bool{false, true} {
		t.Run(fmt.Sprintf("h2=%v", h2), func(t *testing.T) {
			var mu sync.Mutex
			var seen []string
			srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				b, _ := io.ReadAll(r.Body)
				mu.Lock()
				seen = append(seen, r.Header.Get("Idempotency-Key")+"|"+string(b))
				n := len(seen)
				mu.Unlock()
				steps[min(n, len(steps))-1](w)
			}))
			srv.EnableHTTP2 = h2
			if h2 {
				srv.StartTLS()
			} else {
				srv.Start()
			}
			defer srv.Close()
			srv.Config.ErrorLog = nil
			c := &idemclient.Client{HTTP: srv.Client(), Backoff: time.Millisecond, MaxBackoff: 5 * time.Millisecond, MaxAttempts: -1}
			pr, pw := io.Pipe() // a body without GetBody
			go func() { pw.Write([]byte(`{"amount":5}`)); pw.Close() }()
			req, _ := http.NewRequest("POST", srv.URL+"/x", pr)
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			start := time.Now()
			res, err := c.Do(ctx, req, "")
			mu.Lock()
			defer mu.Unlock()
			t.Logf("%d in %s, %d attempts, %d requests", res.Status, time.Since(start), res.Attempts, len(seen))
			if err != nil || res.Status != 201 || !res.Replayed || string(res.Body) != `{"id":7}` || len(seen) != len(steps) {
				t.Fatalf("%d %q replayed %v err %v; %d requests, want %d", res.Status, res.Body, res.Replayed, err, len(seen), len(steps))
			}
			for i, s := range seen {
				if s != res.Key+`|{"amount":5}` {
					t.Fatalf("request %d: %q, want key %s and the same body", i+1, s, res.Key)
				}
			}
		})
	}
}

// TestSameKeyTwoGoroutines: two Do calls under one key at once against a server
// that answers 409 request_in_progress to the second while the first runs: both end with the
// first's answer.
func TestSameKeyTwoGoroutines(t *testing.T) {
	var mu sync.Mutex
	state := map[string]string{} // key -> "running" or the stored answer
	release := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		k := r.Header.Get("Idempotency-Key")
		mu.Lock()
		s, ok := state[k]
		if !ok {
			state[k] = "running"
		}
		mu.Unlock()
		switch {
		case !ok:
			<-release
			mu.Lock()
			state[k] = "done"
			mu.Unlock()
			w.WriteHeader(201)
		case s == "running":
			w.Header().Set("Retry-After", "0")
			w.WriteHeader(409)
			io.WriteString(w, `{"code":"request_in_progress"}`)
		default:
			w.Header().Set("Idempotent-Replayed", "true")
			w.WriteHeader(201)
		}
	}))
	defer srv.Close()
	c := &idemclient.Client{Backoff: 5 * time.Millisecond, MaxBackoff: 20 * time.Millisecond, MaxAttempts: -1}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	key := idemclient.NewKey()
	var wg sync.WaitGroup
	results := make([]idemclient.Result, 2)
	errs := make([]error, 2)
	for i := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			req, _ := http.NewRequest("POST", srv.URL+"/x", strings.NewReader(`{}`))
			results[i], errs[i] = c.Do(ctx, req, key)
		}()
	}
	time.AfterFunc(200*time.Millisecond, func() { close(release) })
	wg.Wait()
	for i := range 2 {
		if errs[i] != nil || results[i].Status != 201 {
			t.Fatalf("Do %d: %d %v", i, results[i].Status, errs[i])
		}
	}
	if results[0].Replayed == results[1].Replayed {
		t.Fatalf("one of the two is a replay: %v %v", results[0].Replayed, results[1].Replayed)
	}
}

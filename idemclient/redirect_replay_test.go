package idemclient_test

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgidem/pgidem/idemclient"
)

// TestReplayedRedirectThenA503IsRetried: a retry whose answer is a replayed redirect (303 to the
// created resource, or 307 to the same operation elsewhere) follows it with a request of its
// own; that request's 503, which carries no replay mark, leaves the outcome open, and Do
// retries. On the previous code Do returned that 503 as final (err nil, Replayed true): the
// redirect's mark ended the operation. Replayed still reports the mark the redirect carried.
func TestReplayedRedirectThenA503IsRetried(t *testing.T) {
	t.Parallel()
	for _, code := range []int{http.StatusSeeOther, http.StatusTemporaryRedirect} {
		t.Run(http.StatusText(code), func(t *testing.T) {
			t.Parallel()
			var mu sync.Mutex
			var log []string
			var targets atomic.Int32
			mux := http.NewServeMux()
			mux.HandleFunc("/op", func(w http.ResponseWriter, r *http.Request) {
				_, _ = io.Copy(io.Discard, r.Body)
				mu.Lock()
				log = append(log, r.Method+" /op")
				mu.Unlock()
				w.Header().Set("Idempotent-Replayed", "true")
				w.Header().Set("Location", "/target")
				w.WriteHeader(code)
			})
			mux.HandleFunc("/target", func(w http.ResponseWriter, r *http.Request) {
				_, _ = io.Copy(io.Discard, r.Body)
				mu.Lock()
				log = append(log, r.Method+" /target")
				mu.Unlock()
				if targets.Add(1) <= 2 {
					w.Header().Set("Retry-After", "0")
					w.WriteHeader(http.StatusServiceUnavailable)
					return
				}
				w.WriteHeader(http.StatusOK)
				_, _ = io.WriteString(w, `{"id":1}`)
			})
			srv := httptest.NewServer(mux)
			t.Cleanup(srv.Close)
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			req, err := http.NewRequest(http.MethodPost, srv.URL+"/op", strings.NewReader(`{"a":1}`))
			if err != nil {
				t.Fatal(err)
			}
			res, err := (&idemclient.Client{Backoff: time.Millisecond}).Do(ctx, req, "")
			mu.Lock()
			defer mu.Unlock()
			// Each attempt is a POST the server saw (Attempts may count one more: a write
			// net/http found had not gone out). A transient failure on the loopback (a
			// kept-alive connection closed under a request, which net/http writes again on its
			// own, or a redirect's request that never arrived) is one more attempt, as it
			// should be; the /target answers tell the behaviour: two 503s retried, then 200.
			posts := 0
			for _, l := range log {
				if l == "POST /op" {
					posts++
				}
			}
			if err != nil || res.Status != http.StatusOK || !res.Replayed || targets.Load() != 3 || posts < 3 || res.Attempts < posts {
				t.Fatalf("status %d, replayed %v, attempts %d, err %v; want 200 after the two 503s of /target were retried, replayed, an attempt for each POST (requests: %v)",
					res.Status, res.Replayed, res.Attempts, err, log)
			}
		})
	}
}

// TestGetBodyWithoutBodyOrError: a GetBody that returns (nil, nil) for a request with a body is
// refused with an error, nothing sent, as net/http refuses it; on the previous code Do panicked
// (a nil dereference inside it).
func TestGetBodyWithoutBodyOrError(t *testing.T) {
	t.Parallel()
	var hits atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		w.WriteHeader(http.StatusCreated)
	}))
	t.Cleanup(srv.Close)
	req, err := http.NewRequest(http.MethodPost, srv.URL, strings.NewReader("body"))
	if err != nil {
		t.Fatal(err)
	}
	req.GetBody = func() (io.ReadCloser, error) { return nil, nil }
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var res idemclient.Result
	func() {
		defer func() {
			if p := recover(); p != nil {
				t.Fatalf("Do panicked: %v", p)
			}
		}()
		res, err = (&idemclient.Client{}).Do(ctx, req, "")
	}()
	if err == nil || errors.Is(err, idemclient.ErrGaveUp) || !strings.Contains(err.Error(), "GetBody") || res.Attempts != 0 || hits.Load() != 0 {
		t.Fatalf("err %v, attempts %d, requests the server saw %d; want an error naming GetBody, nothing sent", err, res.Attempts, hits.Load())
	}
}

package idemhttp_test

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgidem/pgidem/idemclient"
	idemhttp "github.com/pgidem/pgidem/internal/http"
)

// cutFirstAnswer is a proxy in front of the app: it forwards every request and, for the first
// one, reads the server's whole answer (the work has committed) and then cuts the client's
// connection instead of passing the answer on: a lost response.
func cutFirstAnswer(t *testing.T, target string) *httptest.Server {
	u, _ := url.Parse(target)
	var n atomic.Int32
	p := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		out := r.Clone(context.WithoutCancel(r.Context()))
		out.RequestURI = ""
		out.URL.Scheme, out.URL.Host = u.Scheme, u.Host
		resp, err := http.DefaultTransport.RoundTrip(out)
		if err != nil {
			w.WriteHeader(599)
			return
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if n.Add(1) == 1 {
			conn, _, _ := w.(http.Hijacker).Hijack()
			conn.Close()
			return
		}
		for k, v := range resp.Header {
			w.Header()[k] = v
		}
		w.WriteHeader(resp.StatusCode)
		w.Write(body)
	}))
	t.Cleanup(p.Close)
	return p
}

func clientReq(t *testing.T, url, body string) *http.Request {
	req, err := http.NewRequest("POST", url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("X-Principal", "alice")
	req.Header.Set("Content-Type", "application/json")
	return req
}

// TestReviewClientLostResponseConverges: the server commits, the answer is lost on the way;
// the client retries under the same key and body and gets the first answer, replayed; one
// effect, one key.
func TestReviewClientLostResponseConverges(t *testing.T) {
	t.Parallel()
	a := newApp(t, nil)
	p := cutFirstAnswer(t, a.srv.URL)
	c := &idemclient.Client{Backoff: 10 * time.Millisecond, AttemptTimeout: 5 * time.Second}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	res, err := c.Do(ctx, clientReq(t, p.URL+"/transfers", `{"amount":7}`), "")
	if err != nil || res.Status != 201 || !res.Replayed || res.Attempts != 2 {
		t.Fatalf("%d %v attempts %d replayed %v %s", res.Status, err, res.Attempts, res.Replayed, res.Body)
	}
	if a.effects() != 1 || a.keys() != 1 {
		t.Fatalf("%d effects, %d keys", a.effects(), a.keys())
	}
}

// TestReviewClientMismatchAndBadKeyAreFinal: another body under a used key is 422 (one attempt);
// a key the server refuses (too long, a space) is 400 (one attempt).
func TestReviewClientMismatchAndBadKeyAreFinal(t *testing.T) {
	t.Parallel()
	a := newApp(t, nil)
	c := &idemclient.Client{Backoff: 10 * time.Millisecond}
	ctx := context.Background()
	res, err := c.Do(ctx, clientReq(t, a.srv.URL+"/transfers", `{"amount":7}`), "")
	if err != nil || res.Status != 201 {
		t.Fatalf("%+v %v", res, err)
	}
	res2, err := c.Do(ctx, clientReq(t, a.srv.URL+"/transfers", `{"amount":8}`), res.Key)
	if err != nil || res2.Status != 422 || res2.Attempts != 1 || res2.Code() != "idempotency_key_reuse" {
		t.Fatalf("mismatch: %d %s attempts %d %v", res2.Status, res2.Body, res2.Attempts, err)
	}
	for _, k := range []string{strings.Repeat("k", 256), "a b", "é"} {
		r, err := c.Do(ctx, clientReq(t, a.srv.URL+"/transfers", `{"amount":9}`), k)
		if err != nil || r.Status != 400 || r.Attempts != 1 {
			t.Fatalf("key %q: %d %s attempts %d %v", k, r.Status, r.Body, r.Attempts, err)
		}
	}
}

// TestReviewClientOversizeBodyIsFinal: a body over MaxBodyBytes gets 413 request_too_large, a
// final answer: the client should end after one attempt with the 413, not retry and report
// "outcome unknown" (ErrGaveUp).
func TestReviewClientOversizeBodyIsFinal(t *testing.T) {
	t.Parallel()
	a := newApp(t, nil) // MaxBodyBytes 1024
	c := &idemclient.Client{Backoff: 10 * time.Millisecond, MaxBackoff: 20 * time.Millisecond}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	body := `{"amount":1,"pad":"` + strings.Repeat("x", 8<<20) + `"}`
	res, err := c.Do(ctx, clientReq(t, a.srv.URL+"/transfers", body), "")
	t.Logf("status %d attempts %d err %v", res.Status, res.Attempts, err)
	if err != nil || res.Status != http.StatusRequestEntityTooLarge || res.Attempts != 1 {
		t.Fatalf("an oversize body: status %d, attempts %d, err %v; want 413 after one attempt", res.Status, res.Attempts, err)
	}
}

// TestReviewClientInProgressConverges: a duplicate sent while the first runs, with a short
// DuplicateWait (409 request_in_progress with Retry-After), keeps retrying and gets the first
// answer once it is stored.
func TestReviewClientInProgressConverges(t *testing.T) {
	t.Parallel()
	a := newApp(t, func(o *idemhttp.Options) { o.DuplicateWait = 100 * time.Millisecond })
	key := idemclient.NewKey()
	first := make(chan idemclient.Result, 1)
	c := &idemclient.Client{Backoff: 10 * time.Millisecond, MaxAttempts: -1}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	go func() {
		r, _ := c.Do(ctx, clientReq(t, a.srv.URL+"/transfers", `{"amount":3,"block":true}`), key)
		first <- r
	}()
	<-a.started
	go func() { time.Sleep(1500 * time.Millisecond); a.unblock() }()
	res, err := c.Do(ctx, clientReq(t, a.srv.URL+"/transfers", `{"amount":3,"block":true}`), key)
	f := <-first
	t.Logf("duplicate: %d attempts", res.Attempts)
	if err != nil || res.Status != 201 || !res.Replayed || string(res.Body) != string(f.Body) || res.Attempts < 2 {
		t.Fatalf("duplicate: %d %s %v attempts %d; first %d %s", res.Status, res.Body, err, res.Attempts, f.Status, f.Body)
	}
	if a.effects() != 1 {
		t.Fatalf("%d effects", a.effects())
	}
}

// TestReviewClientImpatientAgainstMiddleware: attempts shorter than the work converge.
func TestReviewClientImpatientAgainstMiddleware(t *testing.T) {
	t.Parallel()
	a := newApp(t, nil)
	c := &idemclient.Client{Backoff: 10 * time.Millisecond, AttemptTimeout: 300 * time.Millisecond, MaxAttempts: -1}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	res, err := c.Do(ctx, clientReq(t, a.srv.URL+"/transfers", `{"amount":3,"sleep_ms":1200}`), "")
	if err != nil || res.Status != 201 || a.effects() != 1 {
		t.Fatalf("%d %v attempts %d effects %d", res.Status, err, res.Attempts, a.effects())
	}
	t.Logf("attempts %d replayed %v", res.Attempts, res.Replayed)
}

// TestReviewClientLostResponseOnLeaseRoute: the same on a lease route (work outside the
// database): the retry replays the stored 202.
func TestReviewClientLostResponseOnLeaseRoute(t *testing.T) {
	t.Parallel()
	a := newApp(t, nil)
	p := cutFirstAnswer(t, a.srv.URL)
	c := &idemclient.Client{Backoff: 10 * time.Millisecond, AttemptTimeout: 5 * time.Second}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	res, err := c.Do(ctx, clientReq(t, p.URL+"/jobs", `{"amount":1}`), "")
	if err != nil || res.Status != 202 || !res.Replayed || res.Attempts != 2 || a.runs.Load() != 1 {
		t.Fatalf("%d %v attempts %d replayed %v runs %d %s", res.Status, err, res.Attempts, res.Replayed, a.runs.Load(), res.Body)
	}
	// A one-time secret whose answer was lost: the retry gets 409 one_time_secret, final, replayed.
	p2 := cutFirstAnswer(t, a.srv.URL)
	res, err = c.Do(ctx, clientReq(t, p2.URL+"/tokens", `{}`), "")
	if err != nil || res.Status != 409 || res.Code() != "one_time_secret" || !res.Replayed || res.Attempts != 2 {
		t.Fatalf("one-time secret: %d %s %v attempts %d", res.Status, res.Body, err, res.Attempts)
	}
}

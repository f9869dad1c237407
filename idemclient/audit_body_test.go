package idemclient_test

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pgidem/pgidem/idemclient"
)

// slowBody yields its bytes one at a time, each after a delay (a stream from another source),
// and is safe for concurrent reads so that the test shows the logic, not a data race.
type slowBody struct {
	mu    sync.Mutex
	data  []byte
	delay time.Duration
}

func (b *slowBody) Read(p []byte) (int, error) {
	time.Sleep(b.delay)
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(b.data) == 0 {
		return 0, io.EOF
	}
	p[0] = b.data[0]
	b.data = b.data[1:]
	return 1, nil
}

// TestAuditBodyAfterContextEndedWhileReading (D169): the docs tell a caller whose Do failed "the
// outcome is unknown (the context ended, or ErrGaveUp): retry later under res.Key". When the
// context ended while Do read a body without GetBody, Do returned (Attempts 0) but left
// req.Body as it was: partly consumed, and still being consumed by the reading goroutine it
// left behind. The retry under res.Key sent what was left of the body ("aon=00" for
// "to=2&amount=1000"), a different operation that the server executed under the key. Such a
// body now refuses every read: the retry sends nothing and says to build the request again.
func TestAuditBodyAfterContextEndedWhileReading(t *testing.T) {
	var mu sync.Mutex
	var got []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		mu.Lock()
		got = append(got, string(b))
		mu.Unlock()
		w.WriteHeader(201)
	}))
	defer srv.Close()
	const body = "to=2&amount=1000"
	req, _ := http.NewRequest("POST", srv.URL+"/x", io.NopCloser(&slowBody{data: []byte(body), delay: 20 * time.Millisecond}))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	c := &idemclient.Client{}
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	res, err := c.Do(ctx, req, "")
	if !errors.Is(err, context.DeadlineExceeded) || res.Attempts != 0 {
		t.Fatalf("first Do: %+v %v; want the deadline, nothing sent", res, err)
	}
	// As the docs say: retry later under res.Key with the same request.
	res2, err := c.Do(context.Background(), req, res.Key)
	mu.Lock()
	t.Logf("retry: status %d err %v; the server received %q", res2.Status, err, got)
	if err == nil || res2.Attempts != 0 || len(got) != 0 {
		t.Fatalf("the retry under key %s: %v, %d attempts, the server received %q; want an error and nothing sent", res.Key, err, res2.Attempts, got)
	}
	mu.Unlock()
	// Built again, with its whole body, the request goes under the same key.
	again, _ := http.NewRequest("POST", srv.URL+"/x", strings.NewReader(body))
	res3, err := c.Do(context.Background(), again, res.Key)
	mu.Lock()
	defer mu.Unlock()
	if err != nil || res3.Status != 201 || len(got) != 1 || got[0] != body {
		t.Fatalf("the request built again: %d %v, the server received %q", res3.Status, err, got)
	}
}

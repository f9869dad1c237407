package idemclient_test

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgidem/pgidem/idemclient"
)

// TestSwitchingProtocolsIsNoAnswer: a faulty server (or a proxy) answered a POST with 101
// Switching Protocols and then kept the connection open without a byte. net/http hands the
// connection over as the response body and no longer watches the request's context; Do read
// it as the body, and blocked past its context and its AttemptTimeout until the server closed
// the connection, then returned the 101 as the final answer. A 101 to a request that asked for
// no upgrade is no answer: the connection is closed, and the request is sent again under its
// key, until the context ends (here) or the server answers (below).
func TestSwitchingProtocolsIsNoAnswer(t *testing.T) {
	var hits atomic.Int32
	var answer atomic.Bool // false: switch protocols to every request
	release := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		if hits.Add(1) > 1 && answer.Load() {
			w.WriteHeader(http.StatusCreated)
			return
		}
		conn, buf, err := w.(http.Hijacker).Hijack()
		if err != nil {
			t.Error(err)
			return
		}
		defer conn.Close()
		buf.WriteString("HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n")
		buf.Flush()
		select {
		case <-release:
		case <-time.After(30 * time.Second):
		}
	}))
	defer srv.Close()
	defer close(release)

	c := &idemclient.Client{AttemptTimeout: 200 * time.Millisecond, Backoff: time.Millisecond}
	req, _ := http.NewRequest("POST", srv.URL+"/x", strings.NewReader(`{}`))
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	start := time.Now()
	res, err := c.Do(ctx, req, "")
	if took := time.Since(start); took > 5*time.Second {
		t.Fatalf("Do returned %v after a 500ms context ended", took)
	}
	if err == nil || res.Status == http.StatusSwitchingProtocols {
		t.Fatalf("a server that only ever switched protocols: status %d, err %v; want no answer and an error", res.Status, err)
	}
	if hits.Load() < 2 {
		t.Fatalf("the request was sent %d times; want it sent again after a 101", hits.Load())
	}

	answer.Store(true)
	hits.Store(0)
	req, _ = http.NewRequest("POST", srv.URL+"/x", strings.NewReader(`{}`))
	res, err = c.Do(context.Background(), req, "")
	if err != nil || res.Status != http.StatusCreated || res.Attempts != 2 {
		t.Fatalf("101, then 201: status %d, attempts %d, err %v; want 201 at the second attempt", res.Status, res.Attempts, err)
	}
}

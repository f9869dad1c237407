package idem_test

import (
	"context"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/idemclient"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// stallConn writes the first `after` bytes of the connection, then stalls for `pause` before
// the rest: a slow uplink (a mobile client, a congested link) in the middle of a request's body.
type stallConn struct {
	net.Conn
	after   int
	pause   time.Duration
	written int
	stalled bool
}

func (c *stallConn) Write(p []byte) (int, error) {
	if c.stalled || c.written+len(p) <= c.after {
		c.written += len(p)
		return c.Conn.Write(p)
	}
	head := c.after - c.written
	n, err := c.Conn.Write(p[:head])
	c.written += n
	if err != nil {
		return n, err
	}
	c.stalled = true
	time.Sleep(c.pause)
	m, err := c.Conn.Write(p[head:])
	c.written += m
	return n + m, err
}

// TestBodyCutInTransitIsNotFinal: a request whose body arrives too slowly for the server's
// ReadTimeout (a standard hardening of net/http servers) was answered 400
// request_body_unreadable by the middleware: nothing was claimed, run or stored, and the very
// same request sent again succeeded. idemclient took the 400 as final ("any other 4xx ... ends
// the operation"), so the operation ended with a 400 and no effect. A body that did not arrive
// whole is 408 request_body_incomplete now, which idemclient retries (D183).
func TestBodyCutInTransitIsNotFinal(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 8)
	var runs atomic.Int32
	m, err := idem.New(context.Background(), idem.Options{DB: pool, Principal: alice, Logger: auditQuiet})
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("POST /things", m.Route(idem.Route{Required: true})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		w.Write([]byte(`{"id":1}`))
	})))
	srv := httptest.NewUnstartedServer(mux)
	srv.Config.ReadTimeout = 500 * time.Millisecond
	srv.Start()
	defer srv.Close()

	var dials atomic.Int32
	tr := &http.Transport{DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := (&net.Dialer{}).DialContext(ctx, network, addr)
		if err != nil || dials.Add(1) > 1 {
			return c, err
		}
		// The first connection: the headers and part of the body go out, then the link stalls
		// past the server's ReadTimeout.
		return &stallConn{Conn: c, after: 300, pause: 1500 * time.Millisecond}, nil
	}}
	defer tr.CloseIdleConnections()
	c := &idemclient.Client{HTTP: &http.Client{Transport: tr}, Backoff: 10 * time.Millisecond}
	body := `{"note":"` + strings.Repeat("x", 400) + `"}`
	req, _ := http.NewRequest("POST", srv.URL+"/things", strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	res, err := c.Do(ctx, req, "")
	t.Logf("first operation: %d %s attempts %d err %v, handler runs %d", res.Status, res.Code(), res.Attempts, err, runs.Load())

	// The same request under the same key, as the doc's "retry later under res.Key" does: it
	// succeeds at once, so the 400 was not the answer a retry gets again.
	again, _ := http.NewRequest("POST", srv.URL+"/things", strings.NewReader(body))
	again.Header.Set("Content-Type", "application/json")
	res2, err2 := c.Do(ctx, again, res.Key)
	t.Logf("the same request again: %d %s attempts %d err %v, handler runs %d", res2.Status, res2.Code(), res2.Attempts, err2, runs.Load())
	if res2.Status != http.StatusCreated {
		t.Fatalf("setup: the same request under the key did not succeed: %d %v", res2.Status, err2)
	}
	if err != nil || res.Status != http.StatusCreated {
		t.Fatalf("a body cut in transit ended the operation with %d %s (err %v) after %d attempt(s); "+
			"the same request under the key then got %d: the answer was not final, and Do should have retried it",
			res.Status, res.Code(), err, res.Attempts, res2.Status)
	}
}

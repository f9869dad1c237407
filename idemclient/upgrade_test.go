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

// TestUpgradeRequestIsRefused: a request that asked for an upgrade (Connection: Upgrade,
// Upgrade: websocket) and got its 101 was sent again and again, as a 101 to a request that
// asked for none is (D190), and ended in ErrGaveUp ("outcome unknown"), though the server did
// what was asked. An upgrade is not an operation Do sends: it is refused before sending.
func TestUpgradeRequestIsRefused(t *testing.T) {
	var hits atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		hits.Add(1)
		conn, buf, err := w.(http.Hijacker).Hijack()
		if err != nil {
			return
		}
		defer conn.Close()
		buf.WriteString("HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n")
		buf.Flush()
		time.Sleep(50 * time.Millisecond)
	}))
	defer srv.Close()
	c := &idemclient.Client{Backoff: time.Millisecond, MaxBackoff: 2 * time.Millisecond, MaxAttempts: 4}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	req, _ := http.NewRequest("POST", srv.URL, strings.NewReader("x"))
	req.Header.Set("Connection", "Upgrade")
	req.Header.Set("Upgrade", "websocket")
	res, err := c.Do(ctx, req, "")
	t.Logf("result status %d attempts %d err %v, server saw %d", res.Status, res.Attempts, err, hits.Load())
	if hits.Load() != 0 || err == nil || res.Attempts != 0 {
		t.Fatalf("an upgrade request: sent %d times, %d attempts, err %v; want it refused before sending", hits.Load(), res.Attempts, err)
	}
}

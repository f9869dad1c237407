package idemclient_test

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgidem/pgidem/idemclient"
)

// TestUnreadable409IsBounded: a server that is not idem's answers every request with a final
// 409 in a Content-Encoding the client cannot read (br, which the caller's Accept-Encoding
// asked for). D190 retries such a 409 in case it is request_in_progress, and with MaxAttempts
// < 0 ("no bound, until the context ends") the operation did not end: it ran until the caller's
// deadline, sending the request over and over. DefaultMaxAttempts of them in a row end it with
// ErrGaveUp, the 409 as the last answer.
func TestUnreadable409IsBounded(t *testing.T) {
	var hits atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		w.Header().Set("Content-Encoding", "br")
		w.WriteHeader(http.StatusConflict)
		w.Write([]byte{0x1b, 0x03, 0x00, 0xf8}) // some bytes of br
	}))
	defer srv.Close()
	c := &idemclient.Client{Backoff: time.Millisecond, MaxBackoff: 5 * time.Millisecond, MaxAttempts: -1}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	req, _ := http.NewRequest("POST", srv.URL, strings.NewReader(`{"a":1}`))
	req.Header.Set("Accept-Encoding", "br")
	res, err := c.Do(ctx, req, "")
	t.Logf("status %d attempts %d err %v; server saw %d", res.Status, res.Attempts, err, hits.Load())
	if !errors.Is(err, idemclient.ErrGaveUp) || res.Status != http.StatusConflict || hits.Load() != idemclient.DefaultMaxAttempts {
		t.Fatalf("a final 409 of a plain server, unreadable: %v, status %d, sent %d times; want ErrGaveUp after %d, the 409 last",
			err, res.Status, hits.Load(), idemclient.DefaultMaxAttempts)
	}
}

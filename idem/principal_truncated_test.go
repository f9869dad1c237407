package idem_test

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestTruncatedFormReadByPrincipalIsUnreadable: a request whose body ends before its
// Content-Length (the client's connection closed midway) cannot be read: net/http's body
// returns io.ErrUnexpectedEOF, and the middleware answers 408 request_body_incomplete (400
// request_body_unreadable before D183: a status a client takes as final) without claiming or
// running anything. When Principal reads the form first (r.FormValue, the case
// D178 wraps the body for), net/http's body returns ErrUnexpectedEOF to ParseForm (which
// FormValue swallows) and a plain io.EOF to every later read (its sawEOF): D178's wrapper
// kept the partial bytes, the middleware's own read saw a clean EOF, and the truncated body was
// fingerprinted, claimed, run and its answer stored; the client's retry of the whole request
// was told 422. The wrapper keeps the first read error now: 400, nothing claimed.
func TestTruncatedFormReadByPrincipalIsUnreadable(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 8)
	for _, readsForm := range []bool{false, true} {
		readsForm := readsForm
		m, err := idem.New(context.Background(), idem.Options{DB: pool,
			Principal: func(r *http.Request) (string, bool) {
				if readsForm {
					if tok := r.FormValue("access_token"); tok != "" { // RFC 6750 section 2.2
						return tok, true
					}
				}
				return r.Header.Get("X-User"), r.Header.Get("X-User") != ""
			},
			Logger: slog.New(slog.DiscardHandler)})
		if err != nil {
			t.Fatal(err)
		}
		var runs atomic.Int32
		var seen atomic.Value
		mux := http.NewServeMux()
		mux.Handle("POST /pay", m.Route(idem.Route{Required: true})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			runs.Add(1)
			b, _ := io.ReadAll(r.Body)
			seen.Store(string(b))
			w.WriteHeader(http.StatusCreated)
			fmt.Fprintf(w, "paid %q", b)
		})))
		srv := httptest.NewServer(mux)
		t.Cleanup(srv.Close)

		key := fmt.Sprintf("truncated-%v", readsForm)
		full := "to=bob&amount=500&memo=rent-for-december"
		conn, err := net.Dial("tcp", srv.Listener.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		fmt.Fprintf(conn, "POST /pay HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-www-form-urlencoded\r\n"+
			"Content-Length: %d\r\nX-User: alice\r\nIdempotency-Key: %s\r\n\r\n%s", len(full), key, full[:12])
		_ = conn.(*net.TCPConn).CloseWrite() // the body ends after 12 of its bytes
		_ = conn.SetReadDeadline(time.Now().Add(10 * time.Second))
		status := -1
		if res, err := http.ReadResponse(bufio.NewReader(conn), nil); err == nil {
			status = res.StatusCode
			res.Body.Close()
		}
		conn.Close()
		time.Sleep(300 * time.Millisecond) // any work started on the truncated body ends
		if n := runs.Load(); n != 0 || status != http.StatusRequestTimeout {
			t.Errorf("principal reads the form %v: a body cut after 12 of its %d bytes: %d, handler ran %d times on %q; "+
				"want 408 request_body_incomplete, nothing run", readsForm, len(full), status, n, seen.Load())
		}
		if n := pgtest.Count(t, pool, "SELECT count(*) FROM idem.idempotency_keys WHERE key = $1", key); n != 0 {
			t.Errorf("principal reads the form %v: the truncated request stored its key (%d rows)", readsForm, n)
		}
		// The client retries the whole request with its key.
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		st, _, got := pgtest.Send(t, ctx, "POST", srv.URL+"/pay", full, "Content-Type", "application/x-www-form-urlencoded",
			"X-User", "alice", "Idempotency-Key", key)
		cancel()
		if st != http.StatusCreated || !strings.Contains(got, "amount=500") {
			t.Errorf("principal reads the form %v: the retry of the whole request: %d %s; want 201 for the whole body", readsForm, st, got)
		}
	}
}

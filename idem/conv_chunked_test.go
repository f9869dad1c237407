package idem_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
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

// cutServer is a keyed route behind the middleware, served with the given ReadTimeout,
// wrapped by outer (nil: none).
func cutServer(t *testing.T, readTimeout time.Duration, outer func(http.Handler) http.Handler) (*httptest.Server, *atomic.Int32) {
	t.Helper()
	pool, _ := pgtest.NewPool(t, 8)
	m, err := idem.New(context.Background(), idem.Options{DB: pool, Principal: alice, Logger: auditQuiet})
	if err != nil {
		t.Fatal(err)
	}
	runs := &atomic.Int32{}
	mux := http.NewServeMux()
	mux.Handle("POST /things", m.Route(idem.Route{Required: true})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		w.Write([]byte(`{"id":1}`))
	})))
	var h http.Handler = mux
	if outer != nil {
		h = outer(mux)
	}
	srv := httptest.NewUnstartedServer(h)
	srv.Config.ReadTimeout = readTimeout
	srv.Start()
	t.Cleanup(srv.Close)
	return srv, runs
}

// cutAnswer reads one response from conn and returns its status and problem code.
func cutAnswer(t *testing.T, conn net.Conn) (int, string) {
	t.Helper()
	conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatalf("no answer: %v", err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	var p struct {
		Code string `json:"code"`
	}
	_ = json.Unmarshal(b, &p)
	return resp.StatusCode, p.Code
}

// TestChunkedBodyCutBeforeItsLastCRLFIsIncomplete: docs/http.md, request_body_incomplete: "408. The
// request body did not arrive whole: the connection ended before its end, or the server's
// read timeout passed while the client was still sending. Nothing was done (no key was
// claimed); send the request again with the same key." (D183: "a body that did not arrive
// whole ... is 408 request_body_incomplete now (io.ErrUnexpectedEOF, a timeout, a reset
// connection)".)
//
// A chunked body whose last CRLF (the empty trailer after the 0-size chunk) has not arrived
// when the server's ReadTimeout passes, or when the client's side of the connection ends, is a
// body cut short exactly as a Content-Length body is. net/http reports it with its own error,
// "http: unexpected EOF reading trailer" (also for a read timeout: the peek's timeout is
// dropped), which is neither io.ErrUnexpectedEOF nor a net.Error: the middleware answered 400
// request_body_unreadable, which every client takes as final, while the same request sent
// whole succeeds. It is 408 now.
func TestChunkedBodyCutBeforeItsLastCRLFIsIncomplete(t *testing.T) {
	t.Parallel()
	srv, runs := cutServer(t, 400*time.Millisecond, nil)
	addr := strings.TrimPrefix(srv.URL, "http://")
	body := `{"note":"x"}`
	head := "POST /things HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nIdempotency-Key: k-chunked-%s\r\n" +
		"Transfer-Encoding: chunked\r\n\r\n" + fmt.Sprintf("%x\r\n%s\r\n0\r\n", len(body), body)

	// The control: a Content-Length body cut short the same way (the client's side ends) is 408.
	{
		conn, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		fmt.Fprintf(conn, "POST /things HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nIdempotency-Key: k-cl\r\n"+
			"Content-Length: %d\r\n\r\n%s", len(body)+2, body)
		conn.(*net.TCPConn).CloseWrite()
		status, code := cutAnswer(t, conn)
		conn.Close()
		if status != http.StatusRequestTimeout || code != "request_body_incomplete" {
			t.Fatalf("setup: a Content-Length body cut short: %d %s, want 408 request_body_incomplete", status, code)
		}
	}
	for _, how := range []string{"read timeout", "connection ended"} {
		t.Run(how, func(t *testing.T) {
			conn, err := net.Dial("tcp", addr)
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			if _, err := fmt.Fprintf(conn, head, strings.ReplaceAll(how, " ", "-")); err != nil {
				t.Fatal(err)
			}
			if how == "connection ended" {
				conn.(*net.TCPConn).CloseWrite() // the client's side ends; it still reads the answer
			} // else: the final CRLF is still on its way when the ReadTimeout passes
			status, code := cutAnswer(t, conn)
			if status != http.StatusRequestTimeout || code != "request_body_incomplete" {
				t.Errorf("a chunked body cut before its final CRLF (%s): %d %s, want 408 request_body_incomplete "+
					"(a Content-Length body cut the same way gets it); handler runs %d", how, status, code, runs.Load())
			}
		})
	}
}

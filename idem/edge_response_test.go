package idem_test

import (
	"bufio"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/pgidem/pgidem/idem"
)

// edgeRaw sends one raw HTTP/1.1 request and returns the status, the body as far as it
// arrived, and the error that ended reading it (nil: a whole response).
func edgeRaw(t *testing.T, addr, req string) (int, string, error) {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.WriteString(c, req); err != nil {
		t.Fatal(err)
	}
	res, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		return -1, "", err
	}
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	return res.StatusCode, string(b), err
}

// TestBodyOnNoContentReplaysAsNoContent: docs/http.md, "What happens": "repeat, same
// request | the stored status, headers and body, byte for byte"; "response larger than
// MaxStoredBodyBytes (256 KiB) ... | sent once; stored without the body" and "a repeat of it |
// 409 response_not_replayable". A handler that writes a body on a 204 (a shared writer that
// always encodes its result) sends no body: net/http refuses it (ErrBodyNotAllowed), and the
// client gets an empty 204. The recorder kept the bytes that never went out, counted them
// against MaxStoredBodyBytes, and the repeat of that empty 204 got 409
// response_not_replayable: not the first answer, and not retryable (D184).
func TestBodyOnNoContentReplaysAsNoContent(t *testing.T) {
	t.Parallel()
	srv, _ := auditServer(t, idem.Options{MaxStoredBodyBytes: 1024}, idem.Route{}, func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusNoContent)
		io.WriteString(w, `{"deleted":"`+strings.Repeat("x", 2048)+`"}`)
	})
	s1, _, b1 := auditPost(t, srv.URL, "nc-1", `{}`)
	s2, h2, b2 := auditPost(t, srv.URL, "nc-1", `{}`)
	if s1 != 204 || b1 != "" {
		t.Fatalf("first: %d %q", s1, b1)
	}
	if s2 != 204 || b2 != "" || h2.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("the first answer was an empty 204; its repeat got %d (code %q), want the empty 204 replayed", s2, auditCode(b2))
	}
}

// TestWrongContentLengthReplaysWhatWasSent: docs/http.md, "repeat, same request | the
// stored status, headers and body, byte for byte" (the brief: "every repeat gets the first
// answer"). A handler that sets a Content-Length that does not match what it writes gets, under
// net/http, an error from Write (ErrContentLength: the body does not go out) or a cut response.
// The recorder accepted any write (its Write returned nil), sent the handler's Content-Length
// with the whole buffer, and stored the whole buffer without that Content-Length: with a
// Content-Length of 3 and 5 bytes written, the first client got a 201 with no body at all (a
// read error), its retry a well-formed 5-byte body that the first never carried. The recorder
// refuses the write as net/http does now, and sends the true length (D184).
func TestWrongContentLengthReplaysWhatWasSent(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ name, cl string }{{"too small", "3"}} {
		srv, _ := auditServer(t, idem.Options{}, idem.Route{}, func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "text/plain")
			w.Header().Set("Content-Length", c.cl)
			w.WriteHeader(http.StatusCreated)
			io.WriteString(w, "abcde")
		})
		req := "POST /things HTTP/1.1\r\nHost: x\r\nIdempotency-Key: cl-1\r\nContent-Type: application/json\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}"
		addr := srv.Listener.Addr().String()
		s1, b1, e1 := edgeRaw(t, addr, req)
		s2, b2, e2 := edgeRaw(t, addr, req)
		if s1 != s2 || b1 != b2 || (e1 == nil) != (e2 == nil) {
			t.Errorf("Content-Length %s, 5 bytes written: first %d %q (read error %v); repeat %d %q (read error %v): "+
				"the repeat is not the first answer", c.cl, s1, b1, e1, s2, b2, e2)
		}
	}
}

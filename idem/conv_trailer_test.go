package idem_test

import (
	"fmt"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"
)

// TestMalformedTrailerIsUnreadable: docs/http.md and bodyProblem: 400
// request_body_unreadable "when what arrived is not a body (malformed chunked encoding), which
// a retry would send again"; 408 request_body_incomplete only when "the request body did not
// arrive whole".
//
// The first build of the trailer rule answered 408 for any error whose text contained
// "unexpected EOF". net/http's error for a malformed trailer line quotes the line the client
// sent ("malformed MIME header line: ..."), so a chunked body that arrived whole, with a
// trailer that is not a header line, was answered 408 "send the request again" whenever that
// line's text contained the words, and every retry of the same bytes got 408 again. The whole
// text of net/http's own error is matched now.
func TestMalformedTrailerIsUnreadable(t *testing.T) {
	t.Parallel()
	srv, runs := cutServer(t, 5*time.Second, nil)
	addr := strings.TrimPrefix(srv.URL, "http://")
	body := `{"note":"x"}`
	send := func(key, trailer string) (int, string) {
		conn, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		fmt.Fprintf(conn, "POST /things HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nIdempotency-Key: %s\r\n"+
			"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n%s\r\n\r\n", key, len(body), body, trailer)
		return cutAnswer(t, conn)
	}
	// The control: a malformed trailer line is 400 request_body_unreadable.
	if status, code := send("k-trailer-control", "no colon here"); status != http.StatusBadRequest || code != "request_body_unreadable" {
		t.Fatalf("setup: a chunked body with a malformed trailer line: %d %s, want 400 request_body_unreadable", status, code)
	}
	for i := range 2 { // whole, and the same again: a retry does not mend it
		if status, code := send("k-trailer", "unexpected EOF"); status != http.StatusBadRequest || code != "request_body_unreadable" {
			t.Errorf("send %d: a chunked body that arrived whole with the malformed trailer line %q: %d %s, want 400 request_body_unreadable "+
				"(the same body with another malformed trailer line gets it); handler runs %d", i+1, "unexpected EOF", status, code, runs.Load())
		}
	}
}

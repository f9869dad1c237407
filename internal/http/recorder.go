package idemhttp

import (
	"bytes"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"sync"
)

// recorder buffers the handler's response so that nothing reaches the client before the
// unit of work has committed or rolled back. Flush is accepted and has no effect until then.
type recorder struct {
	header http.Header
	// sent is the header as it was when the status was written: what net/http sends (it
	// ignores what a handler changes after WriteHeader), so what is sent and stored.
	sent   http.Header
	status int
	body   bytes.Buffer
	head   bool // the request is a HEAD: a Content-Length without a body is its GET's
	// badLength: the handler's Content-Length did not hold what it wrote (a write refused).
	badLength bool
	// mu and returned: once the handler has returned (close), what it still writes from a
	// goroutine of its own goes nowhere (Write says errHandlerReturned): the response is
	// stored and sent from here then, and a late write reached the first client but not the
	// stored answer, racing with the send (D259).
	mu       sync.Mutex
	returned bool
}

// errHandlerReturned is a Write's error once the handler has returned: a ResponseWriter may
// not be used after ServeHTTP returns.
var errHandlerReturned = errors.New("idem: write after the handler returned; a ResponseWriter may not be used after ServeHTTP returns")

func newRecorder(head bool) *recorder { return &recorder{header: http.Header{}, head: head} }

// close marks the handler returned: the recorder takes no more from it. A header never
// written with a status is taken now, once: the stored and the sent answer read the same copy,
// not the map a goroutine of the handler may still hold (which must not be used after the
// handler returned either).
func (rec *recorder) close() {
	rec.mu.Lock()
	defer rec.mu.Unlock()
	rec.returned = true
	if rec.sent == nil {
		rec.sent = canonicalClone(rec.header)
	}
}

func (rec *recorder) Header() http.Header {
	rec.mu.Lock()
	defer rec.mu.Unlock()
	if rec.returned {
		return http.Header{} // changes after the handler returned go nowhere
	}
	return rec.header
}

// headers is the response's header as sent: as at WriteHeader, or as now before it; its
// names canonical (a handler that set w.Header()["location"] had it sent, and dropped from
// the stored answer, which keeps the allowlist's canonical names: D259).
func (rec *recorder) headers() http.Header {
	if rec.sent != nil {
		return rec.sent
	}
	return canonicalClone(rec.header)
}

// canonicalClone is a copy of h with every name canonical (values of names that differ only
// in case joined, in the map's order of names).
func canonicalClone(h http.Header) http.Header {
	c := make(http.Header, len(h))
	for k, v := range h {
		ck := http.CanonicalHeaderKey(k)
		c[ck] = append(c[ck], v...)
	}
	return c
}

func (rec *recorder) WriteHeader(status int) {
	rec.mu.Lock()
	defer rec.mu.Unlock()
	if rec.returned {
		return
	}
	rec.writeHeader(status)
}

func (rec *recorder) writeHeader(status int) {
	if rec.status != 0 {
		return // superfluous, as net/http ignores it (before it checks the code)
	}
	// As net/http's own ResponseWriter: a status no response can carry is the handler's bug,
	// and it panics (a panic is answered 500 internal_error, its work rolled back or its lease
	// given up); before, it was dropped and an implicit 200 stored.
	if status < 100 || status > 999 {
		panic(fmt.Sprintf("invalid WriteHeader code %v", status))
	}
	// 101 is a final status to net/http (the connection is then the handler's, hijacked):
	// nothing a key can store or replay, and ignored as an informational status it left an
	// implicit 200 that committed the work.
	if status == http.StatusSwitchingProtocols {
		panic("idem: WriteHeader(101): a declared route's answer cannot switch protocols (Hijack is not supported)")
	}
	if rec.status == 0 && status >= 200 {
		rec.status = status
		rec.sent = canonicalClone(rec.header)
	}
}

// Write keeps what net/http would send: nothing for a status that carries no body (204, 304:
// http.ErrBodyNotAllowed), and nothing past a Content-Length the handler set
// (http.ErrContentLength, for the whole write, as net/http refuses it). What is kept is what
// the first answer sends and what a repeat gets: a handler's extra bytes, which net/http would
// drop, made a 204's repeat 409 response_not_replayable, or a repeat whole where the first
// answer was cut.
func (rec *recorder) Write(b []byte) (int, error) {
	rec.mu.Lock()
	defer rec.mu.Unlock()
	if rec.returned {
		return 0, errHandlerReturned
	}
	rec.writeHeader(http.StatusOK)
	if len(b) == 0 {
		return 0, nil
	}
	if rec.status == http.StatusNoContent || rec.status == http.StatusNotModified {
		return 0, http.ErrBodyNotAllowed
	}
	// Parsed as net/http parses it: a value it cannot read ("3 ", "-1") it drops, and sends
	// the whole body.
	if cl := rec.headers().Get("Content-Length"); cl != "" {
		if n, err := strconv.ParseUint(cl, 10, 63); err == nil && uint64(rec.body.Len())+uint64(len(b)) > n {
			rec.badLength = true
			return 0, http.ErrContentLength
		}
	}
	return rec.body.Write(b)
}

// Flush implements http.Flusher; the response is sent when the unit of work ends.
func (rec *recorder) Flush() {}

func (rec *recorder) code() int {
	if rec.status == 0 {
		return http.StatusOK
	}
	return rec.status
}

// sendTo sends the response as it was written (its header as at WriteHeader), but for a
// Content-Length that does not say the body's length (a write it refused, fewer bytes than it
// declared, a value net/http cannot read): net/http sets the true one, so the first answer is
// whole, as its repeats are. A HEAD's Content-Length with no body is its GET's, and kept when
// it is a length (net/http would send one it cannot read as it is, and log it).
func (rec *recorder) sendTo(w http.ResponseWriter) {
	h := rec.headers()
	for k, v := range h {
		w.Header()[k] = v
	}
	if cl := h.Get("Content-Length"); cl != "" && !(rec.head && rec.body.Len() == 0 && validLength(cl)) &&
		(rec.badLength || cl != strconv.Itoa(rec.body.Len())) {
		w.Header().Del("Content-Length")
	}
	w.WriteHeader(rec.code())
	_, _ = w.Write(rec.body.Bytes())
}

// validLength tells whether a Content-Length is one that net/http reads: a non-negative
// decimal number.
func validLength(cl string) bool {
	n, err := strconv.ParseInt(cl, 10, 64)
	return err == nil && n >= 0
}

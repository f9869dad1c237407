package idemhttp

import (
	"bytes"
	"fmt"
	"net/http"
)

// recorder buffers the handler's response so that nothing reaches the client before the
// unit of work has committed or rolled back. Flush is accepted and has no effect until then.
type recorder struct {
	header http.Header
	status int
	body   bytes.Buffer
}

func newRecorder() *recorder { return &recorder{header: http.Header{}} }

func (rec *recorder) Header() http.Header { return rec.header }

func (rec *recorder) WriteHeader(status int) {
	if rec.status != 0 {
		return // superfluous, as net/http ignores it (before it checks the code)
	}
	// As net/http's own ResponseWriter: a status no response can carry is the handler's bug,
	// and it panics (a panic is answered 500 internal_error, its work rolled back or its lease
	// given up); before, it was dropped and an implicit 200 stored.
	if status < 100 || status > 999 {
		panic(fmt.Sprintf("invalid WriteHeader code %v", status))
	}
	if rec.status == 0 && status >= 200 {
		rec.status = status
	}
}

func (rec *recorder) Write(b []byte) (int, error) {
	rec.WriteHeader(http.StatusOK)
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

func (rec *recorder) sendTo(w http.ResponseWriter) {
	for k, v := range rec.header {
		w.Header()[k] = v
	}
	w.WriteHeader(rec.code())
	_, _ = w.Write(rec.body.Bytes())
}

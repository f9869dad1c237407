package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"
)

type requestIDKey struct{}

func requestIDOf(ctx context.Context) string {
	id, _ := ctx.Value(requestIDKey{}).(string)
	return id
}

type failuresKey struct{}

// requestFailures holds what a request's handler failed with (failed) until correlate logs the
// request: a transactional route's work that fails on a deadlock, a serialization failure or
// a lock timeout runs again, and its answer is the last run's.
type requestFailures struct {
	mu     sync.Mutex
	logged bool // correlate has logged the request: a later failure logs at once
	last   error
	n      int
}

// failed records an error the request cannot be blamed for, which its handler answers with a
// 5xx. correlate logs it with the request: at error level when the answer sent was a 5xx (or
// the client was gone), at warn level when it was not, because the middleware ran the work
// again and answered that run's answer (D279). Nothing is logged for a request whose client
// went away first, as before; a failure after the request was logged (work that outlives its
// request) logs at error level at once.
func failed(log interface{ Error(msg string, args ...any) }, r *http.Request, err error) {
	if r.Context().Err() != nil {
		return
	}
	if f, ok := r.Context().Value(failuresKey{}).(*requestFailures); ok {
		f.mu.Lock()
		if !f.logged {
			f.last, f.n = err, f.n+1
			f.mu.Unlock()
			return
		}
		f.mu.Unlock()
	}
	log.Error("request failed", "request_id", requestIDOf(r.Context()), "error", err)
}

// correlate gives every request a correlation id (the client's X-Request-Id when it is a
// short visible-ASCII value, else a new one), puts it on the response and in the request's
// context, and logs the request (/metrics scrapes at debug).
func correlate(log *slog.Logger, next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		start := time.Now()
		id := r.Header.Get("X-Request-Id")
		if !validRequestID(id) {
			b := make([]byte, 12)
			_, _ = rand.Read(b)
			id = hex.EncodeToString(b)
		}
		r.Header.Set("X-Request-Id", id)
		w.Header().Set("X-Request-Id", id)
		sw := &statusWriter{ResponseWriter: w, status: http.StatusOK, ctx: r.Context()}
		// The watch goes on the request handed on, never on net/http's own: net/http tells by
		// its body's type whether to answer an unread Expect: 100-continue body at once (D184)
		// or to close the connection after a large unread one, and a body of another type
		// made it read the body first (D258).
		body := &bodyWatch{ReadCloser: r.Body}
		failures := &requestFailures{}
		r2 := r.WithContext(context.WithValue(context.WithValue(r.Context(), requestIDKey{}, id), failuresKey{}, failures))
		if r.Body != nil && r.Body != http.NoBody {
			r2.Body = body
		}
		next.ServeHTTP(sw, r2)
		level := slog.LevelInfo
		if r.URL.Path == "/metrics" || r.URL.Path == "/healthz" {
			level = slog.LevelDebug
		}
		status := sw.status
		if (sw.goneFirst || !sw.wrote && r.Context().Err() != nil) && !body.timedOut(start) {
			// The client was gone before anything was answered (it disconnected while the
			// request waited): what was written went nowhere (a duplicate is written its 409 all
			// the same), and no 200 was sent, whatever net/http would have defaulted to. Not
			// when the body's read ran out of the server's read timeout: net/http ends the
			// request's context then too, with the client still there to read the 408 (D257).
			status = statusClientGone
		}
		failures.mu.Lock()
		failures.logged = true
		last, n := failures.last, failures.n
		failures.mu.Unlock()
		if n > 0 {
			if status < 500 && status != statusClientGone {
				log.Warn("the request's work failed and ran again", "request_id", id, "error", last, "failures", n)
			} else {
				log.Error("request failed", "request_id", id, "error", last, "failures", n)
			}
		}
		log.Log(r.Context(), level, "request", "request_id", id, "method", clipped(r.Method, maxLoggedMethod), "path", clipped(loggedPath(r), maxLoggedPath), "status", status,
			"replayed", sw.Header().Get("Idempotent-Replayed") == "true", "duration_ms", time.Since(start).Milliseconds())
	})
}

func validRequestID(id string) bool {
	if len(id) < 1 || len(id) > 64 {
		return false
	}
	for i := 0; i < len(id); i++ {
		if id[i] < 0x21 || id[i] > 0x7e {
			return false
		}
	}
	return true
}

// bodyWatch notes how a read of the request's body failed, to tell a read that ran out of the
// server's read timeout (the client was there, too slow), which ends the request's context as
// a client that left does.
type bodyWatch struct {
	io.ReadCloser
	deadline atomic.Bool               // a read failed with a timeout
	failedAt atomic.Pointer[time.Time] // when a read first failed, with any error but io.EOF
}

func (b *bodyWatch) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if err != nil && err != io.EOF {
		now := time.Now()
		b.failedAt.CompareAndSwap(nil, &now)
		var ne net.Error
		if errors.Is(err, os.ErrDeadlineExceeded) || errors.As(err, &ne) && ne.Timeout() {
			b.deadline.Store(true)
		}
	}
	return n, err
}

// timedOut tells whether the body's read ran out of the server's read timeout: a read failed
// with a timeout, or failed at all about when the timeout passed (net/http reports a chunked
// body cut by it as "unexpected EOF reading trailer"). net/http counts the timeout from before
// the request's headers came, which take at most readHeaderTimeout, and began is the handler's
// start: a failure at least readTimeout less that after it is the timeout's.
func (b *bodyWatch) timedOut(began time.Time) bool {
	at := b.failedAt.Load()
	return b.deadline.Load() || at != nil && at.Sub(began) >= readTimeout-readHeaderTimeout
}

// statusClientGone is the status logged for a request whose client went away before anything
// was answered (nginx's 499, "client closed request"); nothing is sent.
const statusClientGone = 499

type statusWriter struct {
	http.ResponseWriter
	ctx    context.Context // the request's, from net/http: canceled when its client disconnects
	status int
	wrote  bool
	// goneFirst: the client had disconnected when the answer was first written. An outer
	// deadline ends the context too (context.DeadlineExceeded), with the client still there.
	goneFirst bool
}

func (w *statusWriter) first() {
	if !w.wrote {
		w.wrote = true
		w.goneFirst = errors.Is(w.ctx.Err(), context.Canceled)
	}
}

func (w *statusWriter) Write(b []byte) (int, error) {
	w.first()
	return w.ResponseWriter.Write(b)
}

func (w *statusWriter) WriteHeader(code int) {
	w.first()
	w.status = code
	w.ResponseWriter.WriteHeader(code)
}

// The longest method and path a request line logs: a client decides both (up to net/http's
// megabyte of header), and a line that long, twice as long once a control character is escaped,
// is what log shippers split or drop. Longer ones are cut, marked with "...".
const (
	maxLoggedMethod = 32
	maxLoggedPath   = 1024
)

// clipped is s cut to at most max bytes (on a character's boundary) and marked "...", or s.
func clipped(s string, max int) string {
	if len(s) <= max {
		return s
	}
	cut := max
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + "..."
}

// loggedPath is the path a request is logged under: as it came, but for the simulated provider's
// lookup, whose last segment is a provider key (the idempotency key an outside receiver
// deduplicates by), logged as the route's template: keys are never logged.
func loggedPath(r *http.Request) string {
	// Cleaned first: /v1//provider/calls/{key} is answered 404, and logged all the same.
	if strings.HasPrefix(path.Clean(r.URL.Path), providerCallsPrefix) {
		return providerCallsPrefix + "{key}"
	}
	return r.URL.Path
}

// providerCallsPrefix is the simulated provider's lookup route before its key (routes.go).
const providerCallsPrefix = "/v1/provider/calls/"

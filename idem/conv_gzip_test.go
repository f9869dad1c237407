package idem_test

import (
	"compress/gzip"
	"context"
	"io"
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

// compressing is a minimal per-route compression middleware, as gzhttp, gziphandler or chi's
// Compress wrap a handler: when the request accepts encoding, the body goes out through
// newWriter with Content-Encoding: encoding.
func compressing(encoding string, newWriter func(io.Writer) io.WriteCloser) func(http.Handler) http.Handler {
	return func(h http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if !strings.Contains(r.Header.Get("Accept-Encoding"), encoding) {
				h.ServeHTTP(w, r)
				return
			}
			rec := httptest.NewRecorder()
			h.ServeHTTP(rec, r)
			for k, v := range rec.Header() {
				w.Header()[k] = v
			}
			w.Header().Set("Content-Encoding", encoding)
			w.Header().Add("Vary", "Accept-Encoding")
			w.WriteHeader(rec.Code)
			zw := newWriter(w)
			zw.Write(rec.Body.Bytes())
			zw.Close()
		})
	}
}

// gzipped compresses a route's answer with gzip.
var gzipped = compressing("gzip", func(w io.Writer) io.WriteCloser { return gzip.NewWriter(w) })

// TestCompressedAnswerReplaysWithItsEncoding: a route whose handler compresses its answer
// (m.Route(rt)(gzipped(h))) stores the compressed bytes as the key's body, and stored not the
// header that says how they are encoded (Content-Encoding is not among the default
// StoredHeaders). The first answer reached idemclient as JSON (net/http decompresses it); when
// it was lost, the retry's replay carried the same gzip bytes without Content-Encoding, and
// Result.Body was binary gzip. A stored body's Content-Encoding is stored with it now (D183). docs/http.md, "What happens": "repeat, same request: the stored status, headers
// and body, byte for byte"; the core promise: the retry gets the first answer, the same status
// and body.
func TestCompressedAnswerReplaysWithItsEncoding(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 8)
	m, err := idem.New(context.Background(), idem.Options{DB: pool, Principal: alice, Logger: auditQuiet})
	if err != nil {
		t.Fatal(err)
	}
	const answer = `{"id":42,"status":"created"}`
	mux := http.NewServeMux()
	mux.Handle("POST /things", m.Route(idem.Route{Required: true})(gzipped(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		w.Write([]byte(answer))
	}))))
	var lose atomic.Bool
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if lose.CompareAndSwap(true, false) { // the work commits, its answer is lost on the way
			mux.ServeHTTP(httptest.NewRecorder(), r)
			conn, _, _ := w.(http.Hijacker).Hijack()
			conn.Close()
			return
		}
		mux.ServeHTTP(w, r)
	}))
	defer srv.Close()
	c := &idemclient.Client{Backoff: 10 * time.Millisecond}
	newReq := func() *http.Request {
		req, _ := http.NewRequest("POST", srv.URL+"/things", strings.NewReader(`{"sku":"a1"}`))
		req.Header.Set("Content-Type", "application/json")
		return req
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	// The answer as the client sees it when nothing is lost.
	res, err := c.Do(ctx, newReq(), "")
	if err != nil || res.Status != 201 || string(res.Body) != answer {
		t.Fatalf("setup: %d %q %v", res.Status, res.Body, err)
	}
	// The answer lost after the commit: the retry is a replay.
	lose.Store(true)
	res, err = c.Do(ctx, newReq(), "")
	t.Logf("after a lost answer: %d replayed %v attempts %d body %q content-encoding %q", res.Status, res.Replayed, res.Attempts,
		res.Body, res.Header.Get("Content-Encoding"))
	if err != nil || res.Status != 201 || !res.Replayed {
		t.Fatalf("setup: lost answer: %d replayed %v %v", res.Status, res.Replayed, err)
	}
	if string(res.Body) != answer {
		t.Fatalf("the replay of a lost answer is not the first answer: body %q (%d bytes of gzip, no Content-Encoding), want %q",
			res.Body, len(res.Body), answer)
	}
}

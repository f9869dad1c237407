package idem_test

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// h2StatusWriter records the status the wrapped handler writes, whether or not the client is
// still there to read it.
type h2StatusWriter struct {
	http.ResponseWriter
	status chan int
}

func (w *h2StatusWriter) WriteHeader(code int) {
	select {
	case w.status <- code:
	default:
	}
	w.ResponseWriter.WriteHeader(code)
}

// TestHTTP2BodyCutIsIncomplete: docs/http.md, request_body_incomplete: "408. The request
// body did not arrive whole: the connection ended before its end ... send the request again
// with the same key"; bodyProblem: 400 request_body_unreadable only "when what arrived is not
// a body (malformed chunked encoding), which a retry would send again".
//
// Over HTTP/2 (what net/http serves on TLS by default), a client that gives up in the middle
// of its body resets the stream: net/http's body read returns its http2 StreamError ("stream
// error: stream ID 1; CANCEL"), and a connection that ends returns "client disconnected";
// neither is io.ErrUnexpectedEOF, ECONNRESET nor a timeout. The middleware answered (and
// counted) 400 request_body_unreadable, a final client error, where the same cut over HTTP/1.1
// is 408. net/http's HTTP/2 reports are matched by their text now (transportCut).
func TestHTTP2BodyCutIsIncomplete(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 8)
	m, err := idem.New(context.Background(), idem.Options{DB: pool, Principal: alice, Logger: auditQuiet})
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("POST /things", m.Route(idem.Route{Required: true})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusCreated)
	})))
	status := make(chan int, 1)
	proto := make(chan string, 1)
	bodyErrs := make(chan error, 4)
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		proto <- r.Proto
		r.Body = &h2ErrBody{ReadCloser: r.Body, errs: bodyErrs}
		mux.ServeHTTP(&h2StatusWriter{ResponseWriter: w, status: status}, r)
	}))
	srv.EnableHTTP2 = true
	srv.StartTLS()
	defer srv.Close()

	ctx, cancel := context.WithCancel(context.Background())
	pr, pw := io.Pipe()
	req, _ := http.NewRequestWithContext(ctx, "POST", srv.URL+"/things", pr)
	req.ContentLength = 100
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", "k-h2-cut")
	done := make(chan struct{})
	go func() {
		defer close(done)
		resp, err := srv.Client().Do(req)
		if err == nil {
			resp.Body.Close()
		}
	}()
	pw.Write([]byte(`{"note":"`)) // part of the body arrives
	select {
	case p := <-proto:
		if p != "HTTP/2.0" {
			t.Fatalf("setup: served as %s, want HTTP/2.0", p)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("setup: the request did not reach the server")
	}
	time.Sleep(100 * time.Millisecond)
	cancel() // the client gives up: RST_STREAM
	pw.CloseWithError(context.Canceled)
	<-done
	select {
	case st := <-status:
		if st != http.StatusRequestTimeout {
			var seen error
			select {
			case seen = <-bodyErrs:
			default:
			}
			t.Errorf("(body read error %q) an HTTP/2 request whose body was cut (stream reset by the client): the middleware answered %d, "+
				"want 408 request_body_incomplete (an HTTP/1.1 body cut the same way gets it)", seen, st)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the middleware answered nothing")
	}
}

// h2ErrBody reports the first read error other than io.EOF of the body it wraps.
type h2ErrBody struct {
	io.ReadCloser
	errs chan error
}

func (b *h2ErrBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if err != nil && err != io.EOF {
		select {
		case b.errs <- err:
		default:
		}
	}
	return n, err
}

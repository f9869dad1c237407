package idemclient_test

// Callbacks the application hands to idemclient (the request's GetBody, the http.Client's
// Transport) panicking. net/http runs both on the caller's goroutine, where the caller's own
// recover (a server's per-request recovery, a job runner's) catches the panic; the process
// must not die of a panic that the caller cannot catch.

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/pgidem/pgidem/idemclient"
)

type cbPanicTransport struct{}

func (cbPanicTransport) RoundTrip(*http.Request) (*http.Response, error) { panic("transport bug") }

func cbChild(t *testing.T, name, env string) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^"+name+"$", "-test.v", "-test.count=1")
	cmd.Env = append(os.Environ(), env)
	if out, err := cmd.CombinedOutput(); err != nil {
		s := string(out)
		if i := strings.Index(s, "goroutine "); i > 0 {
			s = s[:i]
		}
		t.Fatalf("the child process died: %v\n%s", err, s)
	}
}

// cbRecovered runs f and returns what a recover in the caller's goroutine caught.
func cbRecovered(f func()) (p any) {
	defer func() { p = recover() }()
	f()
	return nil
}

// TestCallbacksClientGetBodyPanics: a request whose GetBody panics. With net/http alone
// (http.Client.Do) GetBody runs on the caller's goroutine and the caller's recover catches
// it; idemclient calls it on a goroutine of its own, where the panic ended the process. It is
// raised again on the caller's goroutine now (D222).
func TestCallbacksClientGetBodyPanics(t *testing.T) {
	if os.Getenv("CALLBACKS_GETBODY_CHILD") != "" {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(201) }))
		defer srv.Close()
		req, _ := http.NewRequest("POST", srv.URL, strings.NewReader(`{}`))
		req.GetBody = func() (io.ReadCloser, error) { panic("GetBody bug") }
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		p := cbRecovered(func() { _, _ = (&idemclient.Client{}).Do(ctx, req, "") })
		if p != "GetBody bug" {
			t.Errorf("the caller recovered %v; want GetBody's panic", p)
		}
		return
	}
	cbChild(t, "TestCallbacksClientGetBodyPanics", "CALLBACKS_GETBODY_CHILD=1")
}

// TestCallbacksClientBodyReadPanics: a request body whose Read panics (no GetBody): Do reads
// the body before the first attempt, on a goroutine of its own; the panic ended the process, and
// reaches the caller now (D222).
func TestCallbacksClientBodyReadPanics(t *testing.T) {
	if os.Getenv("CALLBACKS_BODYREAD_CHILD") != "" {
		req, _ := http.NewRequest("POST", "http://127.0.0.1:1/", io.NopCloser(cbPanicReader{}))
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		p := cbRecovered(func() { _, _ = (&idemclient.Client{}).Do(ctx, req, "") })
		if p != "body reader bug" {
			t.Errorf("the caller recovered %v; want the body's panic", p)
		}
		return
	}
	cbChild(t, "TestCallbacksClientBodyReadPanics", "CALLBACKS_BODYREAD_CHILD=1")
}

type cbPanicReader struct{}

func (cbPanicReader) Read([]byte) (int, error) { panic("body reader bug") }

// TestCallbacksClientTransportPanics: an http.Client whose Transport panics: the panic
// reaches Do's caller (as with http.Client.Do), with or without AttemptTimeout.
func TestCallbacksClientTransportPanics(t *testing.T) {
	if os.Getenv("CALLBACKS_TRANSPORT_CHILD") != "" {
		for _, timeout := range []time.Duration{0, time.Second} {
			req, _ := http.NewRequest("POST", "http://127.0.0.1:1/", strings.NewReader(`{}`))
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			c := &idemclient.Client{HTTP: &http.Client{Transport: cbPanicTransport{}}, AttemptTimeout: timeout}
			p := cbRecovered(func() { _, _ = c.Do(ctx, req, "") })
			cancel()
			if p == nil {
				t.Errorf("AttemptTimeout %v: no panic reached the caller", timeout)
			}
		}
		return
	}
	cbChild(t, "TestCallbacksClientTransportPanics", "CALLBACKS_TRANSPORT_CHILD=1")
}

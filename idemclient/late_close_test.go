package idemclient_test

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/pgidem/pgidem/idemclient"
)

type lateCloser struct {
	io.Reader
	closing chan struct{}
}

func (c lateCloser) Close() error {
	close(c.closing)
	panic("body Close bug")
}

// TestLateGetBodyCloseThatPanics: D222: a panic of the application's body code on a goroutine
// of Do's own is handed to the caller, or dropped with the body when the caller has left. When
// the context ends while GetBody runs, Do returns, and a goroutine of Do's closes the body that
// GetBody returns late: a Close that panicked there ended the process, out of every caller's
// recover (net/http calls GetBody, and so closes its body, on the caller's goroutine). It is
// dropped now.
func TestLateGetBodyCloseThatPanics(t *testing.T) {
	if os.Getenv("LATE_CLOSE_CHILD") != "" {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(201) }))
		defer srv.Close()
		release := make(chan struct{})
		closing := make(chan struct{})
		req, _ := http.NewRequest("POST", srv.URL, strings.NewReader(`{}`))
		req.GetBody = func() (io.ReadCloser, error) {
			<-release
			return lateCloser{Reader: strings.NewReader(`{}`), closing: closing}, nil
		}
		ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
		defer cancel()
		var err error
		p := cbRecovered(func() { _, err = (&idemclient.Client{}).Do(ctx, req, "") })
		t.Logf("Do: %v (recovered %v)", err, p)
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("Do: %v; want the context's end", err)
		}
		close(release) // GetBody returns now, after its caller left
		select {
		case <-closing:
			time.Sleep(300 * time.Millisecond) // Close panicked on Do's goroutine: the process ends here
		case <-time.After(2 * time.Second):
			t.Error("the late body was never closed")
		}
		return
	}
	cbChild(t, "TestLateGetBodyCloseThatPanics", "LATE_CLOSE_CHILD=1")
}

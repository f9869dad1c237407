package main

import (
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"testing"
	"time"

	"github.com/pgidem/pgidem/internal/pgcluster"
)

// TestServeOutlivesItsLogReader: the server's log goes to its standard error; when the
// program that reads it goes away (`server serve | head`, a log shipper or journald that
// restarts), the next line met a closed pipe and the process died of SIGPIPE, requests in
// flight and all. serve keeps serving; the lines written meanwhile are lost (D262).
func TestServeOutlivesItsLogReader(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	bin := serverBinary(t)
	port, err := pgcluster.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, "serve")
	cmd.Env = append(os.Environ(), "DATABASE_URL="+s.db, "LISTEN_ADDR="+addr, "CLEANUP_INTERVAL=0", "LOG_LEVEL=info")
	cmd.Stdout, cmd.Stderr = w, w
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	w.Close()
	var waitErr error
	exited := make(chan struct{})
	go func() { waitErr = cmd.Wait(); close(exited) }()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-exited
	})
	get := func() (int, error) {
		res, err := http.Get("http://" + addr + "/v1/accounts") // logged: 405, a GET of a POST route
		if err != nil {
			return 0, err
		}
		res.Body.Close()
		return res.StatusCode, nil
	}
	up := false
	for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		if _, err := get(); err == nil {
			up = true
			break
		}
	}
	if !up {
		t.Fatal("the server did not come up")
	}
	r.Close() // the log's reader goes away
	for i := range 20 {
		code, err := get() // each request logs a line
		if err != nil {
			select {
			case <-exited:
				t.Fatalf("request %d after the log's reader left: %v; the server exited: %v", i, err, waitErr)
			case <-time.After(time.Second):
				t.Fatalf("request %d after the log's reader left: %v", i, err)
			}
		}
		if code != http.StatusMethodNotAllowed {
			t.Fatalf("request %d after the log's reader left: %d", i, code)
		}
	}
	select {
	case <-exited:
		t.Fatalf("the server exited once its log's reader left: %v", waitErr)
	default:
	}
}

package main

import (
	"bytes"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/pgidem/pgidem/internal/pgcluster"
)

// TestReviewOps3SecondSignalStopsPrivateCluster: docs/operations.md says the stop "if it
// started the private cluster, stops it", and (D171) "a second SIGINT or SIGTERM ends the
// process at once". In D171's first build, a second Ctrl-C while a request held the shutdown
// killed the process before Close: the private cluster it started stayed running, and the
// next `serve` reused it and so never stopped it either. The second signal stops it first now.
func TestReviewOps3SecondSignalStopsPrivateCluster(t *testing.T) {
	bin := serverBinary(t)
	bindir, err := pgcluster.BinDir()
	if err != nil {
		t.Fatal(err)
	}
	dir, err := os.MkdirTemp("/var/tmp", "review-idem-data-")
	if err != nil {
		t.Fatal(err)
	}
	os.Chmod(dir, 0o777)
	t.Cleanup(func() { os.RemoveAll(dir) })
	dataPort, _ := pgcluster.FreePort()
	httpPort, _ := pgcluster.FreePort()
	addr := fmt.Sprintf("127.0.0.1:%d", httpPort)
	var out bytes.Buffer
	cmd := exec.Command(bin, "serve")
	cmd.Env = append(os.Environ(), "DATABASE_URL=", "IDEM_DATA_DIR="+dir, fmt.Sprintf("IDEM_DATA_PORT=%d", dataPort),
		"LISTEN_ADDR="+addr, "SHUTDOWN_TIMEOUT=30s", "LOG_LEVEL=info", "CLEANUP_INTERVAL=0")
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	pgctl := filepath.Join(bindir, "pg_ctl")
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		// pg_ctl as root is refused: the cluster runs as postgres.
		_ = exec.Command("su", "postgres", "-c", pgctl+" -D "+filepath.Join(dir, "data")+" -m immediate -w stop").Run()
		_ = exec.Command(pgctl, "-D", filepath.Join(dir, "data"), "-m", "immediate", "-w", "stop").Run()
	})
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	up := false
	for deadline := time.Now().Add(120 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		if res, err := http.Get("http://" + addr + "/healthz"); err == nil {
			res.Body.Close()
			up = true
			break
		}
		select {
		case <-exited:
			t.Fatalf("the server exited:\n%s", out.String())
		default:
		}
	}
	if !up {
		t.Fatalf("the server did not come up:\n%s", out.String())
	}
	// A request in flight (its headers half sent) holds the graceful stop.
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.Write([]byte("POST /v1/accounts HTTP/1.1\r\nHost: x\r\n"))
	time.Sleep(200 * time.Millisecond)
	_ = cmd.Process.Signal(syscall.SIGTERM)
	time.Sleep(500 * time.Millisecond)
	_ = cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-exited:
	case <-time.After(20 * time.Second):
		t.Fatalf("the second SIGTERM did not end the process:\n%s", out.String())
	}
	time.Sleep(200 * time.Millisecond)
	// A postmaster still listens on the private cluster's port.
	running := false
	if pc, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", dataPort), 2*time.Second); err == nil {
		pc.Close()
		running = true
	}
	if running {
		t.Fatalf("after a second SIGTERM the process (%v) is gone and the private cluster it started still runs (port %d):\nserver output:\n%s",
			cmd.ProcessState, dataPort, out.String())
	}
}

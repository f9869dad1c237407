package main

import (
	"bytes"
	"fmt"
	"net"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/pgidem/pgidem/internal/pgcluster"
)

// TestTwoSignalsAtOnceEndTheProcess: the second signal's handler was registered only once
// the first had woken the stop, so a second signal that came before that was taken by the
// first's channel and lost: the process waited out SHUTDOWN_TIMEOUT. A SIGINT and a SIGTERM
// sent back to back (two kinds, so the kernel does not merge them) end the process at once
// now, with a request in flight holding the graceful stop.
func TestTwoSignalsAtOnceEndTheProcess(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	bin := serverBinary(t)
	for round := range 3 {
		port, err := pgcluster.FreePort()
		if err != nil {
			t.Fatal(err)
		}
		var out bytes.Buffer
		p := &process{t: t, bin: bin, addr: fmt.Sprintf("127.0.0.1:%d", port), log: &out, env: append(os.Environ(),
			"DATABASE_URL="+s.db, "LISTEN_ADDR="+fmt.Sprintf("127.0.0.1:%d", port), "CLEANUP_INTERVAL=0",
			"SHUTDOWN_TIMEOUT=60s", "LOG_LEVEL=error")}
		p.start()
		exited := make(chan struct{})
		go func() { _ = p.cmd.Wait(); close(exited) }()
		// A request in flight (its headers half sent) holds the graceful stop.
		c, err := net.Dial("tcp", p.addr)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = c.Write([]byte("POST /v1/accounts HTTP/1.1\r\nHost: x\r\n"))
		_ = p.cmd.Process.Signal(syscall.SIGINT)
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-exited:
		case <-time.After(20 * time.Second):
			_ = p.cmd.Process.Kill()
			<-exited
			c.Close()
			t.Fatalf("round %d: a SIGINT and a SIGTERM back to back did not end the process within 20 s (SHUTDOWN_TIMEOUT 60 s):\n%s", round, out.String())
		}
		c.Close()
		if code := p.cmd.ProcessState.ExitCode(); code != 1 {
			t.Errorf("round %d: exit %d after two signals, want 1:\n%s", round, code, out.String())
		}
	}
}

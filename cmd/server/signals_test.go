package main

import (
	"bytes"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
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
		p, out, c, exited := signalled(t, s, bin, "60s", "error")
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

// TestOneSignalStillStopsGracefully: docs/operations.md "Shutdown": one SIGINT (or SIGTERM)
// and nothing more: the server stops gracefully, waits at most SHUTDOWN_TIMEOUT (+2 s) for a
// request in flight (here a request whose headers are half sent), logs "stopped" and exits 0.
// The channel registered at start (D179) must not turn a lone signal into the abort.
func TestOneSignalStillStopsGracefully(t *testing.T) {
	s := startServer(t, nil)
	bin := serverBinary(t)
	for _, sig := range []syscall.Signal{syscall.SIGINT, syscall.SIGTERM} {
		// A fresh connection with half-sent headers (StateNew: http.Server.Shutdown waits for
		// it), accepted by the server when signalled returns.
		p, out, c, exited := signalled(t, s, bin, "2s", "info")
		start := time.Now()
		_ = p.cmd.Process.Signal(sig)
		select {
		case <-exited:
		case <-time.After(30 * time.Second):
			_ = p.cmd.Process.Kill()
			<-exited
			t.Fatalf("%v: not stopped within 30 s:\n%s", sig, out.String())
		}
		c.Close()
		took := time.Since(start)
		code := p.cmd.ProcessState.ExitCode()
		t.Logf("%v: exit %d after %v", sig, code, took.Round(time.Millisecond))
		if code != 0 || !strings.Contains(out.String(), `"stopped"`) && !strings.Contains(out.String(), "msg=stopped") || took < 2*time.Second {
			t.Errorf("%v: exit %d after %v, want the graceful stop (exit 0, \"stopped\", after SHUTDOWN_TIMEOUT):\n%s", sig, code, took, out.String())
		}
	}
}

// signalled starts the server on s's database with SHUTDOWN_TIMEOUT and LOG_LEVEL set, opens
// a connection that sends half a request's headers (a request in flight that holds the
// graceful stop), and returns the process, its output, the connection and a channel closed
// when the process has exited.
func signalled(t *testing.T, s *testServer, bin, shutdownTimeout, logLevel string) (*process, *bytes.Buffer, net.Conn, chan struct{}) {
	t.Helper()
	port, err := pgcluster.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	out := &bytes.Buffer{}
	p := &process{t: t, bin: bin, addr: fmt.Sprintf("127.0.0.1:%d", port), log: out, env: append(os.Environ(),
		"DATABASE_URL="+s.db, "LISTEN_ADDR="+fmt.Sprintf("127.0.0.1:%d", port), "CLEANUP_INTERVAL=0",
		"SHUTDOWN_TIMEOUT="+shutdownTimeout, "LOG_LEVEL="+logLevel)}
	p.start()
	exited := make(chan struct{})
	go func() { _ = p.cmd.Wait(); close(exited) }()
	c, err := net.Dial("tcp", p.addr)
	if err != nil {
		t.Fatal(err)
	}
	_, _ = c.Write([]byte("POST /v1/accounts HTTP/1.1\r\nHost: x\r\n"))
	// The server has accepted that connection (and http.Server.Shutdown will wait for it)
	// once it has answered a request on a connection dialled after it: it accepts in the
	// order of the listen queue, and tracks a connection as it accepts it. Until then a stop
	// found nothing in flight, and the process could end before it read a second signal.
	after, err := net.Dial("tcp", p.addr)
	if err != nil {
		t.Fatal(err)
	}
	defer after.Close()
	_ = after.SetDeadline(time.Now().Add(20 * time.Second))
	// A path no route has: answered without the database, so the half-sent request's
	// connection is young when the test signals (http.Server.Shutdown takes a connection that
	// has sent no whole request for 5 s as idle, and stops waiting for it).
	_, _ = after.Write([]byte("GET /no-such-path HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"))
	if b, err := io.ReadAll(after); err != nil || !bytes.HasPrefix(b, []byte("HTTP/1.1 ")) {
		t.Fatalf("a request after the half-sent one: %q %v", b, err)
	}
	return p, out, c, exited
}

// TestOneStopDeliveredTwiceIsGraceful: a SIGTERM to a process group reaches the server and the
// program that runs it, and make (`make run`) or timeout passes it on: the server gets the same
// signal twice within a few milliseconds. That is one stop, and it is graceful (exit 0 after
// SHUTDOWN_TIMEOUT, "stopped"); on the previous code the second delivery aborted the process
// (exit 1, the in-flight request's connection closed). D256.
func TestOneStopDeliveredTwiceIsGraceful(t *testing.T) {
	s := startServer(t, nil)
	bin := serverBinary(t)
	p, out, c, exited := signalled(t, s, bin, "2s", "info")
	start := time.Now()
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	time.Sleep(20 * time.Millisecond) // two deliveries, not one pending signal the kernel merges
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-exited:
	case <-time.After(30 * time.Second):
		_ = p.cmd.Process.Kill()
		<-exited
		t.Fatalf("not stopped within 30 s:\n%s", out.String())
	}
	c.Close()
	took := time.Since(start)
	code := p.cmd.ProcessState.ExitCode()
	if code != 0 || !strings.Contains(out.String(), "stopped") || strings.Contains(out.String(), "second signal") || took < 2*time.Second {
		t.Errorf("SIGTERM twice within 20 ms: exit %d after %v, want the graceful stop (exit 0, \"stopped\", after SHUTDOWN_TIMEOUT):\n%s",
			code, took.Round(time.Millisecond), out.String())
	}
}

package main

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/pgidem/pgidem/internal/pgcluster"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestReuseConnectsWhereTheClusterRuns: README's quickstart after `make run` was moved off a
// busy database port as the start error says (`IDEM_DATA_PORT=54339 make run`), then, verbatim,
// `go run ./cmd/server principal create alice` (no IDEM_DATA_PORT). The command found the
// .data/ cluster running, logged "reusing the running private PostgreSQL cluster", and
// connected to IDEM_DATA_PORT's default port instead of the one that cluster runs on: it
// migrated and wrote the principal into whatever other PostgreSQL listened there (another
// checkout's cluster), and the quickstart's curl calls got 401. A command now connects to the
// cluster running in its IDEM_DATA_DIR where it listens (its postmaster.pid).
//
// Here: cluster B runs in IDEM_DATA_DIR on one port; another cluster A listens on the port
// IDEM_DATA_PORT names. Asserted: `principal create` writes nothing to A and its principal is
// in B.
func TestReuseConnectsWhereTheClusterRuns(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	a, stopA, err := pgcluster.StartTemp(ctx, "reuse-a-", map[string]string{"fsync": "off"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(stopA)
	b, stopB, err := pgcluster.StartTemp(ctx, "reuse-b-", map[string]string{"fsync": "off"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(stopB)
	if a.Port == b.Port {
		t.Fatal("same port")
	}
	env := map[string]string{"IDEM_DATA_DIR": b.Dir, "IDEM_DATA_PORT": strconv.Itoa(a.Port)}
	var log bytes.Buffer
	m := NewMain(&bytes.Buffer{}, &log)
	if err := m.ParseFlags([]string{"principal", "create", "alice"}, func(k string) string { return env[k] }); err != nil {
		t.Fatal(err)
	}
	runErr := m.Run(ctx)
	_ = m.Close()
	t.Logf("principal create: %v\n%s", runErr, log.String())
	connA := pgtest.Connect(t, a.ConnString("postgres"))
	if n := pgtest.Count(t, connA, `SELECT count(*) FROM pg_namespace WHERE nspname IN ('idem', 'ledger')`); n != 0 {
		t.Errorf("`principal create` with IDEM_DATA_DIR=%s (its cluster running on port %d) migrated the PostgreSQL on port %d, "+
			"another cluster (%d of schemas idem, ledger there), and its log said it was reusing the cluster in %s", b.Dir, b.Port, a.Port, n, b.Dir)
	}
	connB := pgtest.Connect(t, b.ConnString("postgres"))
	if runErr != nil || pgtest.Count(t, connB, `SELECT count(*) FROM pg_namespace WHERE nspname = 'ledger'`) == 0 {
		t.Errorf("`principal create`: %v; want it to succeed, its principal in the cluster of IDEM_DATA_DIR", runErr)
	}
}

// TestCtrlCAfterKill9StopsTheCluster: README: "Ctrl-C stops `make run` cleanly, and with it the
// cluster it started". After the server was killed (kill -9, the OOM killer), its private
// cluster kept running (pg_ctl runs it in a session of its own); the next `make run` reused it
// and its Ctrl-C did not stop it, nor did any later one: a PostgreSQL stayed running after
// every `make run` had ended. A serve that finds the cluster running while the server recorded
// as its own is gone takes it over and stops it on exit.
//
// Asserted: after kill -9, a new serve, and SIGINT to it, the private cluster is stopped.
func TestCtrlCAfterKill9StopsTheCluster(t *testing.T) {
	t.Parallel()
	bin := serverBinary(t)
	tmp, err := os.MkdirTemp("", "kill9-data-")
	if err != nil {
		t.Fatal(err)
	}
	_ = os.Chmod(tmp, 0o755)
	dir := filepath.Join(tmp, "data")
	dataPort, _ := pgcluster.FreePort()
	cl := &pgcluster.Cluster{Dir: dir, TCPAddr: "127.0.0.1", Port: dataPort}
	t.Cleanup(func() {
		_ = cl.Stop(context.Background())
		_ = os.RemoveAll(tmp)
	})
	start := func() (*exec.Cmd, chan struct{}, *bytes.Buffer) {
		t.Helper()
		httpPort, _ := pgcluster.FreePort()
		addr := fmt.Sprintf("127.0.0.1:%d", httpPort)
		var out bytes.Buffer
		cmd := exec.Command(bin, "serve")
		cmd.Env = append(os.Environ(), "DATABASE_URL=", "IDEM_DATA_DIR="+dir, fmt.Sprintf("IDEM_DATA_PORT=%d", dataPort),
			"LISTEN_ADDR="+addr, "CLEANUP_INTERVAL=0")
		cmd.Stdout, cmd.Stderr = &out, &out
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		exited := make(chan struct{})
		go func() { _ = cmd.Wait(); close(exited) }()
		t.Cleanup(func() { _ = cmd.Process.Kill(); <-exited })
		for deadline := time.Now().Add(90 * time.Second); ; time.Sleep(50 * time.Millisecond) {
			if res, err := http.Get("http://" + addr + "/healthz"); err == nil {
				res.Body.Close()
				return cmd, exited, &out
			}
			select {
			case <-exited:
				t.Fatalf("the server exited:\n%s", out.String())
			default:
			}
			if time.Now().After(deadline) {
				t.Fatalf("the server did not come up:\n%s", out.String())
			}
		}
	}
	first, exited, _ := start()
	_ = first.Process.Signal(syscall.SIGKILL)
	<-exited
	second, exited, out := start()
	_ = second.Process.Signal(syscall.SIGINT)
	select {
	case <-exited:
	case <-time.After(30 * time.Second):
		t.Fatalf("the server did not stop on SIGINT:\n%s", out.String())
	}
	time.Sleep(200 * time.Millisecond)
	if c, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", dataPort), time.Second); err == nil {
		c.Close()
		t.Errorf("after kill -9, a new serve and its Ctrl-C (SIGINT), the private cluster in %s still runs on port %d; the serve's log:\n%s",
			dir, dataPort, out.String())
	}
}

package pgcluster

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// TestStartExplainsAPortInUse: a cluster whose port is taken says so, and which port.
func TestStartExplainsAPortInUse(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	port := ln.Addr().(*net.TCPAddr).Port
	c := initTemp(t, &Cluster{TCPAddr: "127.0.0.1", Port: port})
	ctx := context.Background()
	err = c.Start(ctx)
	if err == nil || !strings.Contains(err.Error(), "port "+strconv.Itoa(port)+" is in use") || !strings.Contains(err.Error(), "IDEM_DATA_PORT") {
		t.Fatalf("start on a taken port: %v", err)
	}
	ln.Close()
	if err := c.Start(ctx); err != nil || !c.Started() {
		t.Fatalf("start once the port is free: %v", err)
	}
	again := *c
	if err := again.Start(ctx); err != nil || again.Started() {
		t.Fatalf("a second start finds it running: %v, started %v", err, again.Started())
	}
}

// TestUnreachableDirectoryIsNamed: as root the cluster runs as postgres; a directory on the
// way that postgres cannot search is named, instead of a bare "permission denied".
func TestUnreachableDirectoryIsNamed(t *testing.T) {
	t.Parallel()
	if os.Geteuid() != 0 {
		t.Log("not root: the postgres user is not involved; checking that an ordinary directory works")
		if err := (&Cluster{Dir: filepath.Join(t.TempDir(), "pg")}).prepare(); err != nil {
			t.Fatal(err)
		}
		return
	}
	parent := searchableTemp(t)
	locked := filepath.Join(parent, "locked")
	if err := os.Mkdir(locked, 0o700); err != nil {
		t.Fatal(err)
	}
	err := (&Cluster{Dir: filepath.Join(locked, "pg")}).prepare()
	if err == nil || !strings.Contains(err.Error(), "cannot reach") || !strings.Contains(err.Error(), locked+" is closed") {
		t.Fatalf("a cluster under a closed directory: %v", err)
	}
}

// TestAnyPortChoosesAgain: a throwaway cluster whose chosen port is taken before the server
// binds it (what failed a CI run: another program's connection took the standby's port
// between the choice and the start) starts on another port.
func TestAnyPortChoosesAgain(t *testing.T) { // not parallel: it replaces choosePort
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	taken := ln.Addr().(*net.TCPAddr).Port
	var chosen []int
	choosePort = func() (int, error) {
		if len(chosen) == 0 {
			chosen = append(chosen, taken)
			return taken, nil
		}
		p, err := FreePort()
		chosen = append(chosen, p)
		return p, err
	}
	defer func() { choosePort = FreePort }()
	c := initTemp(t, &Cluster{TCPAddr: "127.0.0.1", AnyPort: true})
	ctx := context.Background()
	if err := c.Start(ctx); err != nil {
		t.Fatalf("start with the first choice taken: %v", err)
	}
	if len(chosen) != 2 || c.Port != chosen[1] || c.Port == taken {
		t.Fatalf("chosen %v, port %d, taken %d", chosen, c.Port, taken)
	}
	conn, err := net.Dial("tcp", c.TCPHostPort())
	if err != nil {
		t.Fatalf("the server is not on its port %d: %v", c.Port, err)
	}
	conn.Close()
}

// TestFreePortIsBelowTheEphemeralRange: a port chosen for a server started later is one
// that outgoing connections' source ports never take.
func TestFreePortIsBelowTheEphemeralRange(t *testing.T) {
	t.Parallel()
	floor, low := freePortFloor, ephemeralLow()
	if low <= freePortFloor+1000 {
		t.Logf("this machine's ephemeral range starts at %d: the kernel chooses", low)
		floor, low = 1, 65536
	}
	// A port free when FreePort looked can be taken before the test listens on it (the other
	// test packages start clusters and proxies beside this one): one such race is not the
	// function's fault, a port taken again and again is.
	taken := 0
	for range 20 {
		p, err := FreePort()
		if err != nil {
			t.Fatal(err)
		}
		if ln, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(p))); err != nil {
			if taken++; taken > 2 {
				t.Fatalf("FreePort chose %d, which is taken (%d of its choices were): %v", p, taken, err)
			}
		} else {
			ln.Close()
		}
		if p < floor || p >= low {
			t.Fatalf("FreePort chose %d, not in [%d, %d)", p, freePortFloor, low)
		}
	}
}

// initTemp initializes c in a temporary directory of its own (readable by the postgres user,
// which the server may run as), stopped and removed when the test ends.
func initTemp(t *testing.T, c *Cluster) *Cluster {
	t.Helper()
	dir, err := os.MkdirTemp("", "idem-pgcluster-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	c.Dir, c.SocketDir = filepath.Join(dir, "pg"), filepath.Join(dir, "pg")
	if err := c.Init(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Stop(context.Background()) })
	return c
}

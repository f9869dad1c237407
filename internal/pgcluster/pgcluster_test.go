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
	dir, err := os.MkdirTemp("", "idem-pgcluster-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	if err := os.Chmod(dir, 0o755); err != nil { // the server may run as postgres
		t.Fatal(err)
	}
	c := &Cluster{Dir: filepath.Join(dir, "pg"), SocketDir: filepath.Join(dir, "pg"), TCPAddr: "127.0.0.1", Port: port}
	ctx := context.Background()
	if err := c.Init(ctx); err != nil {
		t.Fatal(err)
	}
	defer c.Stop(ctx)
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
	parent, err := os.MkdirTemp("", "idem-pgcluster-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(parent)
	if err := os.Chmod(parent, 0o755); err != nil {
		t.Fatal(err)
	}
	locked := filepath.Join(parent, "locked")
	if err := os.Mkdir(locked, 0o700); err != nil {
		t.Fatal(err)
	}
	err = (&Cluster{Dir: filepath.Join(locked, "pg")}).prepare()
	if err == nil || !strings.Contains(err.Error(), "cannot reach") || !strings.Contains(err.Error(), locked+" is closed") {
		t.Fatalf("a cluster under a closed directory: %v", err)
	}
}

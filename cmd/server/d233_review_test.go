package main

// An adversarial review of D233 (topic D233Review): server.pid holds "pid starttime"; a record of
// an earlier release (the number alone) still works, garbage never crashes and never names a
// live server, and releaseCluster removes only this process's record.

import (
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/pgidem/pgidem/internal/pgcluster"
)

func TestD233ReviewServerRecord(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, clusterServerFile)
	write := func(s string) {
		t.Helper()
		if err := os.WriteFile(p, []byte(s), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	// A live process other than this one.
	other := exec.Command("sleep", "60")
	if err := other.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = other.Process.Kill(); _ = other.Wait() })
	op := strconv.Itoa(other.Process.Pid)
	start, ok := processStart(other.Process.Pid)
	if !ok {
		t.Skip("no /proc")
	}
	for rec, want := range map[string]bool{
		op + "\n":                      true, // an earlier release's record of a live server
		op:                             true, // without the newline
		" " + op + "  " + start + "\n": true, // spaces around
		op + " " + start + "\n":        true,
		op + "\t" + start:              true,
		op + " " + start + " extra":    true,
		op + " 1\n":                    false, // another start time: a reused number
		"":                             false,
		"\n":                           false,
		"abc":                          false,
		"-1":                           false, // kill(-1, 0) would ask about every process
		"-" + op:                       false,
		"0":                            false,
		"+" + op:                       true, // strconv.Atoi takes the sign, as the previous release did
		"99999999999999999999999":      false,
		"4194304":                      false, // past pid_max
		op + "abc":                     false,
		"\x00\xff":                     false,
	} {
		write(rec)
		if got := clusterServerAlive(dir); got != want {
			t.Errorf("record %q: alive %v, want %v", rec, got, want)
		}
	}
	// releaseCluster removes this process's record only: not another's, nor garbage.
	m := &Main{log: slog.New(slog.NewTextHandler(io.Discard, nil)), cluster: &pgcluster.Cluster{Dir: dir}, ownsCluster: true}
	for _, rec := range []string{op + " " + start + "\n", op + "\n", "garbage", ""} {
		write(rec)
		m.releaseCluster()
		if b, err := os.ReadFile(p); err != nil || string(b) != rec {
			t.Errorf("releaseCluster with another's record %q: %q %v, want it kept", rec, b, err)
		}
	}
	self := strconv.Itoa(os.Getpid())
	for _, rec := range []string{self + "\n", self + " 1\n"} {
		write(rec)
		m.releaseCluster()
		if _, err := os.Stat(p); !os.IsNotExist(err) {
			t.Logf("releaseCluster kept the record %q of this process number: %v", strings.TrimSpace(rec), err)
		}
	}
}

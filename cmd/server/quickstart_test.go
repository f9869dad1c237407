package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestQuickstart runs the README's quickstart block verbatim against a real server on a
// fresh database: only the address (localhost:8080 becomes the test server's) and the
// program (`go run ./cmd/server` becomes a binary built once) are substituted.
func TestQuickstart(t *testing.T) {
	t.Parallel()
	if _, err := exec.LookPath("curl"); err != nil {
		t.Fatal("curl is needed to run the README quickstart: apt-get install curl")
	}
	readme, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	_, rest, ok := strings.Cut(string(readme), "<!-- quickstart:begin -->\n```sh\n")
	script, _, ok2 := strings.Cut(rest, "```\n<!-- quickstart:end -->")
	if !ok || !ok2 {
		t.Fatal("README.md has no quickstart block between <!-- quickstart:begin --> and <!-- quickstart:end -->")
	}
	bin := filepath.Join(t.TempDir(), "server")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	s := startServer(t, nil)
	host := strings.TrimPrefix(s.url, "http://")
	script = strings.ReplaceAll(script, "localhost:8080", host)
	script = strings.ReplaceAll(script, "go run ./cmd/server", bin)

	cmd := exec.Command("bash", "-euo", "pipefail", "-c", script)
	cmd.Env = append(os.Environ(), "DATABASE_URL="+s.db)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("the quickstart failed: %v\n%s", err, out)
	}
	text := string(out)
	for _, want := range []string{
		`"amount":10000`,                 // the deposit
		"HTTP/1.1 201 Created",           // the transfer
		"Idempotent-Replayed: true",      // its retry
		`"code":"idempotency_key_reuse"`, // another amount under the same key
		`"changed_fields":["amount"]`,
		`"balance":7500`, // moved once
	} {
		if !strings.Contains(text, want) {
			t.Errorf("the quickstart's output lacks %s:\n%s", want, text)
		}
	}
	if n := s.count(`SELECT count(*) FROM ledger.transfers`); n != 1 {
		t.Errorf("%d transfers, want 1", n)
	}
}

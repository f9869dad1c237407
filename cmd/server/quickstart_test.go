package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/internal/pgcluster"
)

// TestQuickstart runs the README's quickstart blocks (curl, then psql) verbatim against a
// real server on a fresh database: only the address (localhost:8080 becomes the test server's) and the
// program (`go run ./cmd/server` becomes a binary built once) are substituted.
func TestQuickstart(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	out := runQuickstart(t, s, s.db)
	if n := s.count(`SELECT count(*) FROM ledger.transfers`); n != 1 {
		t.Errorf("%d transfers, want 1:\n%s", n, out)
	}
	runQuickstartPsql(t, s.db) // against the same database
}

// readmeBlock returns the README's block between <!-- name:begin --> plus the opening fence
// and the closing fence plus <!-- name:end -->.
func readmeBlock(t *testing.T, name, fence string) string {
	t.Helper()
	readme, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	_, rest, ok := strings.Cut(string(readme), "<!-- "+name+":begin -->\n```"+fence+"\n")
	block, _, ok2 := strings.Cut(rest, "```\n<!-- "+name+":end -->")
	if !ok || !ok2 {
		t.Fatalf("README.md has no %s block between <!-- %s:begin --> and <!-- %s:end -->", fence, name, name)
	}
	return block
}

// runQuickstart runs the README's curl quickstart against s, with databaseURL as the
// DATABASE_URL of its `principal create`, checks what it printed, and returns it.
func runQuickstart(t *testing.T, s *testServer, databaseURL string) string {
	t.Helper()
	if _, err := exec.LookPath("curl"); err != nil {
		t.Fatal("curl is needed to run the README quickstart: apt-get install curl")
	}
	script := readmeBlock(t, "quickstart", "sh")
	script = strings.ReplaceAll(script, "localhost:8080", strings.TrimPrefix(s.url, "http://"))
	script = strings.ReplaceAll(script, "go run ./cmd/server", serverBinary(t))
	cmd := exec.Command("bash", "-euo", "pipefail", "-c", script)
	cmd.Env = append(os.Environ(), "DATABASE_URL="+databaseURL)
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
	return text
}

// runQuickstartPsql runs the README's psql quickstart with psql against url and checks what
// it printed: a claim with its token, then the replay of the stored answer.
func runQuickstartPsql(t *testing.T, url string) {
	t.Helper()
	pgbin, err := pgcluster.BinDir()
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	psql := exec.Command(filepath.Join(pgbin, "psql"), "-X", "-v", "ON_ERROR_STOP=1")
	psql.Env = append(os.Environ(), "PGHOST="+cfg.Host, "PGPORT="+strconv.Itoa(int(cfg.Port)), "PGUSER="+cfg.User,
		"PGPASSWORD="+cfg.Password, "PGDATABASE="+cfg.Database)
	psql.Stdin = strings.NewReader(readmeBlock(t, "quickstart-psql", "sql"))
	out, err := psql.CombinedOutput()
	if err != nil {
		t.Fatalf("the psql quickstart failed: %v\n%s", err, out)
	}
	if !regexp.MustCompile(`claimed with token \d+`).Match(out) || !regexp.MustCompile(`replay +\| +201 \| \{"id":1\}`).Match(out) {
		t.Errorf("the psql quickstart printed:\n%s", out)
	}
}

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
	bin := serverBinary(t)
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

	// The psql part, against the same database.
	_, rest, ok = strings.Cut(string(readme), "<!-- quickstart-psql:begin -->\n```sql\n")
	session, _, ok2 := strings.Cut(rest, "```\n<!-- quickstart-psql:end -->")
	if !ok || !ok2 {
		t.Fatal("README.md has no psql block between <!-- quickstart-psql:begin --> and <!-- quickstart-psql:end -->")
	}
	pgbin, err := pgcluster.BinDir()
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := pgx.ParseConfig(s.db)
	if err != nil {
		t.Fatal(err)
	}
	psql := exec.Command(filepath.Join(pgbin, "psql"), "-X", "-v", "ON_ERROR_STOP=1")
	psql.Env = append(os.Environ(), "PGHOST="+cfg.Host, "PGPORT="+strconv.Itoa(int(cfg.Port)), "PGUSER="+cfg.User,
		"PGPASSWORD="+cfg.Password, "PGDATABASE="+cfg.Database)
	psql.Stdin = strings.NewReader(session)
	out, err = psql.CombinedOutput()
	if err != nil {
		t.Fatalf("the psql quickstart failed: %v\n%s", err, out)
	}
	if !regexp.MustCompile(`claimed with token \d+`).Match(out) || !regexp.MustCompile(`replay +\| +201 \| \{"id":1\}`).Match(out) {
		t.Errorf("the psql quickstart printed:\n%s", out)
	}
}

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

// psqlLikeReadme runs script with psql against url the way the README's line shows it
// (`psql -h 127.0.0.1 -p 54329 -U postgres`: no ON_ERROR_STOP, no psqlrc) and returns what it
// printed.
func psqlLikeReadme(t *testing.T, url, script string) string {
	t.Helper()
	pgbin, err := pgcluster.BinDir()
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	psql := exec.Command(filepath.Join(pgbin, "psql"), "-X")
	psql.Env = append(os.Environ(), "PGHOST="+cfg.Host, "PGPORT="+strconv.Itoa(int(cfg.Port)), "PGUSER="+cfg.User,
		"PGPASSWORD="+cfg.Password, "PGDATABASE="+cfg.Database)
	psql.Stdin = strings.NewReader(script)
	out, err := psql.CombinedOutput()
	if err != nil {
		t.Fatalf("psql: %v\n%s", err, out)
	}
	return string(out)
}

// TestDocQuickstartPsqlTwice: README.md, after the psql quickstart: "It
// prints `claimed with token N` and then a row `replay | 201 | {"id":1}`. Run on a fresh
// `.data/` (a second run finds `note-1` answered already: it prints `replay with token N`, and
// `idem_complete` then refuses the replay's token; ...)". TestQuickstart runs the block once,
// with ON_ERROR_STOP (which the README's command does not set). Here the block, taken from the
// README, runs twice as the README's psql line runs it, as the superuser it names, on a ledger
// with principal alice: the second run's output is the one the README describes.
func TestDocQuickstartPsqlTwice(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	s.principal("alice")
	block := readmeBlock(t, "quickstart-psql", "sql")
	first := psqlLikeReadme(t, s.db, block)
	if !regexp.MustCompile(`(?m)^claimed with token \d+$`).MatchString(first) ||
		!regexp.MustCompile(`replay +\| +201 \| \{"id":1\}`).MatchString(first) || strings.Contains(first, "ERROR") {
		t.Fatalf("the first run printed:\n%s", first)
	}
	second := psqlLikeReadme(t, s.db, block)
	if !regexp.MustCompile(`(?m)^replay with token \d+$`).MatchString(second) {
		t.Errorf("the second run does not print `replay with token N`:\n%s", second)
	}
	if !regexp.MustCompile(`ERROR: +idem_complete: `).MatchString(second) {
		t.Errorf("the second run: idem_complete does not refuse the replay's token:\n%s", second)
	}
	if !regexp.MustCompile(`replay +\| +201 \| \{"id":1\}`).MatchString(second) {
		t.Errorf("the second run does not end with the stored answer:\n%s", second)
	}
}

package tests

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestPgTAP runs the SQL-level suite in tests/sql with pg_prove on a fresh database, so the
// same files a DBA reads and runs by hand are part of `make test`.
func TestPgTAP(t *testing.T) {
	t.Parallel()
	prove, err := exec.LookPath("pg_prove")
	if err != nil {
		t.Fatal("pg_prove not found: apt-get install libtap-parser-sourcehandler-pgtap-perl postgresql-15-pgtap")
	}
	url := pgtest.NewDB(t)
	conn := pgtest.Connect(t, url)
	if _, err := conn.Exec(context.Background(), "CREATE EXTENSION IF NOT EXISTS pgtap"); err != nil {
		t.Fatalf("the pgtap extension is not available on the %s server (install postgresql-15-pgtap there, "+
			"or unset TEST_DATABASE_URL to use a local cluster): %v", pgtest.Source(t), err)
	}
	files, _ := filepath.Glob("sql/*.sql")
	if len(files) == 0 {
		t.Fatal("no pgTAP files in tests/sql")
	}
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(prove, append([]string{"--verbose"}, files...)...)
	cmd.Env = append(os.Environ(), "PGHOST="+cfg.Host, "PGPORT="+strconv.Itoa(int(cfg.Port)),
		"PGUSER="+cfg.User, "PGPASSWORD="+cfg.Password, "PGDATABASE="+cfg.Database)
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "Result: PASS") {
		t.Fatalf("pg_prove failed: %v\n%s", err, out)
	}
	t.Logf("pg_prove:\n%s", lastLines(string(out), 4))
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// Command bench is `make bench`: the SQL-level benchmark of CONTRACT.md section 6.
//
// On a private cluster with fsync and synchronous_commit on (or BENCH_DATABASE_URL's server),
// pgbench drives 16 clients through five variants of one money transfer (an INSERT and an
// UPDATE), interleaved round by round so that drift hits every variant alike:
//
//	nokey        the effect alone
//	functions    idem_begin + effect + idem_complete (transactional claim, guarded)
//	noguard      the same without the commit guard (its foreign key dropped)
//	handwritten  the tutorial's statements: DELETE expired, INSERT ON CONFLICT, effect, UPDATE
//	replay       idem_begin on a completed key
//
// It prints the transactions per second of every run, the median per variant and the ratios
// the contract sets targets for. Then (unless BENCH_HTTP=0) the HTTP part: the reference
// server's POST /v1/transfers without a key, with fresh keys and replayed, with requests per
// second, p50 and p99 latency and their ratios. Environment: BENCH_SECONDS (10),
// BENCH_ROUNDS (3), BENCH_CLIENTS (16), BENCH_HTTP (1), BENCH_DATABASE_URL (unset: private
// cluster in a temporary directory).
package main

import (
	"context"
	"embed"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/internal/pgcluster"
	idemsql "github.com/pgidem/pgidem/sql"
)

//go:embed scripts/*.sql
var scripts embed.FS

type variant struct{ name, script, db string }

var variants = []variant{
	{"nokey", "nokey.sql", "bench"},
	{"functions", "functions.sql", "bench"},
	{"noguard", "functions.sql", "bench_noguard"},
	{"handwritten", "handwritten.sql", "bench"},
	{"replay", "replay.sql", "bench"},
}

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

func envInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil && v > 0 {
		return v
	}
	return def
}

func run() error {
	ctx := context.Background()
	seconds, rounds, clients := envInt("BENCH_SECONDS", 10), envInt("BENCH_ROUNDS", 3), envInt("BENCH_CLIENTS", 16)
	bin, err := pgcluster.BinDir()
	if err != nil {
		return err
	}
	tmp, err := os.MkdirTemp("", "idem-bench-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tmp)
	url := os.Getenv("BENCH_DATABASE_URL")
	if url == "" {
		c, stop, err := pgcluster.StartTemp(ctx, "idem-bench-", map[string]string{
			"max_connections": "100", "shared_buffers": "256MB", "max_wal_size": "4GB",
		})
		if err != nil {
			return err
		}
		defer stop()
		url = c.ConnString("postgres")
	}
	for _, db := range []string{"bench", "bench_noguard"} {
		if err := setup(ctx, url, db); err != nil {
			return fmt.Errorf("setup %s: %w", db, err)
		}
	}
	for _, v := range variants {
		body, _ := scripts.ReadFile("scripts/" + v.script)
		if err := os.WriteFile(filepath.Join(tmp, v.script), body, 0o644); err != nil {
			return err
		}
	}
	fmt.Printf("bench: %d clients, %d rounds of %ds per variant, fsync on, pgbench -M prepared\n", clients, rounds, seconds)
	tps := map[string][]float64{}
	for r := 1; r <= rounds; r++ {
		for _, v := range variants {
			if err := sqlExec(ctx, url, v.db, "CHECKPOINT"); err != nil {
				return err
			}
			t, err := pgbench(bin, url, v, filepath.Join(tmp, v.script), clients, seconds)
			if err != nil {
				return err
			}
			tps[v.name] = append(tps[v.name], t)
			fmt.Printf("  round %d  %-12s %8.0f tps\n", r, v.name, t)
		}
	}
	med := map[string]float64{}
	fmt.Printf("\n%-12s %10s   %s\n", "variant", "median tps", "runs")
	for _, v := range variants {
		med[v.name] = median(tps[v.name])
		fmt.Printf("%-12s %10.0f   %v\n", v.name, med[v.name], round(tps[v.name]))
	}
	ratio := func(label, a, b string, target float64, cmp string) {
		x := med[a] / med[b]
		ok := x >= target
		fmt.Printf("%-44s %5.2f   target %s %.2f  %s\n", label, x, cmp, target, map[bool]string{true: "ok", false: "MISSED"}[ok])
	}
	fmt.Println()
	ratio("functions / no key", "functions", "nokey", 0, ">=")
	ratio("handwritten / no key", "handwritten", "nokey", 0, ">=")
	ratio("functions / hand-written statements", "functions", "handwritten", 1.0, ">=")
	ratio("guard / no guard (functions)", "functions", "noguard", 0.95, ">=")
	ratio("replay / first execution (functions)", "replay", "functions", 3.0, ">=")
	if os.Getenv("BENCH_HTTP") == "0" {
		return nil
	}
	return httpBench(ctx, url, tmp, clients, seconds, rounds)
}

func setupEmpty(ctx context.Context, url, db string) error {
	if err := sqlExec(ctx, url, "", "DROP DATABASE IF EXISTS "+db+" WITH (FORCE)"); err != nil {
		return err
	}
	return sqlExec(ctx, url, "", "CREATE DATABASE "+db)
}

func setup(ctx context.Context, url, db string) error {
	if err := sqlExec(ctx, url, "", "DROP DATABASE IF EXISTS "+db+" WITH (FORCE)"); err != nil {
		return err
	}
	if err := sqlExec(ctx, url, "", "CREATE DATABASE "+db); err != nil {
		return err
	}
	conn, err := connect(ctx, url, db)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	if err := idemsql.Migrate(ctx, conn, idemsql.Options{}); err != nil {
		return err
	}
	stmts := []string{
		`CREATE TABLE bench_accounts (id integer PRIMARY KEY, balance bigint NOT NULL)`,
		`INSERT INTO bench_accounts SELECT i, 0 FROM generate_series(1, 100000) i`,
		`CREATE TABLE bench_transfers (id bigserial PRIMARY KEY, from_id integer NOT NULL, to_id integer NOT NULL,
		   amount bigint NOT NULL, created_at timestamptz NOT NULL DEFAULT now())`,
		`INSERT INTO idem.idempotency_keys (principal_id, key, state, attempt, created_at, expires_at, action,
		   request_sha256, completed_at, response_status, response_headers, response_body)
		 SELECT 'bench', 'r' || i, 'completed', 1, now(), now() + interval '30 days', 'POST /v1/transfers',
		        sha256(('r' || i)::bytea), now(), 201, '{"Content-Type": "application/json"}',
		        '{"id":1,"from":1,"to":2,"amount":1}'
		   FROM generate_series(1, 100000) i`,
		`VACUUM ANALYZE`,
	}
	if db == "bench_noguard" {
		stmts = append(stmts, `ALTER TABLE idem.idempotency_keys DROP CONSTRAINT idempotency_keys_claim_completed_in_its_transaction`)
	}
	for _, s := range stmts {
		if _, err := conn.Exec(ctx, s); err != nil {
			return fmt.Errorf("%s: %w", s, err)
		}
	}
	return nil
}

func connect(ctx context.Context, url, db string) (*pgx.Conn, error) {
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		return nil, err
	}
	if db != "" {
		cfg.Database = db
	}
	return pgx.ConnectConfig(ctx, cfg)
}

func sqlExec(ctx context.Context, url, db, sql string) error {
	conn, err := connect(ctx, url, db)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	_, err = conn.Exec(ctx, sql)
	return err
}

var tpsLine = regexp.MustCompile(`tps = ([0-9.]+) \(without initial connection time\)`)

func pgbench(bin, url string, v variant, script string, clients, seconds int) (float64, error) {
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		return 0, err
	}
	cmd := exec.Command(filepath.Join(bin, "pgbench"), "-n", "-M", "prepared", "-c", strconv.Itoa(clients),
		"-j", "2", "-T", strconv.Itoa(seconds), "-f", script,
		"-h", cfg.Host, "-p", strconv.Itoa(int(cfg.Port)), "-U", cfg.User, v.db)
	cmd.Env = append(os.Environ(), "PGPASSWORD="+cfg.Password)
	start := time.Now()
	out, err := cmd.CombinedOutput()
	if err != nil {
		return 0, fmt.Errorf("pgbench %s: %w\n%s", v.name, err, out)
	}
	m := tpsLine.FindSubmatch(out)
	if m == nil {
		return 0, fmt.Errorf("pgbench %s after %s: no tps in\n%s", v.name, time.Since(start), out)
	}
	return strconv.ParseFloat(string(m[1]), 64)
}

func median(xs []float64) float64 {
	s := append([]float64(nil), xs...)
	sort.Float64s(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

func round(xs []float64) []int {
	out := make([]int, len(xs))
	for i, x := range xs {
		out[i] = int(x + 0.5)
	}
	return out
}

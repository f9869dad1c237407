// Command bench is `make bench`: the performance budget of the project, every figure with
// its target in one summary table (docs/benchmarks.md describes each part and row).
//
// It runs on a private PostgreSQL cluster with fsync and synchronous_commit on (or on
// BENCH_DATABASE_URL's server), reached over TCP loopback. The parts, in order:
//
//	sql         the same money transfer without a key, through the functions (dbidem.RunTx),
//	            without the claim savepoint, without the commit guard, as hand-written
//	            statements on our table, as the seed tutorial's statements on its own table,
//	            and replays: BENCH_CLIENTS goroutines on pgx v5, committed transactions/s
//	latency     functions, seed 001 and no key through an in-process proxy that adds
//	            0.5 ms to every round trip, 4 clients
//	roundtrips  the round trips a keyed request adds through the idemhttp middleware
//	duplicate   how soon a duplicate of a request still running has its answer, on a
//	            transactional and a lease route, from this process and from another
//	rows        the bytes a key stores beyond the response, and on disk
//	fingerprint internal/canon's BenchmarkCompute: every body shape at 64 KiB and at the
//	            1 MiB body limit
//	scale       claim + complete of random keys on a table of BENCH_SCALE_KEYS keys (10
//	            million) against one of 100,000, and the WAL written per transaction
//	cleanup     300,000 expired keys deleted under keyed load, back to back and paced as the
//	            reference server's cleaner runs, and the effect of each on the keyed p99
//	http        the reference server's POST /v1/transfers: no key, fresh key, replay
//	pool        the reference server at several DATABASE_POOL_SIZE values under contended
//	            keyed transfers and uncontended keyed deposits
//	soak        the reference server under keyed deposits with a 20 s TTL: the key table's
//	            size against its live data
//	upgrade     release 0.1.0's keyed deposits while this release's migrate rebuilds a key
//	            table of BENCH_UPGRADE_KEYS keys (1.5 million): the old release's slowest
//	            request and its answers until the swap
//
// Measured variants run in interleaved rounds (round 1: every variant, round 2: every
// variant, ...) so that drift hits every variant alike; figures are medians over rounds.
//
// Environment: BENCH_SECONDS (10) per run, BENCH_ROUNDS (3), BENCH_CLIENTS (16),
// BENCH_SOAK_SECONDS (150), BENCH_SCALE_KEYS (10000000), BENCH_UPGRADE_KEYS (1500000),
// BENCH_ONLY (a comma list of parts; default all), BENCH_SQL_VARIANTS (a comma list of the sql part's
// variants, for an A/B with more rounds; default all), BENCH_LATENCY_CLIENTS (4) and
// BENCH_LATENCY_VARIANTS (nokey,functions,seed001; any of the sql part's on the bench database)
// for the latency part, BENCH_CPUPROFILE (a file for a Go CPU profile of the run),
// BENCH_DATABASE_URL (unset: a private cluster in a temporary directory).
package main

import (
	"context"
	"errors"
	"fmt"
	"math"
	"os"
	"os/signal"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/internal/pgcluster"
)

// parts is every part in the order they run.
var parts = []struct {
	name string
	run  func(ctx context.Context, b *bench) error
}{
	{"sql", sqlPart},
	{"cpu", cpuPart},
	{"latency", latencyPart},
	{"roundtrips", roundTripsPart},
	{"duplicate", duplicatePart},
	{"rows", rowsPart},
	{"fingerprint", fingerprintPart},
	{"scale", scalePart},
	{"cleanup", cleanupPart},
	{"http", httpPart},
	{"pool", poolPart},
	{"soak", soakPart},
	{"upgrade", upgradePart},
}

// bench is one run of the tool: its settings, the server it measures and the rows of the
// summary.
type bench struct {
	seconds, rounds, clients, soakSeconds, scaleKeys, upgradeKeys int
	// url is a connection string to the server's maintenance database (postgres); every
	// part connects to databases of its own on the same server.
	url string
	// upstream is the server's TCP address (host:port) for the latency proxy; "" when the
	// server is reached over a Unix socket only.
	upstream string
	tmp      string
	// serverBin is the reference server, built once for the http and soak parts.
	serverBin string
	ready     map[string]bool // databases set up
	rows      []row
}

// row is one line of the summary: a measure, its value, its target and the verdict.
type row struct{ measure, value, target, status string }

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	// BENCH_CPUPROFILE: a Go CPU profile of this process (the driver, pgx and the load
	// generator) for the whole run, for `go tool pprof`.
	if path := os.Getenv("BENCH_CPUPROFILE"); path != "" {
		f, err := os.Create(path)
		if err == nil {
			err = pprof.StartCPUProfile(f)
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "bench: BENCH_CPUPROFILE:", err)
			os.Exit(1)
		}
		defer func() {
			pprof.StopCPUProfile()
			_ = f.Close()
		}()
	}
	err := run(ctx)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		pprof.StopCPUProfile()
		os.Exit(1)
	}
}

func envInt(name string, def int) (int, error) {
	v := strings.TrimSpace(os.Getenv(name))
	if v == "" {
		return def, nil
	}
	n, err := strconv.Atoi(v)
	if err != nil || n <= 0 {
		return 0, fmt.Errorf("%s=%q: want a positive integer", name, v)
	}
	return n, nil
}

func run(ctx context.Context) error {
	started := time.Now()
	b := &bench{ready: map[string]bool{}}
	var errs []error
	for _, s := range []struct {
		name string
		dst  *int
		def  int
	}{{"BENCH_SECONDS", &b.seconds, 10}, {"BENCH_ROUNDS", &b.rounds, 3}, {"BENCH_CLIENTS", &b.clients, 16},
		{"BENCH_SOAK_SECONDS", &b.soakSeconds, 150}, {"BENCH_SCALE_KEYS", &b.scaleKeys, 10_000_000},
		{"BENCH_UPGRADE_KEYS", &b.upgradeKeys, 1_500_000}} {
		n, err := envInt(s.name, s.def)
		errs = append(errs, err)
		*s.dst = n
	}
	only, err := parseOnly(os.Getenv("BENCH_ONLY"))
	errs = append(errs, err)
	if err := errors.Join(errs...); err != nil {
		return err
	}

	tmp, err := os.MkdirTemp("", "idem-bench-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tmp)
	b.tmp = tmp

	b.url = os.Getenv("BENCH_DATABASE_URL")
	if b.url == "" {
		c, stop, err := pgcluster.StartTemp(ctx, "idem-bench-", map[string]string{
			"max_connections": "100", "shared_buffers": "256MB", "max_wal_size": "4GB",
			"fsync": "on", "synchronous_commit": "on",
		})
		if err != nil {
			return err
		}
		defer stop()
		b.upstream = c.TCPHostPort()
		host, port, _ := strings.Cut(b.upstream, ":")
		b.url = fmt.Sprintf("host=%s port=%s user=postgres dbname=postgres sslmode=disable", host, port)
	} else {
		cfg, err := pgx.ParseConfig(b.url)
		if err != nil {
			return fmt.Errorf("BENCH_DATABASE_URL: %w", err)
		}
		if !strings.HasPrefix(cfg.Host, "/") {
			b.upstream = fmt.Sprintf("%s:%d", cfg.Host, cfg.Port)
		}
	}
	settings, err := serverSettings(ctx, b.url)
	if err != nil {
		return err
	}

	var names []string
	for _, p := range parts {
		if only[p.name] {
			names = append(names, p.name)
		}
	}
	fmt.Printf("bench: %d clients, %d rounds of %ds per variant, soak %ds; parts: %s\n", b.clients, b.rounds, b.seconds,
		b.soakSeconds, strings.Join(names, ", "))
	est := b.estimate(only)
	if est > 2*time.Minute {
		est = est.Round(time.Minute)
	} else {
		est = est.Round(10 * time.Second)
	}
	fmt.Printf("bench: PostgreSQL %s; expected run time about %s\n", settings, est)

	var failed []string
	for _, p := range parts {
		if !only[p.name] {
			continue
		}
		if ctx.Err() != nil {
			break
		}
		fmt.Printf("\n=== %s\n", p.name)
		first := len(b.rows)
		t0 := time.Now()
		if err := p.run(ctx, b); err != nil {
			fmt.Fprintf(os.Stderr, "bench: part %s failed: %v\n", p.name, err)
			failed = append(failed, p.name)
			b.rows = append(b.rows, row{p.name + ": FAILED (" + firstLine(err.Error()) + ")", "-", "-", "MISSED"})
		}
		fmt.Println()
		printRows(b.rows[first:])
		fmt.Printf("(%s took %s)\n", p.name, time.Since(t0).Round(time.Second))
	}

	fmt.Printf("\n=== summary (%s, %d clients, %d rounds of %ds, soak %ds, took %s)\n\n", settings, b.clients,
		b.rounds, b.seconds, b.soakSeconds, time.Since(started).Round(time.Second))
	printRows(b.rows)
	if ctx.Err() != nil {
		return ctx.Err()
	}
	if len(failed) > 0 {
		return fmt.Errorf("failed parts: %s", strings.Join(failed, ", "))
	}
	return nil
}

func parseOnly(v string) (map[string]bool, error) {
	only := map[string]bool{}
	if strings.TrimSpace(v) == "" {
		for _, p := range parts {
			only[p.name] = true
		}
		return only, nil
	}
	var known []string
	for _, p := range parts {
		known = append(known, p.name)
	}
	for _, name := range strings.Split(v, ",") {
		name = strings.TrimSpace(name)
		if name == "" {
			continue
		}
		if !slices.Contains(known, name) {
			return nil, fmt.Errorf("BENCH_ONLY: unknown part %q; the parts are %s", name, strings.Join(known, ", "))
		}
		only[name] = true
	}
	if len(only) == 0 {
		return nil, errors.New("BENCH_ONLY names no part")
	}
	return only, nil
}

// estimate is the expected duration of the selected parts (measured runs plus setup, on a
// 2-core machine).
func (b *bench) estimate(only map[string]bool) time.Duration {
	s, r := float64(b.seconds), float64(b.rounds)
	est := map[string]float64{
		"sql":         10 + float64(len(sqlVariants))*r*(s+0.5),
		"latency":     5 + float64(len(latencyVariants))*r*(s+0.3),
		"roundtrips":  2,
		"duplicate":   10,
		"rows":        15,
		"fingerprint": 60,
		// 10 million keys take about 4 minutes to load on a 2-core machine, and the part loads
		// two such tables (random and time-ordered keys).
		"scale":   20 + 2*float64(b.scaleKeys)/40_000 + 5*r*(s+1),
		"cleanup": 5 + r*(s+2*(s+7)),
		"http":    15 + 3*r*s,
		"pool":    15 + r*float64(len(poolSizes))*(2*s+1),
		"soak":    10 + float64(b.soakSeconds),
		// 1.5 million keys take about a minute to load and two to rebuild online.
		"upgrade": 10 + float64(b.upgradeKeys)/8_000,
	}
	total := 0.0
	for name, sec := range est {
		if only[name] {
			total += sec
		}
	}
	return time.Duration(total * float64(time.Second))
}

// serverSettings describes the server: version, fsync, synchronous_commit.
func serverSettings(ctx context.Context, url string) (string, error) {
	conn, err := connect(ctx, url, "")
	if err != nil {
		return "", err
	}
	defer conn.Close(ctx)
	var version, fsync, sync string
	err = conn.QueryRow(ctx, `SELECT current_setting('server_version'), current_setting('fsync'),
		current_setting('synchronous_commit')`).Scan(&version, &fsync, &sync)
	return fmt.Sprintf("%s, fsync %s, synchronous_commit %s", version, fsync, sync), err
}

// ratio adds a row for a ratio with a target (op ">=" or "<="; op "" for information).
func (b *bench) ratio(measure string, x float64, op string, target float64) {
	b.check(measure, fmt.Sprintf("%.2f", x), x, op, target, "%.2f")
}

// check adds a row for value x shown as value, against target (op "" for information).
func (b *bench) check(measure, value string, x float64, op string, target float64, targetFormat string) {
	r := row{measure: measure, value: value, target: "-", status: "-"}
	if math.IsNaN(x) || math.IsInf(x, 0) {
		r.value = "n/a"
	}
	if op != "" {
		r.target = op + " " + fmt.Sprintf(targetFormat, target)
		ok := false
		switch op {
		case ">=":
			ok = x >= target
		case "<=":
			ok = x <= target
		case "=":
			ok = x == target
			r.target = fmt.Sprintf(targetFormat, target)
		}
		r.status = map[bool]string{true: "ok", false: "MISSED"}[ok]
	}
	b.rows = append(b.rows, r)
}

// info adds a row without a target.
func (b *bench) info(measure, value string) {
	b.rows = append(b.rows, row{measure, value, "-", "-"})
}

func printRows(rows []row) {
	width := len("measure")
	for _, r := range rows {
		width = max(width, len(r.measure))
	}
	fmt.Printf("%-*s  %12s  %10s  %s\n", width, "measure", "value", "target", "ok/MISSED")
	for _, r := range rows {
		fmt.Printf("%-*s  %12s  %10s  %s\n", width, r.measure, r.value, r.target, r.status)
	}
}

func firstLine(s string) string {
	s, _, _ = strings.Cut(s, "\n")
	if len(s) > 120 {
		s = s[:120] + "..."
	}
	return s
}

func median(xs []float64) float64 {
	if len(xs) == 0 {
		return math.NaN()
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// percentile is the p-th quantile (0..1) of sorted durations, in milliseconds.
func percentile(sorted []time.Duration, p float64) float64 {
	if len(sorted) == 0 {
		return math.NaN()
	}
	return float64(sorted[int(p*float64(len(sorted)-1)+0.5)]) / float64(time.Millisecond)
}

func rounded(xs []float64) []int {
	out := make([]int, len(xs))
	for i, x := range xs {
		out[i] = int(x + 0.5)
	}
	return out
}

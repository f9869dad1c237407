package main

import (
	"context"
	"fmt"
	"os"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// cpuPart is the profile of the SQL part's variants: one client, one connection, the
// server's CPU per transaction (the backend's user + system time, read from /proc, so the
// server must run on this machine) and the client's (this process), for each variant in
// interleaved rounds. On 2 cores at 16 clients the SQL part's throughput is CPU-bound: these
// per-transaction figures are where its ratios come from, without the noise of contention.
func cpuPart(ctx context.Context, b *bench) error {
	pools := map[string]*pgxpool.Pool{}
	pids := map[string]int{}
	defer func() {
		for _, p := range pools {
			p.Close()
		}
	}()
	for _, v := range sqlVariants {
		if pools[v.db] != nil {
			continue
		}
		if err := b.database(ctx, v.db); err != nil {
			return err
		}
		p, err := openPool(ctx, b.url, v.db, 1, nil)
		if err != nil {
			return err
		}
		pools[v.db] = p
		var pid int
		if err := p.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
			return err
		}
		if _, err := backendCPU(pid); err != nil {
			return fmt.Errorf("cpu: the server's backends must run on this machine (/proc): %w", err)
		}
		pids[v.db] = pid
	}
	perRun := 3000
	variants := sqlVariants
	if only := os.Getenv("BENCH_CPU_VARIANTS"); only != "" {
		// For a profile (perf record -p, the backend's pid printed here): some variants, longer.
		variants = nil
		for _, v := range sqlVariants {
			if slices.Contains(strings.Split(only, ","), v.name) {
				variants = append(variants, v)
				fmt.Printf("cpu: %s runs on the backend with pid %d\n", v.name, pids[v.db])
			}
		}
		perRun = 30000
		if path := os.Getenv("BENCH_PPROF"); path != "" {
			// This process's side of those variants, for go tool pprof.
			f, err := os.Create(path)
			if err != nil {
				return err
			}
			defer f.Close()
			if err := pprof.StartCPUProfile(f); err != nil {
				return err
			}
			defer pprof.StopCPUProfile()
		}
	}
	fmt.Printf("CPU: one client, one connection, %d transactions per variant and round, %d rounds; the backend's CPU (µs/transaction, from /proc) and this process's\n",
		perRun, b.rounds)
	server := map[string][]float64{}
	client := map[string][]float64{}
	wal := map[string][]float64{}
	for r := 1; r <= b.rounds; r++ {
		for _, v := range variants {
			pool, pid := pools[v.db], pids[v.db]
			w := &worker{rng: newRand()}
			// A few transactions first: the plans are cached, the pages warm.
			for range 200 {
				if err := v.tx(ctx, pool, w); err != nil {
					return fmt.Errorf("%s: %w", v.name, err)
				}
			}
			s0, err := backendCPU(pid)
			if err != nil {
				return err
			}
			w0, err := walLSN(ctx, pool)
			if err != nil {
				return err
			}
			c0 := cpuTime()
			for range perRun {
				if err := v.tx(ctx, pool, w); err != nil {
					return fmt.Errorf("%s: %w", v.name, err)
				}
			}
			s1, err := backendCPU(pid)
			if err != nil {
				return err
			}
			cv := float64((cpuTime() - c0).Microseconds()) / float64(perRun)
			w1, err := walLSN(ctx, pool)
			if err != nil {
				return err
			}
			sv := float64((s1 - s0).Microseconds()) / float64(perRun)
			wv := float64(w1-w0) / float64(perRun)
			server[v.name] = append(server[v.name], sv)
			client[v.name] = append(client[v.name], cv)
			wal[v.name] = append(wal[v.name], wv)
			fmt.Printf("  round %d  %-12s server %6.1f µs  client %6.1f µs  WAL %6.0f B\n", r, v.name, sv, cv, wv)
			if os.Getenv("BENCH_CPU_VARIANTS") != "" {
				fmt.Printf("    WAL from %X/%X to %X/%X\n", w0>>32, uint32(w0), w1>>32, uint32(w1))
			}
			if r == 1 {
				if err := walMakeUp(ctx, pool, w0, w1, perRun); err != nil {
					fmt.Printf("    (no WAL make-up: %v)\n", err)
				}
			}
		}
	}
	fmt.Printf("  %-12s %10s %10s %10s %10s\n", "median", "server µs", "client µs", "sum µs", "WAL B")
	med := map[string]float64{}
	for _, v := range variants {
		s, c := median(server[v.name]), median(client[v.name])
		med[v.name] = s + c
		fmt.Printf("  %-12s %10.1f %10.1f %10.1f %10.0f\n", v.name, s, c, s+c, median(wal[v.name]))
	}
	b.ratio("CPU: seed 001 / functions (µs per transaction, server + client)", med["seed001"]/med["functions"], "", 0)
	b.ratio("CPU: hand-written / functions (µs per transaction)", med["handwritten"]/med["functions"], "", 0)
	b.ratio("CPU: first execution / replay (µs per transaction)", med["functions"]/med["replay"], "", 0)
	return nil
}

// walLSN is the server's current WAL insert position, in bytes.
func walLSN(ctx context.Context, pool *pgxpool.Pool) (int64, error) {
	var n int64
	err := pool.QueryRow(ctx, `SELECT pg_current_wal_insert_lsn() - '0/0'`).Scan(&n)
	return n, err
}

// walMakeUp prints what the WAL between two positions is made of, per transaction: record
// bytes and full-page images by resource manager and record type (pg_walinspect).
func walMakeUp(ctx context.Context, pool *pgxpool.Pool, from, to int64, n int) error {
	if _, err := pool.Exec(ctx, `CREATE EXTENSION IF NOT EXISTS pg_walinspect`); err != nil {
		return err
	}
	rows, err := pool.Query(ctx, `SELECT "resource_manager/record_type", count, record_size, fpi_size
		  FROM pg_get_wal_stats('0/0'::pg_lsn + $1::numeric, '0/0'::pg_lsn + $2::numeric, true)
		 WHERE count > 0 ORDER BY combined_size DESC`, from, to)
	if err != nil {
		return err
	}
	defer rows.Close()
	for rows.Next() {
		var rm string
		var count, rec, fpi int64
		if err := rows.Scan(&rm, &count, &rec, &fpi); err != nil {
			return err
		}
		if float64(rec+fpi)/float64(n) < 1 {
			continue
		}
		fmt.Printf("    %-28s %5.2f records  %7.1f B  FPI %7.1f B\n", rm, float64(count)/float64(n),
			float64(rec)/float64(n), float64(fpi)/float64(n))
	}
	return rows.Err()
}

// backendCPU is the user + system time of the process pid, from /proc/pid/stat.
func backendCPU(pid int) (time.Duration, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	// The fields after the command's closing parenthesis: utime and stime are the 12th and
	// 13th of them (fields 14 and 15 of the line).
	s := string(b)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
	if len(f) < 13 {
		return 0, fmt.Errorf("/proc/%d/stat: %q", pid, s)
	}
	ut, err1 := strconv.ParseInt(f[11], 10, 64)
	st, err2 := strconv.ParseInt(f[12], 10, 64)
	if err1 != nil || err2 != nil {
		return 0, fmt.Errorf("/proc/%d/stat: %q", pid, s)
	}
	const hz = 100 // USER_HZ on Linux
	return time.Duration(ut+st) * time.Second / hz, nil
}

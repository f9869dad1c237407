package main

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/internal/dbidem"
)

const (
	// expiredKeys are inserted before each round's pair of phases.
	expiredKeys = 300_000
	// cleanupBatch is the batch size of each idem_cleanup call.
	cleanupBatch = 5000
	// cleanupWarmup is how long the keyed load runs before the cleanup starts (and before
	// the window that the load without cleanup is compared over).
	cleanupWarmup = time.Second
)

// cleanupPart runs the functions variant without a cleanup, then with a cleanup of
// expiredKeys expired keys running alongside as fast as it can (idem_cleanup(cleanupBatch)
// passes back to back: the capacity), then with the cleanup a scheduled cleaner runs (the SQL
// API's batch size, paced to dbidem.DefaultCleanupDuty), round by round. It compares the keyed
// p99 over each cleanup's window with the p99 over the same window of the run without, and
// the paced cleanup's rate with the rate keys expire at under this load (the keyed rate).
func cleanupPart(ctx context.Context, b *bench) error {
	if err := b.database(ctx, "bench_cleanup"); err != nil {
		return err
	}
	pool, err := openPool(ctx, b.url, "bench_cleanup", b.clients, nil)
	if err != nil {
		return err
	}
	defer pool.Close()
	cleaner, err := openPool(ctx, b.url, "bench_cleanup", 1, nil)
	if err != nil {
		return err
	}
	defer cleaner.Close()
	// The expired keys' field hashes: those of a transfer body, as the functions store them.
	blob := fieldsBlob((&worker{rng: newRand()}).request().fp.Fields)

	phase := time.Duration(b.seconds) * time.Second
	fmt.Printf("cleanup: %d expired keys per cleanup, on a connection of its own, under %d clients of the functions variant; %d rounds of: idem_cleanup(%d) passes back to back (sprint), then the paced cleaner (the SQL API's batch size, duty %.2f), each followed by the same load without a cleanup for as long; the cleanup starts after %s, the load runs at least %s\n",
		expiredKeys, b.clients, b.rounds, cleanupBatch, dbidem.DefaultCleanupDuty, cleanupWarmup, phase)
	type variant struct {
		name  string
		batch int
		duty  float64
	}
	variants := []variant{{"sprint", cleanupBatch, 1}, {"paced", 0, dbidem.DefaultCleanupDuty}}
	var (
		keyedRates []float64
		rates      = map[string][]float64{}
		lat        = map[string][]time.Duration{} // with the cleanup
		latOff     = map[string][]time.Duration{} // the same windows without
		fails      failures
	)
	keyed := func(ctx context.Context, w *worker) error { return functionsTx(ctx, pool, w) }
	insert := func(r int, v string) error {
		t0 := time.Now()
		if _, err := pool.Exec(ctx, `INSERT INTO idem.idempotency_keys
			  (expires_at, attempt, action_hash, state, principal_id, key, request_sha256, request_fields,
			   response_status, response_headers, response_body)
			SELECT now() - interval '1 hour' - i * interval '1 millisecond', nextval('idem.token_seq'),
			       hashtextextended($1, 0), 'c', $2, k.key, sha256(convert_to(k.key, 'UTF8')), $3, 201, $4::jsonb, $5
			  FROM generate_series(1, $6::integer) AS i,
			       LATERAL (SELECT format('%s-0000-4000-8000-%s', lpad($7::text, 8, '0'), lpad(i::text, 12, '0')) AS key) AS k`,
			action, principal, blob, responseHeaderJSON, responseBody, expiredKeys, fmt.Sprintf("%d%s", r, v[:1])); err != nil {
			return fmt.Errorf("insert the expired keys: %w", err)
		}
		// Keys expire a TTL (a day by default) after they were written: by then vacuum has
		// visited their pages (hint bits set, all-visible). What is left for cleanup is
		// what a day-old page costs after a checkpoint: a full-page image for each.
		if _, err := pool.Exec(ctx, `VACUUM idem.idempotency_keys`); err != nil {
			return err
		}
		if err := checkpoint(ctx, pool); err != nil {
			return err
		}
		fmt.Printf("  round %d  %d expired keys inserted (%s)\n", r, expiredKeys, time.Since(t0).Round(100*time.Millisecond))
		return nil
	}
	for r := 1; r <= b.rounds; r++ {
		for _, v := range variants {
			if err := insert(r, v.name); err != nil {
				return err
			}
			// The cleanup starts after the warm-up and runs until no expired key is left;
			// the load stops at the end of the phase or of the cleanup, whichever is later.
			var (
				deleted  int
				took     time.Duration
				cleanErr error
			)
			stop := make(chan struct{})
			go func() {
				defer close(stop)
				select {
				case <-time.After(cleanupWarmup):
				case <-ctx.Done():
					return
				}
				deadline := time.Now().Add(phase - cleanupWarmup)
				start := time.Now()
				deleted, cleanErr = cleanAll(ctx, cleaner, v.batch, v.duty)
				took = time.Since(start)
				if wait := time.Until(deadline); wait > 0 {
					select {
					case <-time.After(wait):
					case <-ctx.Done():
					}
				}
			}()
			with := drive(ctx, b.clients, stop, keyed)
			if ctx.Err() != nil {
				return ctx.Err()
			}
			if cleanErr != nil {
				return fmt.Errorf("cleanup: %w", cleanErr)
			}
			if deleted < expiredKeys {
				return fmt.Errorf("cleanup deleted %d rows, want %d", deleted, expiredKeys)
			}
			if err := checkpoint(ctx, pool); err != nil {
				return err
			}
			// Without: the same load for as long, right after.
			off := drive(ctx, b.clients, after(with.elapsed), keyed)
			if ctx.Err() != nil {
				return ctx.Err()
			}
			if err := checkpoint(ctx, pool); err != nil {
				return err
			}
			fails.add(v.name, with)
			fails.add("without", off)
			keyedRates = append(keyedRates, off.rate())
			rate := float64(deleted) / took.Seconds()
			rates[v.name] = append(rates[v.name], rate)
			winOff, winWith := window(off.samples, cleanupWarmup, took), window(with.samples, cleanupWarmup, took)
			latOff[v.name], lat[v.name] = append(latOff[v.name], winOff...), append(lat[v.name], winWith...)
			slices.Sort(winOff)
			slices.Sort(winWith)
			fmt.Printf("  round %d  %-7s %6.0f tps, p99 %.2f ms over the window; without %6.0f tps, p99 %.2f ms; deleted %d in %s: %.0f rows/s%s\n",
				r, v.name, with.rate(), percentile(winWith, 0.99), off.rate(), percentile(winOff, 0.99), deleted, took.Round(time.Millisecond),
				rate, with.errNote())
		}
	}
	keyedRate := median(keyedRates)
	p99 := map[string][2]float64{}
	fmt.Println()
	for _, v := range variants {
		slices.Sort(latOff[v.name])
		slices.Sort(lat[v.name])
		p99[v.name] = [2]float64{percentile(lat[v.name], 0.99), percentile(latOff[v.name], 0.99)}
		fmt.Printf("keyed latency over the %s cleanup's windows, all rounds: without p50 %.2f p99 %.2f ms (%d), with p50 %.2f p99 %.2f ms (%d)\n",
			v.name, percentile(latOff[v.name], 0.5), p99[v.name][1], len(latOff[v.name]), percentile(lat[v.name], 0.5), p99[v.name][0], len(lat[v.name]))
	}
	sprint, paced := median(rates["sprint"]), median(rates["paced"])
	b.check("cleanup: capacity, rows/s deleted back to back under keyed load", fmt.Sprintf("%.0f", sprint), sprint, ">=", 200000, "%.0f")
	b.ratio("cleanup back to back: keyed p99 during / without", p99["sprint"][0]/p99["sprint"][1], "", 0)
	b.ratio(fmt.Sprintf("cleanup paced (duty %.2f): keyed p99 during / without", dbidem.DefaultCleanupDuty), p99["paced"][0]/p99["paced"][1], "<=", 1.20)
	b.info("cleanup paced: keyed p99 during / without (ms)", fmt.Sprintf("%.2f / %.2f", p99["paced"][0], p99["paced"][1]))
	b.ratio("cleanup paced: rows/s deleted / keys expiring per second (the keyed tps)", paced/keyedRate, ">=", 10)
	// After an outage of an hour the backlog is an hour of keyed requests, and keys keep
	// expiring at the keyed rate while the cleaner works it off.
	catchUp := keyedRate * 3600 / (paced - keyedRate) / 60
	b.check("cleanup paced: minutes to catch up after a 1 h outage", fmt.Sprintf("%.1f", catchUp), catchUp, "<=", 60, "%.0f")
	return fails.err()
}

// cleanAll runs dbidem.CleanupPaced passes until no expired key is left.
func cleanAll(ctx context.Context, pool *pgxpool.Pool, batch int, duty float64) (int, error) {
	total := 0
	for {
		n, err := dbidem.CleanupPaced(ctx, pool, batch, duty)
		total += n
		if err != nil {
			return total, err
		}
		var left bool
		if err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT FROM idem.idempotency_keys WHERE expires_at <= now())`).Scan(&left); err != nil {
			return total, err
		}
		if !left || n == 0 {
			return total, nil
		}
	}
}

// window returns the latencies of the transactions that started in [from, from+d).
func window(samples []sample, from, d time.Duration) []time.Duration {
	var out []time.Duration
	for _, s := range samples {
		if s.at >= from && s.at < from+d {
			out = append(out, s.lat)
		}
	}
	return out
}

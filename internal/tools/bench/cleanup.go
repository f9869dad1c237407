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

// cleanupPart runs the functions variant with and without a cleanup of expiredKeys expired
// keys running alongside, round by round (without, then with), and compares the keyed p99
// over the cleanup's window with the p99 over the same window of the run without.
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
	fmt.Printf("cleanup: %d expired keys per round, idem_cleanup(%d) passes on a connection of their own, under %d clients of the functions variant; %d rounds of %s without, then with (at least), the cleanup starting after %s\n",
		expiredKeys, cleanupBatch, b.clients, b.rounds, phase, cleanupWarmup)
	var (
		rates           []float64
		latWith, latOff []time.Duration
		fails           failures
	)
	keyed := func(ctx context.Context, w *worker) error { return functionsTx(ctx, pool, w) }
	for r := 1; r <= b.rounds; r++ {
		t0 := time.Now()
		if _, err := pool.Exec(ctx, `INSERT INTO idem.idempotency_keys
			  (expires_at, attempt, action_hash, state, principal_id, key, request_sha256, request_fields,
			   response_status, response_headers, response_body)
			SELECT now() - interval '1 hour' - i * interval '1 millisecond', nextval('idem.attempt_seq'),
			       hashtextextended($1, 0), 'c', $2, k.key, sha256(convert_to(k.key, 'UTF8')), $3, 201, $4::jsonb, $5
			  FROM generate_series(1, $6::integer) AS i,
			       LATERAL (SELECT format('%s-0000-4000-8000-%s', lpad($7::text, 8, '0'), lpad(i::text, 12, '0')) AS key) AS k`,
			action, principal, blob, responseHeaderJSON, responseBody, expiredKeys, fmt.Sprint(r)); err != nil {
			return fmt.Errorf("insert the expired keys: %w", err)
		}
		if err := checkpoint(ctx, pool); err != nil {
			return err
		}
		fmt.Printf("  round %d  %d expired keys inserted (%s)\n", r, expiredKeys, time.Since(t0).Round(100*time.Millisecond))

		off := drive(ctx, b.clients, after(phase), keyed)
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if err := checkpoint(ctx, pool); err != nil {
			return err
		}

		// With: the cleanup starts after the warm-up and runs passes until no expired key is
		// left; the load stops at the end of the phase or of the cleanup, whichever is later.
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
			deleted, cleanErr = cleanAll(ctx, cleaner)
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
		fails.add("without", off)
		fails.add("with", with)
		rate := float64(deleted) / took.Seconds()
		rates = append(rates, rate)
		winOff, winWith := window(off.samples, cleanupWarmup, took), window(with.samples, cleanupWarmup, took)
		latOff, latWith = append(latOff, winOff...), append(latWith, winWith...)
		slices.Sort(winOff)
		slices.Sort(winWith)
		fmt.Printf("  round %d  without %6.0f tps, p99 %.2f ms over the window%s\n", r, off.rate(), percentile(winOff, 0.99), off.errNote())
		fmt.Printf("  round %d  with    %6.0f tps, p99 %.2f ms over the window; deleted %d in %s: %.0f rows/s%s\n", r, with.rate(),
			percentile(winWith, 0.99), deleted, took.Round(time.Millisecond), rate, with.errNote())
	}
	slices.Sort(latOff)
	slices.Sort(latWith)
	p99Off, p99With := percentile(latOff, 0.99), percentile(latWith, 0.99)
	fmt.Printf("\nkeyed latency over the cleanup windows, all rounds: without p50 %.2f p99 %.2f ms (%d), with p50 %.2f p99 %.2f ms (%d)\n",
		percentile(latOff, 0.5), p99Off, len(latOff), percentile(latWith, 0.5), p99With, len(latWith))
	rate := median(rates)
	b.check("cleanup: expired rows deleted per second under keyed load", fmt.Sprintf("%.0f", rate), rate, ">=", 200000, "%.0f")
	b.ratio("keyed p99 during cleanup / without", p99With/p99Off, "<=", 1.20)
	b.info("keyed p99 during cleanup / without (ms)", fmt.Sprintf("%.2f / %.2f", p99With, p99Off))
	return fails.err()
}

// cleanAll runs dbidem.Cleanup passes until no expired key is left.
func cleanAll(ctx context.Context, pool *pgxpool.Pool) (int, error) {
	total := 0
	for {
		n, err := dbidem.Cleanup(ctx, pool, cleanupBatch)
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

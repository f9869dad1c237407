package main

import (
	"context"
	"fmt"
	"net/http"
	"time"
)

// soakSample is the key table at one moment.
type soakSample struct {
	at        time.Duration
	rows      int64
	unexpired int64 // rows whose TTL still runs: the last 20 s of traffic
	total     int64 // pg_total_relation_size
	live      int64 // the live rows' heap tuples and index entries
	peak      int64 // the most live data of this and the earlier samples
}

func (s soakSample) ratio() float64 { return float64(s.total) / float64(s.live) }

// peakRatio is the size against the most live data the table has held so far: the table
// keeps the pages it needed at the peak (vacuum_truncate is off) and reuses them, so when the
// load dips the plain ratio rises without a byte of bloat.
func (s soakSample) peakRatio() float64 { return float64(s.total) / float64(s.peak) }

// soakInterval is how often the soak samples the key table.
const soakInterval = 10 * time.Second

// soakPart drives keyed deposits into the reference server with a 20 s TTL and a cleanup
// every 2 s, and samples the key table's size against its live data.
func soakPart(ctx context.Context, b *bench) error {
	srv, stop, err := b.startServer(ctx, "bench_soak", b.clients, "IDEMPOTENCY_TTL=20s", "CLEANUP_INTERVAL=2s")
	if err != nil {
		return err
	}
	defer stop()
	ids, err := srv.createAccounts(ctx, 200, 0)
	if err != nil {
		return err
	}
	conn, err := connect(ctx, b.url, "bench_soak")
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))

	d := time.Duration(b.soakSeconds) * time.Second
	fmt.Printf("soak: the reference server with IDEMPOTENCY_TTL=20s, CLEANUP_INTERVAL=2s; %d clients of keyed deposits (a fresh key each) for %s; the key table sampled every %s\n",
		b.clients, d, soakInterval)
	fmt.Printf("  %6s %10s %10s %10s %10s %7s %7s\n", "time", "live rows", "unexpired", "total MB", "live MB", "ratio", "/peak")
	var (
		samples   []soakSample
		sampleErr error
	)
	start := time.Now()
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		for i := 1; time.Duration(i)*soakInterval <= d; i++ {
			select {
			case <-time.After(time.Until(start.Add(time.Duration(i) * soakInterval))):
			case <-ctx.Done():
				return
			}
			s := soakSample{at: time.Since(start).Round(time.Second)}
			var heap, pk int64
			if err := conn.QueryRow(ctx, `SELECT count(*), count(*) FILTER (WHERE k.expires_at > now()),
				       coalesce(sum(pg_column_size(k.*) + 4), 0),
				       coalesce(sum(pg_column_size(k.principal_id) + pg_column_size(k.key) + 8 + 4), 0),
				       pg_total_relation_size('idem.idempotency_keys')
				  FROM idem.idempotency_keys k`).Scan(&s.rows, &s.unexpired, &heap, &pk, &s.total); err != nil {
				sampleErr = err
				return
			}
			s.live = heap + pk + s.rows*(8+8+4)
			s.peak = s.live
			if n := len(samples); n > 0 && samples[n-1].peak > s.peak {
				s.peak = samples[n-1].peak
			}
			samples = append(samples, s)
			fmt.Printf("  %6s %10d %10d %10.1f %10.1f %7.2f %7.2f\n", s.at, s.rows, s.unexpired,
				float64(s.total)/1e6, float64(s.live)/1e6, s.ratio(), s.peakRatio())
		}
	}()
	res := drive(ctx, b.clients, after(d), func(ctx context.Context, w *worker) error {
		return srv.send(ctx, fmt.Sprintf("/v1/accounts/%d/deposits", ids[w.rng.IntN(len(ids))]), w.key(), `{"amount":1}`, http.StatusCreated)
	})
	<-sampled
	if ctx.Err() != nil {
		return ctx.Err()
	}
	if sampleErr != nil {
		return sampleErr
	}
	fmt.Printf("soak ran %s: %d keyed deposits, %.0f/s%s\n", res.elapsed.Round(time.Second), res.n, res.rate(), res.errNote())
	var steady, steadyPeak []float64
	for _, s := range samples {
		if 3*s.at >= 2*d {
			steady = append(steady, s.ratio())
			steadyPeak = append(steadyPeak, s.peakRatio())
		}
	}
	b.info("soak: duration, keyed deposits per second", fmt.Sprintf("%.0fs %.0f/s", res.elapsed.Seconds(), res.rate()))
	if res.errors > 0 {
		b.info("soak: failed requests (the first is shown above)", fmt.Sprint(res.errors))
	}
	b.info("key table size / live rows and index entries now (last third of the soak, median)", fmt.Sprintf("%.2f", median(steady)))
	b.ratio("key table size / the most live rows and index entries it held (last third of the soak, median)", median(steadyPeak), "<=", 1.50)
	return nil
}

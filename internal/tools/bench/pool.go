package main

import (
	"context"
	"fmt"
	"net/http"
	"runtime"
	"slices"
	"strings"
	"time"
)

// poolSizes are the DATABASE_POOL_SIZE values the pool part compares.
var poolSizes = []int{4, 8, 12, 20, 32}

const (
	// poolClients drive each load of the pool part.
	poolClients = 12
	// poolHot is how many accounts the contended transfers move money among.
	poolHot = 4
	// poolCold is how many accounts the uncontended deposits spread over.
	poolCold = 1000
)

// poolPart runs the reference server at each of poolSizes (IDEMPOTENCY_MAX_WAITING_CLAIMS
// left at its default, a quarter of the pool) under two keyed loads of poolClients clients:
// transfers among poolHot accounts, where every request waits for the same few rows, and
// deposits to poolCold accounts, where none waits. Rounds interleave the sizes; each run
// starts a server of its own on the same database.
func poolPart(ctx context.Context, b *bench) error {
	const db = "bench_pool"
	srv, stop, err := b.startServer(ctx, db, poolClients, "CLEANUP_INTERVAL=0")
	if err != nil {
		return err
	}
	hot, err := srv.createAccounts(ctx, poolHot, 1_000_000_000_000)
	if err != nil {
		stop()
		return err
	}
	cold, err := srv.createAccounts(ctx, poolCold, 0)
	stop()
	if err != nil {
		return err
	}
	def := defaultPoolSize()
	sizes := slices.Clone(poolSizes)
	if !slices.Contains(sizes, def) {
		sizes = append(sizes, def)
		slices.Sort(sizes)
	}
	loads := []string{"transfers", "deposits"}
	fmt.Printf("pool: the reference server at DATABASE_POOL_SIZE %v (default here: %d); %d clients of keyed transfers among %d accounts, then of keyed deposits to %d accounts; %d rounds of %ds per size and load\n",
		sizes, def, poolClients, poolHot, poolCold, b.rounds, b.seconds)
	type key struct {
		size int
		load string
	}
	rates := map[key][]float64{}
	lats := map[key][]time.Duration{}
	var fails failures
	for r := 1; r <= b.rounds; r++ {
		for _, size := range sizes {
			s, stop, err := b.serve(ctx, db, srv.principal, srv.token, poolClients, fmt.Sprintf("DATABASE_POOL_SIZE=%d", size),
				"CLEANUP_INTERVAL=0")
			if err != nil {
				return err
			}
			for _, load := range loads {
				res := drive(ctx, poolClients, after(time.Duration(b.seconds)*time.Second), func(ctx context.Context, w *worker) error {
					if load == "transfers" {
						a := w.rng.IntN(poolHot)
						c := (a + 1 + w.rng.IntN(poolHot-1)) % poolHot
						return s.send(ctx, "/v1/transfers", w.key(), fmt.Sprintf(`{"from":%d,"to":%d,"amount":1}`, hot[a], hot[c]), http.StatusCreated)
					}
					return s.send(ctx, fmt.Sprintf("/v1/accounts/%d/deposits", cold[w.rng.IntN(poolCold)]), w.key(), `{"amount":1}`, http.StatusCreated)
				})
				if ctx.Err() != nil {
					stop()
					return ctx.Err()
				}
				k := key{size, load}
				fails.add(fmt.Sprintf("pool %d %s", size, load), res)
				rates[k] = append(rates[k], res.rate())
				for _, x := range res.samples {
					lats[k] = append(lats[k], x.lat)
				}
				fmt.Printf("  round %d  pool %2d  %-9s %6.0f req/s%s\n", r, size, load, res.rate(), res.errNote())
			}
			stop()
		}
	}
	fmt.Printf("\n%4s  %-9s %8s %8s %8s   %s\n", "pool", "load", "req/s", "p50 ms", "p99 ms", "runs")
	best := map[string]float64{}
	med := map[key]float64{}
	for _, load := range loads {
		for _, size := range sizes {
			k := key{size, load}
			med[k] = median(rates[k])
			best[load] = max(best[load], med[k])
			slices.Sort(lats[k])
			p50, p99 := percentile(lats[k], 0.50), percentile(lats[k], 0.99)
			fmt.Printf("%4d  %-9s %8.0f %8.1f %8.1f   %v\n", size, load, med[k], p50, p99, rounded(rates[k]))
			b.info(fmt.Sprintf("pool %2d: keyed %s req/s, p99 ms", size, load), fmt.Sprintf("%.0f %.1f", med[k], p99))
		}
	}
	for _, load := range loads {
		var bestSize []string
		for _, size := range sizes {
			if med[key{size, load}] == best[load] {
				bestSize = append(bestSize, fmt.Sprint(size))
			}
		}
		// Contended transfers are what the default is chosen for; deposits, where no request
		// waits, may lose a little to a smaller pool (within this machine's noise of 10%).
		target := map[string]float64{"transfers": 0.95, "deposits": 0.90}[load]
		b.ratio(fmt.Sprintf("pool: default (%d) / best (%s), keyed %s", def, strings.Join(bestSize, ","), load),
			med[key{def, load}]/best[load], ">=", target)
	}
	return fails.err()
}

// defaultPoolSize is the reference server's default DATABASE_POOL_SIZE on this machine
// (cmd/server's DefaultPoolSize: twice the CPUs, at least 4).
func defaultPoolSize() int { return max(4, 2*runtime.GOMAXPROCS(0)) }

package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/pgidem/pgidem/internal/dbidem"
)

// healthEvery is how often, at most, the key gauges ask the database: a scrape in between
// gets the figures of the last read.
const healthEvery = 15 * time.Second

// keyGauges exports idem.idem_health() as Prometheus gauges, read at scrape time, at most
// every healthEvery, so an alert can fire when cleanup falls behind or a claim is stuck.
type keyGauges struct {
	pool *pgxpool.Pool
	log  *slog.Logger

	mu     sync.Mutex
	read   time.Time
	health dbidem.Health
	ok     bool
	failed sync.Once

	inProgress, runOut, oldest, backlog, bytes, estimated *prometheus.Desc
}

func newKeyGauges(pool *pgxpool.Pool, log *slog.Logger) *keyGauges {
	d := func(name, help string) *prometheus.Desc { return prometheus.NewDesc(name, help, nil, nil) }
	return &keyGauges{pool: pool, log: log,
		inProgress: d("idempotency_keys_in_progress", "Lease claims in progress (idem_health)."),
		runOut:     d("idempotency_leases_run_out", "Claims in progress whose lease ran out: their work is dead, or a retry will take them over."),
		oldest:     d("idempotency_oldest_in_progress_seconds", "Age of the oldest claim in progress (0 when none)."),
		backlog:    d("idempotency_cleanup_backlog", "Expired keys that cleanup has not deleted yet (counted up to a million)."),
		bytes:      d("idempotency_key_table_bytes", "Size of the key table, indexes and TOAST included."),
		estimated:  d("idempotency_keys_estimated", "Keys in the table, as the planner estimates them."),
	}
}

// Describe implements prometheus.Collector.
func (g *keyGauges) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{g.inProgress, g.runOut, g.oldest, g.backlog, g.bytes, g.estimated} {
		ch <- d
	}
}

// Collect implements prometheus.Collector: the last figures, read again when they are older
// than healthEvery. A failed read exports nothing (the gauges go absent) and is logged once.
func (g *keyGauges) Collect(ch chan<- prometheus.Metric) {
	g.mu.Lock()
	if time.Since(g.read) >= healthEvery {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		h, err := dbidem.ReadHealth(ctx, g.pool)
		cancel()
		g.read, g.ok = time.Now(), err == nil
		if err == nil {
			g.health = h
		} else {
			g.failed.Do(func() { g.log.Warn("the key gauges could not read idem.idem_health()", "error", err) })
		}
	}
	h, ok := g.health, g.ok
	g.mu.Unlock()
	if !ok {
		return
	}
	for _, m := range []struct {
		d *prometheus.Desc
		v float64
	}{{g.inProgress, float64(h.InProgress)}, {g.runOut, float64(h.LeasesRunOut)}, {g.oldest, h.OldestAge.Seconds()},
		{g.backlog, float64(h.CleanupBacklog)}, {g.bytes, float64(h.TableBytes)}, {g.estimated, float64(h.EstimatedKeys)}} {
		ch <- prometheus.MustNewConstMetric(m.d, prometheus.GaugeValue, m.v)
	}
}

// keysCommand is `server keys`: the summary of the keys, per principal, one key's story, or
// the release of a stuck lease claim, for operators without psql at hand.
func keysCommand(ctx context.Context, pool *pgxpool.Pool, out io.Writer, args []string) error {
	switch {
	case len(args) == 0 || (len(args) == 1 && args[0] == "by-principal"):
		rows, err := dbidem.ReadSummary(ctx, pool, len(args) == 1)
		if err != nil {
			return err
		}
		h, err := dbidem.ReadHealth(ctx, pool)
		if err != nil {
			return err
		}
		fmt.Fprintf(out, "%-24s %10s %12s %10s %9s %8s %15s  %s\n", "principal", "keys", "in_progress", "completed", "released",
			"expired", "leases_run_out", "oldest_in_progress")
		for _, s := range rows {
			p := s.Principal
			if p == "" {
				p = "(all)"
			}
			oldest := "-"
			if !s.OldestInProgress.IsZero() {
				oldest = fmt.Sprintf("%s (%s ago)", s.OldestInProgress.UTC().Format(time.RFC3339), time.Since(s.OldestInProgress).Round(time.Second))
			}
			fmt.Fprintf(out, "%-24s %10d %12d %10d %9d %8d %15d  %s\n", p, s.Keys, s.InProgress, s.Completed, s.Released,
				s.Expired, s.LeasesRunOut, oldest)
		}
		fmt.Fprintf(out, "key table: %d bytes, cleanup backlog: %d\n", h.TableBytes, h.CleanupBacklog)
		return nil
	case len(args) == 2:
		k, ok, err := dbidem.ReadKey(ctx, pool, args[0], args[1])
		if err != nil {
			return err
		}
		if !ok {
			return fmt.Errorf("no key %q of principal %q", args[1], args[0])
		}
		line := func(name string, v any) { fmt.Fprintf(out, "%-18s %v\n", name, v) }
		when := func(t time.Time) string {
			if t.IsZero() {
				return "-"
			}
			return t.UTC().Format(time.RFC3339Nano)
		}
		line("state", k.State)
		line("expired", k.Expired)
		line("claimed_at", when(k.ClaimedAt))
		line("expires_at", when(k.ExpiresAt))
		line("kept_until", when(k.KeptUntil))
		line("lease_expires_at", when(k.LeaseExpiresAt))
		line("attempt", k.Attempt)
		line("action_hash", k.ActionHash)
		line("field_names", strings.Join(k.FieldNames, ", "))
		orNone := func(v any, ok bool) any {
			if !ok {
				return "-"
			}
			return v
		}
		answered := k.Status != 0 // an answer's status is 100 to 599; none while in progress
		headers, err := json.Marshal(k.Header)
		if err != nil {
			return err
		}
		line("response_status", orNone(k.Status, answered))
		line("response_headers", orNone(string(headers), answered && k.Header != nil))
		line("resource_id", orNone(k.ResourceID, k.ResourceID != ""))
		line("withheld", orNone(k.Withheld, k.Withheld != ""))
		line("body_bytes", orNone(k.BodyBytes, answered && k.Withheld == ""))
		return nil
	case len(args) >= 4 && args[0] == "release":
		token, err := strconv.ParseInt(args[3], 10, 64)
		if err != nil {
			return fmt.Errorf("keys release: TOKEN must be the key's attempt (an integer), got %q", args[3])
		}
		if err := dbidem.ReleaseStuck(ctx, pool, args[1], args[2], token, strings.Join(args[4:], " ")); err != nil {
			if pgErr := (*pgconn.PgError)(nil); errors.As(err, &pgErr) {
				return fmt.Errorf("keys release: %s", pgErr.Message) // the function's own words
			}
			return err
		}
		fmt.Fprintf(out, "released the lease claim of key %q of principal %q (token %d): a retry runs the work again\n", args[2], args[1], token)
		return nil
	}
	return fmt.Errorf("keys: want `keys`, `keys by-principal`, `keys PRINCIPAL KEY` or `keys release PRINCIPAL KEY TOKEN [REASON]`\n\n%s", usage)
}

package history

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"

	"github.com/pgidem/pgidem/internal/pgcluster"
)

// The environment of a history run: a private PostgreSQL cluster (a run restarts it, so it
// cannot be the one the other tests share), a fault proxy in front of it, and an injector
// that runs faults one after another while the clients work.

// Cluster is a private PostgreSQL cluster that a run may restart or crash, and, with
// WithStandby, fail over to its synchronous standby.
type Cluster struct {
	pg      *pgcluster.Cluster
	standby *pgcluster.Cluster // nil without WithStandby
	mu      sync.Mutex         // one restart or promotion at a time
}

// StartCluster starts a throwaway cluster (fsync off), removed when the test ends.
func StartCluster(t testing.TB) *Cluster {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	c, stop, err := pgcluster.StartTemp(ctx, "idem-history-", map[string]string{
		// fsync off is safe here: a crash is PostgreSQL's (pg_ctl -m immediate), not the
		// machine's, so what was written survives. synchronous_commit stays on: a commit
		// reported is in the WAL, as the contract assumes.
		"fsync": "off", "full_page_writes": "off", "max_connections": "200", "shared_buffers": "32MB",
	})
	if err != nil {
		t.Fatalf("history: %v", err)
	}
	t.Cleanup(stop)
	return &Cluster{pg: c}
}

// Addr is the cluster's TCP address (host:port).
func (c *Cluster) Addr() string { return c.pg.TCPHostPort() }

// URL is the connection string of database db, straight to the cluster (over TCP).
func (c *Cluster) URL(db string) string {
	return fmt.Sprintf("host=127.0.0.1 port=%d user=postgres dbname=%s sslmode=disable", c.pg.Port, db)
}

// Via is the connection string of database db through a proxy listening on addr.
func Via(addr, db string) string {
	host, port, _ := strings.Cut(addr, ":")
	return fmt.Sprintf("host=%s port=%s user=postgres dbname=%s sslmode=disable", host, port, db)
}

// CreateDB creates database db.
func (c *Cluster) CreateDB(t testing.TB, db string) {
	t.Helper()
	conn, err := pgx.Connect(context.Background(), c.URL("postgres"))
	if err != nil {
		t.Fatalf("history: %v", err)
	}
	defer conn.Close(context.Background())
	if _, err := conn.Exec(context.Background(), "CREATE DATABASE "+db); err != nil {
		t.Fatalf("history: %v", err)
	}
}

// Restart stops the cluster (a fast shutdown, or a crash: immediate, recovered at start) and
// starts it again.
func (c *Cluster) Restart(ctx context.Context, crash bool) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	stop := c.pg.Stop
	if crash {
		stop = c.pg.Crash
	}
	if err := stop(ctx); err != nil {
		return err
	}
	return c.pg.Start(ctx)
}

// WithStandby gives the cluster a streaming standby made with pg_basebackup -R, which every
// commit waits for (synchronous_standby_names = '*', synchronous_commit on): the promotion
// fault's. Both are stopped when the test ends.
func (c *Cluster) WithStandby(t testing.TB) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	settings := map[string]string{}
	for k, v := range c.pg.Settings {
		settings[k] = v
	}
	// A standby reconnects to a restarted primary within half a second (5 s by default), so
	// that commits, which wait for it, wait that long at most.
	settings["wal_retrieve_retry_interval"] = "500ms"
	dir := filepath.Join(filepath.Dir(c.pg.Dir), "standby") // in the temporary directory StartCluster removes
	c.mu.Lock()
	defer c.mu.Unlock()
	c.standby = &pgcluster.Cluster{Dir: dir, SocketDir: dir, TCPAddr: "127.0.0.1", AnyPort: true, Settings: settings}
	t.Cleanup(func() {
		c.mu.Lock()
		defer c.mu.Unlock()
		_ = c.standby.Stop(context.Background())
		_ = c.pg.Stop(context.Background())
	})
	if err := c.follow(ctx); err != nil {
		t.Fatalf("history: %v", err)
	}
}

// follow makes c.standby afresh from the primary, starts it, and makes the primary's commits
// wait for it.
func (c *Cluster) follow(ctx context.Context) error {
	if err := os.RemoveAll(filepath.Join(c.standby.Dir, "data")); err != nil {
		return err
	}
	if err := c.standby.InitStandby(ctx, c.pg); err != nil {
		return err
	}
	if err := c.standby.Start(ctx); err != nil {
		return err
	}
	conn, err := pgx.Connect(ctx, c.URL("postgres"))
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	if _, err := conn.Exec(ctx, `ALTER SYSTEM SET synchronous_standby_names = '*'`); err != nil {
		return err
	}
	if _, err := conn.Exec(ctx, `SELECT pg_reload_conf()`); err != nil {
		return err
	}
	for {
		var sync bool
		if err := conn.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_stat_replication WHERE sync_state = 'sync')`).Scan(&sync); err != nil {
			return err
		}
		if sync {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("the standby did not become synchronous: %w", ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// Promote fails over: every process of the primary killed (SIGKILL, a dead machine), the
// synchronous standby promoted and moved to the primary's port (a fast restart), so that every
// connection string reaches the new primary, and a new synchronous standby made from it where
// the old primary was. It returns how long no primary served.
func (c *Cluster) Promote(ctx context.Context) (time.Duration, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.standby == nil {
		return 0, fmt.Errorf("history: the cluster has no standby (WithStandby)")
	}
	old, next := c.pg, c.standby
	// A failover tool promotes a synchronous standby that is streaming (Patroni's
	// synchronous_mode). And a commit whose wait for the standby was ended (a restart's
	// shutdown ends it) is on the primary alone, visible, until the standby is back and has
	// it: a promotion before then loses it, which PostgreSQL does not prevent
	// (docs/operations.md, "Replication and failover"). So the fault waits until the standby
	// has every WAL record the primary had flushed when it began.
	if err := c.caughtUp(ctx); err != nil {
		return 0, err
	}
	started := time.Now()
	if err := old.Kill(); err != nil {
		return 0, err
	}
	if err := next.Promote(ctx); err != nil {
		return 0, err
	}
	if err := next.Stop(ctx); err != nil {
		return 0, err
	}
	old.Port, next.Port = next.Port, old.Port
	if err := next.Start(ctx); err != nil {
		return 0, err
	}
	down := time.Since(started)
	c.pg, c.standby = next, old
	return down, c.follow(ctx)
}

// caughtUp waits until a synchronous standby streams from the primary and has flushed every
// WAL record the primary had flushed when it was called.
func (c *Cluster) caughtUp(ctx context.Context) error {
	for {
		conn, err := pgx.Connect(ctx, c.URL("postgres"))
		if err == nil {
			var ok bool
			err = conn.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_stat_replication WHERE sync_state = 'sync'
				AND flush_lsn >= pg_current_wal_flush_lsn())`).Scan(&ok)
			conn.Close(context.Background())
			if err == nil && ok {
				return nil
			}
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("history: the standby did not catch up with the primary: %w (%v)", ctx.Err(), err)
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// Proxy is a toxiproxy in front of an upstream (PostgreSQL), in this process.
type Proxy struct {
	p *toxiproxy.Proxy
}

// NewProxy starts a proxy on a free port of 127.0.0.1 in front of upstream, stopped when the
// test ends.
func NewProxy(t testing.TB, upstream string) *Proxy {
	t.Helper()
	p := toxiproxy.NewProxy(toxiproxy.NewServer(toxiproxy.NewMetricsContainer(prometheus.NewRegistry()), zerolog.Nop()),
		"postgres", "127.0.0.1:0", upstream)
	if err := p.Start(); err != nil {
		t.Fatalf("history: %v", err)
	}
	t.Cleanup(p.Stop)
	return &Proxy{p: p}
}

// Addr is where the proxy listens.
func (p *Proxy) Addr() string { return p.p.Listen }

// hold adds a toxic (type, stream, attributes as JSON), waits d and removes it.
func (p *Proxy) hold(ctx context.Context, kind, stream, attrs string, d time.Duration) error {
	name := "fault-" + kind
	if _, err := p.p.Toxics.AddToxicJson(strings.NewReader(fmt.Sprintf(
		`{"name":%q,"type":%q,"stream":%q,"toxicity":1,"attributes":%s}`, name, kind, stream, attrs))); err != nil {
		return err
	}
	defer func() { _ = p.p.Toxics.RemoveToxic(context.Background(), name) }()
	select {
	case <-time.After(d):
	case <-ctx.Done():
	}
	return nil
}

// FaultFunc injects one fault and returns what it did, for the record.
type FaultFunc func(ctx context.Context, rng *rand.Rand) (detail string, err error)

type namedFault struct {
	kind string
	f    FaultFunc
}

// Injector runs faults one after another while a history is recorded, each recorded in it.
type Injector struct {
	h       *History
	faults  []namedFault
	covered atomic.Bool
}

// Covered tells whether every kind of fault was injected at least once.
func (i *Injector) Covered() bool { return i.covered.Load() }

// NewInjector returns an injector that records into h.
func NewInjector(h *History) *Injector { return &Injector{h: h} }

// Add adds a kind of fault.
func (i *Injector) Add(kind string, f FaultFunc) { i.faults = append(i.faults, namedFault{kind, f}) }

// Run injects faults until ctx ends: every kind once first (in the order added), then kinds
// at random, with a pause drawn by gap between two. It returns the first fault that failed.
func (i *Injector) Run(ctx context.Context, seed uint64, gap func(*rand.Rand) time.Duration) error {
	rng := rand.New(rand.NewPCG(seed, 17))
	for n := 0; ; n++ {
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(gap(rng)):
		}
		if ctx.Err() != nil {
			return nil
		}
		f := i.faults[rng.IntN(len(i.faults))]
		if n < len(i.faults) {
			f = i.faults[n]
		}
		from := i.h.Now()
		detail, err := f.f(ctx, rng)
		switch {
		case err != nil && ctx.Err() != nil:
			return nil // the run ended during the fault
		case err != nil:
			return fmt.Errorf("fault %s: %w", f.kind, err)
		}
		i.h.Fault(f.kind, detail, from)
		if n == len(i.faults)-1 {
			i.covered.Store(true)
		}
	}
}

// ProxyFaults adds the proxy's faults: "cut" (connections reset, either way), "latency"
// (every packet delayed) and "stall" (no data passes).
func (i *Injector) ProxyFaults(p *Proxy) {
	i.Add("cut", func(ctx context.Context, rng *rand.Rand) (string, error) {
		stream := []string{"downstream", "upstream"}[rng.IntN(2)]
		d := time.Duration(30+rng.IntN(170)) * time.Millisecond
		return fmt.Sprintf("reset_peer %s for %s", stream, d),
			p.hold(ctx, "reset_peer", stream, fmt.Sprintf(`{"timeout":%d}`, rng.IntN(20)), d)
	})
	i.Add("latency", func(ctx context.Context, rng *rand.Rand) (string, error) {
		lat, d := 20+rng.IntN(130), time.Duration(300+rng.IntN(900))*time.Millisecond
		return fmt.Sprintf("%d ms each way for %s", lat, d),
			p.hold(ctx, "latency", "downstream", fmt.Sprintf(`{"latency":%d,"jitter":20}`, lat), d)
	})
	i.Add("stall", func(ctx context.Context, rng *rand.Rand) (string, error) {
		d := time.Duration(100+rng.IntN(400)) * time.Millisecond
		return fmt.Sprintf("no data for %s", d), p.hold(ctx, "timeout", "downstream", `{"timeout":0}`, d)
	})
}

// LockFault adds "table-lock": LOCK TABLE idem.idempotency_keys IN ACCESS EXCLUSIVE MODE,
// held for a while, on a connection of its own to url.
func (i *Injector) LockFault(url string) {
	i.Add("table-lock", func(ctx context.Context, rng *rand.Rand) (string, error) {
		d := time.Duration(300+rng.IntN(1200)) * time.Millisecond
		conn, err := connectRetrying(ctx, url)
		if err != nil {
			return "", err
		}
		defer conn.Close(context.Background())
		tx, err := conn.Begin(ctx)
		if err != nil {
			return "", err
		}
		defer func() { _ = tx.Rollback(context.Background()) }()
		if _, err := tx.Exec(ctx, `LOCK TABLE idem.idempotency_keys IN ACCESS EXCLUSIVE MODE`); err != nil {
			return "", err
		}
		select {
		case <-time.After(d):
		case <-ctx.Done():
		}
		return fmt.Sprintf("ACCESS EXCLUSIVE on the key table for %s", d), tx.Commit(context.Background())
	})
}

// RestartFault adds "pg-restart": the cluster stopped (a fast shutdown or, every other time, a
// crash) and started again.
func (i *Injector) RestartFault(c *Cluster) {
	var n int
	i.Add("pg-restart", func(ctx context.Context, rng *rand.Rand) (string, error) {
		n++
		crash := n%2 == 0
		started := time.Now()
		ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
		defer cancel()
		if err := c.Restart(ctx, crash); err != nil {
			return "", err
		}
		how := "fast shutdown"
		if crash {
			how = "crash (immediate shutdown)"
		}
		return fmt.Sprintf("%s and start, down %s", how, time.Since(started).Round(time.Millisecond)), nil
	})
}

// PromotionFault adds "promotion": a failover to the synchronous standby (Cluster.Promote);
// the cluster needs WithStandby. Every commit that returned is on the new primary, so the
// model's promise holds across it as across a crash.
func (i *Injector) PromotionFault(c *Cluster) {
	i.Add("promotion", func(ctx context.Context, rng *rand.Rand) (string, error) {
		ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Minute)
		defer cancel()
		down, err := c.Promote(ctx)
		if err != nil {
			return "", err
		}
		return fmt.Sprintf("primary killed, synchronous standby promoted, no primary for %s", down.Round(time.Millisecond)), nil
	})
}

// TerminateFault adds "backend-kill": pg_terminate_backend of up to three backends of the
// clients (application_name app), as a killed client process would leave them.
func (i *Injector) TerminateFault(url, app string) {
	i.Add("backend-kill", func(ctx context.Context, rng *rand.Rand) (string, error) {
		conn, err := connectRetrying(ctx, url)
		if err != nil {
			return "", err
		}
		defer conn.Close(context.Background())
		var n int
		// Never one whose commit waits for the synchronous standby (the long mode's): ending
		// that wait leaves the commit visible on the primary alone, which docs/operations.md
		// tells operators never to do (D108).
		err = conn.QueryRow(ctx, `SELECT count(pg_terminate_backend(pid)) FROM (SELECT pid FROM pg_stat_activity
			WHERE application_name = $1 AND pid <> pg_backend_pid() AND wait_event IS DISTINCT FROM 'SyncRep'
			ORDER BY random() LIMIT $2) b`, app, 1+rng.IntN(3)).Scan(&n)
		return fmt.Sprintf("%d backends terminated", n), err
	})
}

// CommitFault adds "commit-kill": the backend of a client (application_name app) whose
// statement is COMMIT, caught while its COMMIT runs a deferred trigger that sleeps (a
// harness's slow commit: wait_event PgSleep), is terminated: the transaction did not commit,
// and its client cannot know (the connection ended during COMMIT). It waits up to 5 s for such
// a COMMIT; one kill is one fault.
func (i *Injector) CommitFault(url, app string) {
	i.Add("commit-kill", func(ctx context.Context, rng *rand.Rand) (string, error) {
		conn, err := connectRetrying(ctx, url)
		if err != nil {
			return "", err
		}
		defer conn.Close(context.Background())
		deadline := time.Now().Add(5 * time.Second)
		for time.Now().Before(deadline) && ctx.Err() == nil {
			var n int
			if err := conn.QueryRow(ctx, `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
				WHERE application_name = $1 AND state = 'active' AND upper(query) = 'COMMIT' AND wait_event = 'PgSleep'`,
				app).Scan(&n); err != nil {
				return "", err
			}
			if n > 0 {
				return fmt.Sprintf("%d backends terminated in COMMIT", n), nil
			}
			time.Sleep(5 * time.Millisecond)
		}
		return "no COMMIT in flight for 5s", ctx.Err()
	})
}

// CleanupEvery runs idem.idem_cleanup() on pool every interval until ctx ends, as a scheduled
// cleaner would (far more often), so that a key deleted before its expiry shows in the history;
// errors (a restart, a table lock) are ignored. It returns how many passes ran.
func CleanupEvery(ctx context.Context, pool interface {
	Exec(context.Context, string, ...any) (pgconn.CommandTag, error)
}, interval time.Duration) (passes func() int64) {
	var n atomic.Int64
	go func() {
		for ctx.Err() == nil {
			q, cancel := context.WithTimeout(ctx, 2*time.Second)
			if _, err := pool.Exec(q, `SELECT idem.idem_cleanup()`); err == nil {
				n.Add(1)
			}
			cancel()
			select {
			case <-time.After(interval):
			case <-ctx.Done():
			}
		}
	}()
	return n.Load
}

// connectRetrying connects to url, trying again for up to 30 seconds (the cluster may be
// restarting).
func connectRetrying(ctx context.Context, url string) (*pgx.Conn, error) {
	deadline := time.Now().Add(30 * time.Second)
	for {
		conn, err := pgx.Connect(ctx, url)
		if err == nil || time.Now().After(deadline) || ctx.Err() != nil {
			return conn, err
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// Mode is the size of a run: short inside `make test`, long in `make check-history`.
type Mode struct {
	// Long is true when HISTORY_MODE=long.
	Long bool
	// Workers is how many scenarios run at once (HISTORY_WORKERS), twice as many in long mode.
	Workers int
	// Ops is the number of operations to reach (HISTORY_OPS), at least.
	Ops int
	// Duration is how long the clients run at least (HISTORY_SECONDS).
	Duration time.Duration
	// Seed seeds the run (HISTORY_SEED); the same seed makes the same choices, not the same
	// timings.
	Seed uint64
}

// ModeFromEnv reads the run's size: short by default (shortOps operations and at least
// shortDur, with workers scenarios at once), long with HISTORY_MODE=long (10,000 operations,
// at least two minutes, twice the workers); HISTORY_OPS, HISTORY_SECONDS, HISTORY_WORKERS and
// HISTORY_SEED override.
func ModeFromEnv(shortOps int, shortDur time.Duration, workers int) Mode {
	m := Mode{Ops: shortOps, Duration: shortDur, Workers: workers, Seed: uint64(time.Now().UnixNano())}
	if os.Getenv("HISTORY_MODE") == "long" {
		m.Long, m.Ops, m.Duration, m.Workers = true, 10_000, 2*time.Minute, 2*workers
	}
	if n, err := strconv.Atoi(os.Getenv("HISTORY_WORKERS")); err == nil && n > 0 {
		m.Workers = n
	}
	if n, err := strconv.Atoi(os.Getenv("HISTORY_OPS")); err == nil && n > 0 {
		m.Ops = n
	}
	if n, err := strconv.Atoi(os.Getenv("HISTORY_SECONDS")); err == nil && n > 0 {
		m.Duration = time.Duration(n) * time.Second
	}
	if n, err := strconv.ParseUint(os.Getenv("HISTORY_SEED"), 10, 64); err == nil {
		m.Seed = n
	}
	return m
}

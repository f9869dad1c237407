package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/riverqueue/river"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgcluster"
)

// Version is the server's version, set at build time with -ldflags "-X main.Version=...".
var Version = "0.3.0-dev"

// Main is the program: ParseFlags reads the command and configuration, Run runs it, Close
// releases what Run acquired. End-to-end tests drive it without a shell.
type Main struct {
	Config Config
	// Command is serve, migrate, cleanup, principal, version or help.
	Command string
	// Args are the command's arguments (principal create NAME).
	Args []string
	// Addr receives the address the server listens on once it serves (useful with port 0).
	Addr chan string

	stdout, stderr io.Writer
	log            *slog.Logger
	cluster        *pgcluster.Cluster
	ownsCluster    bool // a serve that started the private cluster, or took it over: it stops it on exit
	clusterUp      bool // the private cluster's Start succeeded: it runs, and its clients can be counted
	pool           *pgxpool.Pool
	probe          *pgxpool.Pool // serve's pool for /healthz and the key gauges (openProbePool), or nil
	registry       *prometheus.Registry
	idem           *idem.Middleware      // set by routes: its Shutdown ends lease work at shutdown
	receipts       *river.Client[pgx.Tx] // the receipts' River client (RECEIPT_URL), or nil
	riverPool      *pgxpool.Pool         // the receipts' River client's own pool, or nil
	receiptsRetry  func()                // ends the receipts' start retries and waits for them, or nil
}

// Run runs the command until it is done or ctx ends.
func (m *Main) Run(ctx context.Context) error {
	switch m.Command {
	case "help":
		_, err := fmt.Fprintln(m.stdout, usage)
		return err
	case "version":
		_, err := fmt.Fprintln(m.stdout, Version)
		return err
	}
	if m.Command == "serve" {
		// A port another program holds is said before the database is opened, migrated or a
		// private cluster started: serve would fail on it only after all that (D257). The
		// port is bound again, for good, once the routes are ready.
		ln, err := net.Listen("tcp", m.Config.ListenAddr)
		if err != nil {
			return fmt.Errorf("LISTEN_ADDR=%s: %w", m.Config.ListenAddr, err)
		}
		ln.Close()
	}
	if err := m.openDatabase(ctx); err != nil {
		return err
	}
	if m.Command == "migrate" {
		return m.migrate(ctx)
	}
	check := checkMigrated
	if m.Command == "keys" {
		// An operator's role (idem_operator) needs idem's functions only, not the ledger.
		check = checkIdemMigrated
	}
	if err := check(ctx, m.pool); err != nil {
		if poolerCacheError(err) {
			// default_query_exec_mode=cache_statement behind a pooler: a server connection
			// kept another session's prepared statement. Not a migration's problem.
			return fmt.Errorf("%w: DATABASE_URL leads to a connection pooler in transaction mode (PgBouncer?) that does not "+
				"keep prepared statements, which default_query_exec_mode=cache_statement needs; set default_query_exec_mode=exec in DATABASE_URL", err)
		}
		return err
	}
	switch m.Command {
	case "cleanup":
		// One full pass by hand, without pauses: for catching up. Its batches wait for the
		// cleanup lock when a running server's batch holds it, and take the cleanup lease over
		// from that server's pass (which stops at its next batch), so the pass runs to its end.
		began := time.Now()
		c, err := idem.NewCleaner(m.pool, idem.CleanerOptions{BatchSize: m.Config.CleanupBatchSize, Duty: 1,
			SkipVacuum: !m.Config.CleanupVacuum, Wait: true, Logger: m.log})
		if err != nil {
			return err
		}
		n, _, err := c.Pass(ctx)
		if err == nil {
			fmt.Fprintf(m.stdout, "deleted %d expired keys in %.3f s\n", n, time.Since(began).Seconds())
		}
		return err
	case "keys":
		return keysCommand(ctx, m.pool, m.stdout, m.Args)
	case "principal":
		id, token, err := createPrincipal(ctx, m.pool, m.Args[1])
		if err != nil {
			return err
		}
		fmt.Fprintf(m.stdout, "principal %s\ntoken %s\n", id, token)
		return nil
	}
	return m.serve(ctx)
}

// Abort is the stop of a second signal: the private cluster, if this process started it, is
// stopped at once (an immediate shutdown: the next start recovers from the WAL); nothing else
// is waited for.
func (m *Main) Abort() {
	if m.cluster != nil && (m.cluster.Started() || m.ownsCluster) {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := m.cluster.Crash(ctx); err != nil {
			fmt.Fprintln(m.stderr, "server: stop the private cluster:", err)
		}
	}
}

// poolCloseWait bounds how long Close waits for the pool's connections to come back.
const poolCloseWait = 5 * time.Second

// Close closes the pool and stops the private cluster if this process started it, or is a
// serve that took it over from a server that is gone (a `principal create` next to a running
// `make run` leaves that server's cluster alone).
func (m *Main) Close() error {
	if m.riverPool != nil {
		m.riverPool.Close()
	}
	if m.probe != nil {
		m.probe.Close()
	}
	if m.pool != nil {
		// A COMMIT that outlived its request (it waits for a synchronous standby that is away)
		// holds its connection, and pgxpool's Close waits for every connection. Past
		// poolCloseWait the process ends without it: the kernel closes the socket, which,
		// unlike a cancel request, leaves the COMMIT waiting, invisible, until the standby has
		// it (docs/DECISIONS.md, D108).
		closed := make(chan struct{})
		go func() {
			m.pool.Close()
			close(closed)
		}()
		select {
		case <-closed:
		case <-time.After(poolCloseWait):
			if m.log != nil {
				m.log.Warn("a COMMIT still waits for PostgreSQL (a synchronous standby?): exiting without it; its outcome is in the database")
			}
		}
	}
	if m.cluster == nil {
		return nil
	}
	owns := m.cluster.Started() || m.ownsCluster
	if owns && !m.clusterUp {
		// Its start failed: nothing of ours to count clients on (the port may be another
		// server's); a server that pg_ctl left behind is stopped, as before.
		return m.cluster.Stop(context.Background())
	}
	// A serve that reuses the cluster of a server that has stopped since (and left it to the
	// clients still using it, below) is the last one out: it stops it, when nobody else uses it.
	lastOut := !owns && m.clusterUp && m.Command == "serve" && !clusterServerAlive(m.cluster.Dir)
	if !owns && !lastOut {
		return nil
	}
	m.releaseCluster()
	// Another server may use the cluster (a second `make run` on another LISTEN_ADDR): its
	// stop would take the database away from it. Left running then; the last serve out stops
	// it (D264).
	switch n, err := otherClients(context.Background(), m.cluster.ConnString("postgres")); {
	case err != nil && lastOut:
		if m.log != nil {
			m.log.Warn("could not tell whether other clients use the private cluster: leaving it running", "err", err)
		}
		return nil
	case err != nil:
		if m.log != nil {
			m.log.Warn("could not tell whether other clients use the private cluster: stopping it", "err", err)
		}
	case n > 0:
		if m.log != nil {
			m.log.Info("other clients use the private cluster: leaving it running (a serve that stops after them, "+
				"or the next one, stops it)", "dir", m.cluster.Dir, "clients", n)
		}
		return nil
	}
	if m.log != nil && m.Command == "serve" {
		m.log.Info("stopping the private PostgreSQL cluster", "dir", m.cluster.Dir)
	}
	return m.cluster.Stop(context.Background())
}

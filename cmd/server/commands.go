package main

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/tern/v2/migrate"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/idem/idemmigrate"
	"github.com/pgidem/pgidem/idem/idemprom"
	"github.com/pgidem/pgidem/internal/pgcluster"
)

// Version is the server's version, set at build time with -ldflags "-X main.Version=...".
var Version = "0.2.0-dev"

//go:embed migrations/*.sql
var ledgerMigrations embed.FS

// ledgerVersionTable is the tern version table of the ledger's migrations.
const ledgerVersionTable = "ledger.schema_version"

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
	pool           *pgxpool.Pool
	registry       *prometheus.Registry
	idem           *idem.Middleware // set by routes: its Shutdown ends lease work at shutdown
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
		return err
	}
	switch m.Command {
	case "cleanup":
		// One pass by hand, without pauses: for catching up.
		began := time.Now()
		c, err := idem.NewCleaner(m.pool, idem.CleanerOptions{BatchSize: m.Config.CleanupBatchSize, Duty: 1,
			SkipVacuum: !m.Config.CleanupVacuum, Logger: m.log})
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

// connectError says why a connection failed. When the server answered with an error (a wrong
// password, an unknown role or database), that answer is the reason, and it is all the
// message says besides where: pgx's own error also lists every attempt it made, a refused TLS
// attempt of sslmode=prefer first.
func connectError(cfg *pgx.ConnConfig, err error) error {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return fmt.Errorf("connect to PostgreSQL at %s:%d as %q, database %q: %s (SQLSTATE %s)",
			cfg.Host, cfg.Port, cfg.User, cfg.Database, pgErr.Message, pgErr.Code)
	}
	return fmt.Errorf("connect to PostgreSQL: %w", err)
}

func (m *Main) openDatabase(ctx context.Context) error {
	url := m.Config.DatabaseURL
	if url == "" {
		dir, err := filepath.Abs(m.Config.DataDir)
		if err != nil {
			return err
		}
		m.cluster = &pgcluster.Cluster{Dir: dir, TCPAddr: "127.0.0.1", Port: m.Config.DataPort}
		if err := m.cluster.Init(ctx); err != nil {
			return err
		}
		if err := m.cluster.Start(ctx); err != nil {
			return err
		}
		if m.cluster.Started() {
			m.log.Info("started the private PostgreSQL cluster", "dir", dir, "port", m.Config.DataPort)
		} else {
			m.log.Info("reusing the running private PostgreSQL cluster", "dir", dir, "port", m.Config.DataPort)
		}
		url = m.cluster.ConnString("postgres")
	}
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return fmt.Errorf("DATABASE_URL: %w", err)
	}
	cfg.MaxConns = int32(m.Config.PoolSize)
	if m.cluster == nil {
		if err := m.statementCacheMode(ctx, cfg, url); err != nil {
			return connectError(cfg.ConnConfig, err)
		}
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return fmt.Errorf("DATABASE_URL: %w", err)
	}
	m.pool = pool
	if err := pool.Ping(ctx); err != nil {
		return connectError(cfg.ConnConfig, err)
	}
	if m.cluster != nil && m.Command != "migrate" {
		return m.migrate(ctx) // the embedded default is always up to date
	}
	return nil
}

// statementCacheMode keeps pgx's statement cache away from a connection pooler.
//
// The cache (pgx's default mode, QueryExecModeCacheStatement) prepares named statements
// (stmtcache_<hash>) on a server connection and runs them in later transactions. PgBouncer in
// transaction mode (1.18, or a later one without max_prepared_statements) gives each
// transaction whichever server connection is free, so under concurrency those statements
// fail: SQLSTATE 26000, prepared statement "stmtcache_..." does not exist (this server
// connection never saw it), or 42P05, ... already exists (another client prepared it here).
//
// A pooler shows itself at connect: it hands the client a cancel key of its own, so the
// process id the connection reports is not the backend's pg_backend_pid(). Then, unless
// DATABASE_URL chooses default_query_exec_mode itself, the pool runs in QueryExecModeExec
// (every statement of the SQL API and the ledger casts its parameters, and JSON goes as text)
// and the log says so. With the cache still on (chosen explicitly, or a pooler that went
// unnoticed), the first of those errors logs what to change.
func (m *Main) statementCacheMode(ctx context.Context, cfg *pgxpool.Config, url string) error {
	explicit := strings.Contains(url, "default_query_exec_mode")
	if cfg.ConnConfig.DefaultQueryExecMode == pgx.QueryExecModeCacheStatement {
		conn, err := pgx.ConnectConfig(ctx, cfg.ConnConfig.Copy())
		if err != nil {
			return err
		}
		var backend int64
		err = conn.QueryRow(ctx, `SELECT pg_backend_pid()`, pgx.QueryExecModeSimpleProtocol).Scan(&backend)
		reported := int64(conn.PgConn().PID())
		_ = conn.Close(ctx)
		if err != nil {
			return err
		}
		switch {
		case backend == reported:
		case explicit:
			m.log.Warn("DATABASE_URL leads to a connection pooler and sets default_query_exec_mode=cache_statement: "+
				"behind PgBouncer in transaction mode that fails unless PgBouncer has max_prepared_statements (1.21 or later)",
				"pooler_pid", reported, "backend_pid", backend)
		default:
			cfg.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeExec
			m.log.Warn("DATABASE_URL leads to a connection pooler (PgBouncer?): pgx's statement cache is off and queries run "+
				"in default_query_exec_mode=exec; add default_query_exec_mode=exec to DATABASE_URL to choose it yourself",
				"pooler_pid", reported, "backend_pid", backend)
		}
	}
	if cfg.ConnConfig.DefaultQueryExecMode != pgx.QueryExecModeCacheStatement {
		return nil
	}
	var told atomic.Bool
	next := cfg.ConnConfig.OnPgError
	cfg.ConnConfig.OnPgError = func(c *pgconn.PgConn, e *pgconn.PgError) bool {
		if (e.Code == "26000" || e.Code == "42P05") && strings.Contains(e.Message, "stmtcache_") && told.CompareAndSwap(false, true) {
			m.log.Error("pgx's statement cache fails: DATABASE_URL leads to a connection pooler in transaction mode "+
				"(PgBouncer?) that does not keep prepared statements; add default_query_exec_mode=exec to DATABASE_URL",
				"sqlstate", e.Code, "error", e.Message)
		}
		if next == nil {
			return !strings.EqualFold(e.Severity, "FATAL")
		}
		return next(c, e)
	}
	return nil
}

func ledgerFS() fs.FS {
	sub, _ := fs.Sub(ledgerMigrations, "migrations")
	return sub
}

// migrate installs idem (migrations and functions), then the ledger's own migrations.
func (m *Main) migrate(ctx context.Context) error {
	conn, err := m.pool.Acquire(ctx)
	if err != nil {
		return err
	}
	defer conn.Release()
	if err := idemmigrate.Migrate(ctx, conn.Conn(), idemmigrate.Options{AppRole: m.Config.AppRole}); err != nil {
		return err
	}
	// 0.1.0 kept the ledger's version table in public; it moves with the ledger.
	if _, err := conn.Exec(ctx, `CREATE SCHEMA IF NOT EXISTS ledger;
		DO $$ BEGIN
			IF to_regclass('public.ledger_schema_version') IS NOT NULL AND to_regclass('ledger.schema_version') IS NULL THEN
				ALTER TABLE public.ledger_schema_version SET SCHEMA ledger;
				ALTER TABLE ledger.ledger_schema_version RENAME TO schema_version;
			END IF;
		END $$`); err != nil {
		return fmt.Errorf("ledger migrate: %w", err)
	}
	mig, err := migrate.NewMigrator(ctx, conn.Conn(), ledgerVersionTable)
	if err != nil {
		return fmt.Errorf("ledger migrate: %w", err)
	}
	mig.Data = map[string]any{"app_role": m.Config.AppRole}
	if err := mig.LoadMigrations(ledgerFS()); err != nil {
		return fmt.Errorf("ledger migrate: %w", err)
	}
	if err := mig.Migrate(ctx); err != nil {
		return fmt.Errorf("ledger migrate: %w", err)
	}
	m.log.Info("migrated")
	return nil
}

// errNotMigrated is what serve, cleanup and principal create say on a database that lacks
// the migrations of this version, or whose SQL API functions are not those of its schema.
var errNotMigrated = errors.New("database not migrated: run `server migrate`")

// errNewer is what they say on a database migrated by a newer release.
var errNewer = errors.New("the database is newer than this server: run the newer server")

// checkMigrated compares the database with the migrations and functions this binary carries:
// idem through idem.idem_version() (the schema's version and the version its installed
// functions belong to, which the application role may call), the ledger through its version
// table. A schema whose functions belong to another version (an install that stopped half
// way) is not migrated.
func checkMigrated(ctx context.Context, db idem.Querier) error {
	if err := checkIdemMigrated(ctx, db); err != nil {
		return err
	}
	wantLedger := countMigrations(ledgerFS())
	var have int32
	if err := db.QueryRow(ctx, `SELECT CASE WHEN to_regclass('`+ledgerVersionTable+`') IS NULL THEN 0
		ELSE (SELECT version FROM `+ledgerVersionTable+`) END`).Scan(&have); err != nil {
		return fmt.Errorf("check the migrations: %w", err)
	}
	switch {
	case int(have) < wantLedger:
		return fmt.Errorf("%w (%s is at version %d, this server needs %d)", errNotMigrated, ledgerVersionTable, have, wantLedger)
	case int(have) > wantLedger:
		return fmt.Errorf("%w (%s is at version %d, this server knows %d)", errNewer, ledgerVersionTable, have, wantLedger)
	}
	return nil
}

// checkIdemMigrated is checkMigrated's half for schema idem (what `server keys` needs): the
// library's own check (idem.CheckSchema), in the server's words.
func checkIdemMigrated(ctx context.Context, db idem.Querier) error {
	err := idem.CheckSchema(ctx, db)
	var se *idem.SchemaError
	switch {
	case err == nil:
		return nil
	case errors.Is(err, idem.ErrPermissionDenied):
		return err
	case !errors.As(err, &se):
		return fmt.Errorf("check the migrations: %w", err)
	case se.Schema == 0:
		// No idem_version() (nothing installed, or a release before 0.2.0).
		return fmt.Errorf("%w (the idem SQL API is missing or older than this server's, which needs schema version %d)", errNotMigrated, se.Want)
	case se.Schema > se.Want:
		return fmt.Errorf("%w (idem is at schema version %d, this server knows %d)", errNewer, se.Schema, se.Want)
	case se.Schema < se.Want:
		return fmt.Errorf("%w (idem is at schema version %d, this server needs %d)", errNotMigrated, se.Schema, se.Want)
	}
	return fmt.Errorf("%w (idem's functions belong to schema version %d, the schema is at %d)", errNotMigrated, se.Functions, se.Schema)
}

func countMigrations(fsys fs.FS) int {
	paths, _ := migrate.FindMigrations(fsys)
	return len(paths)
}

func (m *Main) serve(ctx context.Context) error {
	m.registry = prometheus.NewRegistry()
	m.registry.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		idemprom.NewHealthCollector(m.pool, healthEvery, m.log))
	handler, err := m.routes(ctx)
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", m.Config.ListenAddr)
	if err != nil {
		return fmt.Errorf("LISTEN_ADDR=%s: %w", m.Config.ListenAddr, err)
	}
	srv := &http.Server{Handler: handler, ReadHeaderTimeout: 10 * time.Second, ReadTimeout: time.Minute,
		IdleTimeout: 2 * time.Minute}

	var stopCleanup func()
	if m.Config.CleanupInterval > 0 {
		c, err := idem.StartCleaner(ctx, m.pool, idem.CleanerOptions{Interval: m.Config.CleanupInterval,
			BatchSize: m.Config.CleanupBatchSize, Duty: m.Config.CleanupDuty, SkipVacuum: !m.Config.CleanupVacuum,
			Logger: m.log, Metrics: idemprom.NewCleanupObserver(m.registry)})
		if err != nil {
			return err
		}
		stopCleanup = c.Stop
	}

	addr := ln.Addr().String()
	m.log.Info("serving", "addr", addr, "version", Version)
	if m.cluster != nil {
		m.log.Info("quickstart: create a principal with `go run ./cmd/server principal create alice` " +
			"(PostgreSQL at " + m.cluster.ConnString("postgres") + "), then: curl -s http://" + addr +
			"/v1/accounts -H \"Authorization: Bearer $TOKEN\" -H 'Content-Type: application/json' -d '{\"name\":\"main\",\"currency\":\"EUR\"}'")
	}
	m.Addr <- addr
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	select {
	case err := <-errc:
		if stopCleanup != nil {
			stopCleanup()
		}
		return err
	case <-ctx.Done():
	}
	m.log.Info("shutting down", "timeout", m.Config.ShutdownTimeout.String())
	sctx, cancel := context.WithTimeout(context.Background(), m.Config.ShutdownTimeout)
	defer cancel()
	// Stop accepting and let in-flight requests finish; lease work (which outlives its client)
	// is ended by the middleware's Shutdown when the timeout passes, so that it gives its
	// lease up for the client's retry instead of being cut off by the exit.
	leases := make(chan error, 1)
	go func() { leases <- m.idem.Shutdown(sctx) }()
	err = srv.Shutdown(sctx)
	if lerr := <-leases; lerr != nil {
		m.log.Warn("lease work still running at the shutdown timeout was ended", "error", lerr)
	}
	if stopCleanup != nil {
		stopCleanup() // cancels a running pass and waits for it
	}
	if err != nil && !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("shutdown: %w", err)
	}
	m.log.Info("stopped")
	return nil
}

// Close closes the pool and stops the private cluster if this process started it (a
// `principal create` next to a running `make run` leaves that server's cluster alone).
func (m *Main) Close() error {
	if m.pool != nil {
		m.pool.Close()
	}
	if m.cluster != nil && m.cluster.Started() {
		return m.cluster.Stop(context.Background())
	}
	return nil
}

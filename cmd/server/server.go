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
	"regexp"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/tern/v2/migrate"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/pgidem/pgidem/internal/pgcluster"
	idemsql "github.com/pgidem/pgidem/sql"
)

// Version is the server's version, set at build time with -ldflags "-X main.Version=...".
var Version = "0.1.0-dev"

//go:embed migrations/*.sql
var ledgerMigrations embed.FS

// Config is the server's configuration, read from the environment by ParseFlags. Every
// field names its variable and default; a bad value stops the start with a message that
// names the variable.
type Config struct {
	// DatabaseURL (DATABASE_URL): the PostgreSQL to use. Empty: a private cluster under
	// DataDir, created, started and migrated on start.
	DatabaseURL string
	// ListenAddr (LISTEN_ADDR): the HTTP address. Default 127.0.0.1:8080.
	ListenAddr string
	// DataDir (IDEM_DATA_DIR): where the private cluster lives. Default .data.
	DataDir string
	// DataPort (IDEM_DATA_PORT): the private cluster's TCP port on 127.0.0.1. Default 54329.
	DataPort int
	// AppRole (IDEM_APP_ROLE): the role granted the SQL API by migrate. Default idem_app.
	AppRole string
	// TTL (IDEMPOTENCY_TTL): how long a key stays valid. Default 24h.
	TTL time.Duration
	// LockTimeout (IDEMPOTENCY_LOCK_TIMEOUT): how long a repeat waits for the first
	// request. Default 2s.
	LockTimeout time.Duration
	// MaxBodyBytes (MAX_BODY_BYTES): the largest request body. Default 1048576.
	MaxBodyBytes int64
	// MaxStoredBytes (MAX_STORED_RESPONSE_BYTES): the largest response body stored for
	// replay. Default 262144.
	MaxStoredBytes int
	// CleanupInterval (CLEANUP_INTERVAL): how often expired keys are deleted; 0 disables.
	// Default 1m.
	CleanupInterval time.Duration
	// CleanupBatchSize (CLEANUP_BATCH_SIZE): rows per cleanup batch. Default 1000.
	CleanupBatchSize int
	// ShutdownTimeout (SHUTDOWN_TIMEOUT): how long in-flight requests may finish. Default 10s.
	ShutdownTimeout time.Duration
	// TransfersRequireKey (TRANSFERS_REQUIRE_KEY): whether POST /v1/transfers needs an
	// Idempotency-Key. Default true; false only to benchmark the route without keys.
	TransfersRequireKey bool
	// LogLevel (LOG_LEVEL): debug, info, warn or error. Default info.
	LogLevel slog.Level
}

// Main is the program: ParseFlags reads the command and configuration, Run runs it, Close
// releases what Run acquired. End-to-end tests drive it without a shell.
type Main struct {
	Config Config
	// Command is serve, migrate, cleanup, principal or version.
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
}

const usage = `usage: server [command]
  serve                    serve HTTP on LISTEN_ADDR (the default)
  migrate                  apply the migrations and install the SQL API, then exit
  cleanup                  delete expired idempotency keys (one full pass), then exit
  principal create NAME    create a principal; prints its id and a bearer token once
  version                  print the version`

// ParseFlags reads the command from args and the configuration from getenv.
func (m *Main) ParseFlags(args []string, getenv func(string) string) error {
	m.Command = "serve"
	if len(args) > 0 {
		m.Command, m.Args = args[0], args[1:]
	}
	switch m.Command {
	case "serve", "migrate", "cleanup", "version":
		if len(m.Args) > 0 {
			return fmt.Errorf("%s takes no arguments\n%s", m.Command, usage)
		}
	case "principal":
		if len(m.Args) != 2 || m.Args[0] != "create" {
			return fmt.Errorf("principal: want principal create NAME\n%s", usage)
		}
		if n := m.Args[1]; len(n) < 1 || len(n) > 100 {
			return errors.New("principal create: NAME must be 1 to 100 characters")
		}
	default:
		return fmt.Errorf("unknown command %q\n%s", m.Command, usage)
	}
	c := Config{
		DatabaseURL: getenv("DATABASE_URL"), ListenAddr: "127.0.0.1:8080", DataDir: ".data", DataPort: 54329,
		AppRole: idemsql.DefaultAppRole, TTL: 24 * time.Hour, LockTimeout: 2 * time.Second,
		MaxBodyBytes: 1 << 20, MaxStoredBytes: 256 << 10, CleanupInterval: time.Minute, CleanupBatchSize: 1000,
		ShutdownTimeout: 10 * time.Second, TransfersRequireKey: true, LogLevel: slog.LevelInfo,
	}
	p := envParser{getenv: getenv}
	if v := getenv("LISTEN_ADDR"); v != "" {
		if _, _, err := net.SplitHostPort(v); err != nil {
			p.fail("LISTEN_ADDR", v, "want host:port, for example 127.0.0.1:8080")
		}
		c.ListenAddr = v
	}
	p.str("IDEM_DATA_DIR", &c.DataDir)
	p.integer("IDEM_DATA_PORT", &c.DataPort, 1, 65535)
	if v := getenv("IDEM_APP_ROLE"); v != "" {
		if !regexp.MustCompile(`^[a-z_][a-z0-9_]{0,62}$`).MatchString(v) {
			p.fail("IDEM_APP_ROLE", v, "want a lower-case SQL identifier")
		}
		c.AppRole = v
	}
	p.duration("IDEMPOTENCY_TTL", &c.TTL, time.Second, false)
	p.duration("IDEMPOTENCY_LOCK_TIMEOUT", &c.LockTimeout, time.Millisecond, false)
	var maxBody, maxStored int
	maxBody, maxStored = int(c.MaxBodyBytes), c.MaxStoredBytes
	p.integer("MAX_BODY_BYTES", &maxBody, 1, 1<<30)
	p.integer("MAX_STORED_RESPONSE_BYTES", &maxStored, 0, 1<<30)
	c.MaxBodyBytes, c.MaxStoredBytes = int64(maxBody), maxStored
	p.duration("CLEANUP_INTERVAL", &c.CleanupInterval, time.Second, true)
	p.integer("CLEANUP_BATCH_SIZE", &c.CleanupBatchSize, 1, 1_000_000)
	p.duration("SHUTDOWN_TIMEOUT", &c.ShutdownTimeout, time.Millisecond, false)
	if v := getenv("TRANSFERS_REQUIRE_KEY"); v != "" {
		b, err := strconv.ParseBool(v)
		if err != nil {
			p.fail("TRANSFERS_REQUIRE_KEY", v, "want true or false")
		}
		c.TransfersRequireKey = b
	}
	if v := getenv("LOG_LEVEL"); v != "" {
		if err := c.LogLevel.UnmarshalText([]byte(v)); err != nil {
			p.fail("LOG_LEVEL", v, "want debug, info, warn or error")
		}
	}
	if c.DatabaseURL != "" {
		if _, err := pgx.ParseConfig(c.DatabaseURL); err != nil {
			p.errs = append(p.errs, fmt.Errorf("DATABASE_URL: %v", err))
		}
	}
	if c.TTL > 0 && c.LockTimeout >= c.TTL {
		p.errs = append(p.errs, errors.New("IDEMPOTENCY_LOCK_TIMEOUT must be shorter than IDEMPOTENCY_TTL"))
	}
	if err := errors.Join(p.errs...); err != nil {
		return err
	}
	m.Config = c
	m.log = slog.New(slog.NewJSONHandler(m.stderr, &slog.HandlerOptions{Level: c.LogLevel}))
	if m.Addr == nil {
		m.Addr = make(chan string, 1)
	}
	return nil
}

type envParser struct {
	getenv func(string) string
	errs   []error
}

func (p *envParser) fail(name, value, want string) {
	p.errs = append(p.errs, fmt.Errorf("%s=%q: %s", name, value, want))
}

func (p *envParser) str(name string, dst *string) {
	if v := p.getenv(name); v != "" {
		*dst = v
	}
}

func (p *envParser) integer(name string, dst *int, lo, hi int) {
	v := p.getenv(name)
	if v == "" {
		return
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < lo || n > hi {
		p.fail(name, v, fmt.Sprintf("want an integer from %d to %d", lo, hi))
		return
	}
	*dst = n
}

func (p *envParser) duration(name string, dst *time.Duration, min time.Duration, zeroOK bool) {
	v := p.getenv(name)
	if v == "" {
		return
	}
	d, err := time.ParseDuration(v)
	if err != nil || (d < min && !(zeroOK && d == 0)) {
		p.fail(name, v, fmt.Sprintf("want a duration of at least %s, such as 30s or 5m", min))
		return
	}
	*dst = d
}

// Run runs the command until it is done or ctx ends.
func (m *Main) Run(ctx context.Context) error {
	if m.Command == "version" {
		_, err := fmt.Fprintln(m.stdout, Version)
		return err
	}
	if err := m.openDatabase(ctx); err != nil {
		return err
	}
	switch m.Command {
	case "migrate":
		return m.migrate(ctx)
	case "cleanup":
		n, _, err := newCleaner(m.pool, m.Config.CleanupBatchSize, nil, m.log).pass(ctx)
		if err == nil {
			fmt.Fprintf(m.stdout, "deleted %d expired keys\n", n)
		}
		return err
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

func (m *Main) openDatabase(ctx context.Context) error {
	url := m.Config.DatabaseURL
	if url == "" {
		dir, err := filepath.Abs(m.Config.DataDir)
		if err != nil {
			return err
		}
		m.cluster = &pgcluster.Cluster{Dir: dir, TCPAddr: "127.0.0.1", Port: m.Config.DataPort}
		m.log.Info("starting the private PostgreSQL cluster", "dir", dir, "port", m.Config.DataPort)
		if err := m.cluster.Init(ctx); err != nil {
			return err
		}
		if err := m.cluster.Start(ctx); err != nil {
			return fmt.Errorf("%w (server log: %s)", err, m.cluster.LogFile())
		}
		url = m.cluster.ConnString("postgres")
	}
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		return fmt.Errorf("DATABASE_URL: %w", err)
	}
	m.pool = pool
	if err := pool.Ping(ctx); err != nil {
		return fmt.Errorf("connect to PostgreSQL: %w", err)
	}
	if m.cluster != nil && m.Command != "migrate" {
		return m.migrate(ctx) // the embedded default is always up to date
	}
	return nil
}

// migrate installs idem (migrations and functions), then the ledger's own migrations.
func (m *Main) migrate(ctx context.Context) error {
	conn, err := m.pool.Acquire(ctx)
	if err != nil {
		return err
	}
	defer conn.Release()
	if err := idemsql.Migrate(ctx, conn.Conn(), idemsql.Options{AppRole: m.Config.AppRole}); err != nil {
		return err
	}
	mig, err := migrate.NewMigrator(ctx, conn.Conn(), "public.ledger_schema_version")
	if err != nil {
		return fmt.Errorf("ledger migrate: %w", err)
	}
	mig.Data = map[string]any{"app_role": m.Config.AppRole}
	sub, _ := fs.Sub(ledgerMigrations, "migrations")
	if err := mig.LoadMigrations(sub); err != nil {
		return fmt.Errorf("ledger migrate: %w", err)
	}
	if err := mig.Migrate(ctx); err != nil {
		return fmt.Errorf("ledger migrate: %w", err)
	}
	m.log.Info("migrated")
	return nil
}

func (m *Main) serve(ctx context.Context) error {
	m.registry = prometheus.NewRegistry()
	m.registry.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	handler, err := m.routes()
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
		c := newCleaner(m.pool, m.Config.CleanupBatchSize, m.registry, m.log)
		if stopCleanup, err = c.schedule(ctx, m.Config.CleanupInterval); err != nil {
			return err
		}
	}

	addr := ln.Addr().String()
	m.log.Info("serving", "addr", addr, "version", Version)
	if m.cluster != nil {
		m.log.Info("quickstart: create a principal with `go run ./cmd/server principal create alice` " +
			"(PostgreSQL at " + m.cluster.ConnString("postgres") + "), then: curl -s http://" + addr +
			"/v1/accounts -H \"Authorization: Bearer $TOKEN\" -d '{\"name\":\"main\",\"currency\":\"EUR\"}'")
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
	err = srv.Shutdown(sctx) // stop accepting, let in-flight requests finish
	if stopCleanup != nil {
		stopCleanup() // cancels a running pass and waits for it
	}
	if err != nil && !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("shutdown: %w", err)
	}
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

package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"github.com/gorilla/mux"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/internal/pgcluster"
	idemsql "github.com/pgidem/pgidem/sql"
)

// Version is the server's version, set at build time with -ldflags "-X main.Version=...".
var Version = "0.1.0-dev"

// Config is the server's configuration, read from the environment by ParseFlags.
type Config struct {
	// DatabaseURL (DATABASE_URL) is the PostgreSQL to use. Empty: a private cluster under
	// DataDir, created, started and migrated on start.
	DatabaseURL string
	// ListenAddr (LISTEN_ADDR) is the HTTP address. Default 127.0.0.1:8080.
	ListenAddr string
	// DataDir (IDEM_DATA_DIR) holds the private cluster. Default .data.
	DataDir string
	// DataPort (IDEM_DATA_PORT) is the private cluster's TCP port on 127.0.0.1. Default 54329.
	DataPort int
	// ShutdownTimeout (SHUTDOWN_TIMEOUT) bounds the wait for in-flight requests. Default 10s.
	ShutdownTimeout time.Duration
}

// Main is the program: ParseFlags reads the command and configuration, Run runs it, Close
// releases what Run acquired. End-to-end tests drive it without a shell.
type Main struct {
	Config  Config
	Command string

	stdout, stderr io.Writer
	log            *slog.Logger
	cluster        *pgcluster.Cluster
	pool           *pgxpool.Pool
	// Addr is the address the server listens on once Run serves (useful with port 0).
	Addr chan string
}

// ParseFlags reads the subcommand from args and the configuration from getenv. A bad value
// is an error that names the variable.
func (m *Main) ParseFlags(args []string, getenv func(string) string) error {
	m.Command = "serve"
	if len(args) > 0 {
		m.Command = args[0]
	}
	switch m.Command {
	case "serve", "migrate", "version":
	default:
		return fmt.Errorf("unknown command %q (serve, migrate, version)", m.Command)
	}
	c := Config{
		DatabaseURL: getenv("DATABASE_URL"), ListenAddr: "127.0.0.1:8080", DataDir: ".data",
		DataPort: 54329, ShutdownTimeout: 10 * time.Second,
	}
	if v := getenv("LISTEN_ADDR"); v != "" {
		if _, _, err := net.SplitHostPort(v); err != nil {
			return fmt.Errorf("LISTEN_ADDR=%q: %v", v, err)
		}
		c.ListenAddr = v
	}
	if v := getenv("IDEM_DATA_DIR"); v != "" {
		c.DataDir = v
	}
	if v := getenv("IDEM_DATA_PORT"); v != "" {
		p, err := strconv.Atoi(v)
		if err != nil || p < 1 || p > 65535 {
			return fmt.Errorf("IDEM_DATA_PORT=%q: want a port number 1-65535", v)
		}
		c.DataPort = p
	}
	if v := getenv("SHUTDOWN_TIMEOUT"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d <= 0 {
			return fmt.Errorf("SHUTDOWN_TIMEOUT=%q: want a positive duration such as 10s", v)
		}
		c.ShutdownTimeout = d
	}
	if c.DatabaseURL != "" {
		if _, err := pgx.ParseConfig(c.DatabaseURL); err != nil {
			return fmt.Errorf("DATABASE_URL: %v", err)
		}
	}
	m.Config = c
	m.log = slog.New(slog.NewJSONHandler(m.stderr, nil))
	if m.Addr == nil {
		m.Addr = make(chan string, 1)
	}
	return nil
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
	if m.Command == "migrate" {
		return m.migrate(ctx)
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
	if m.cluster != nil && m.Command == "serve" {
		return m.migrate(ctx) // the embedded default is always up to date
	}
	return nil
}

func (m *Main) migrate(ctx context.Context) error {
	conn, err := m.pool.Acquire(ctx)
	if err != nil {
		return err
	}
	defer conn.Release()
	if err := idemsql.Migrate(ctx, conn.Conn(), idemsql.Options{AppRole: os.Getenv("IDEM_APP_ROLE")}); err != nil {
		return err
	}
	m.log.Info("migrated")
	return nil
}

func (m *Main) routes() http.Handler {
	r := mux.NewRouter()
	r.HandleFunc("/healthz", func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), 2*time.Second)
		defer cancel()
		if err := m.pool.Ping(ctx); err != nil {
			writeJSON(w, http.StatusServiceUnavailable, map[string]string{"status": "unavailable"})
			return
		}
		writeJSON(w, http.StatusOK, map[string]string{"status": "ok"})
	}).Methods(http.MethodGet)
	r.HandleFunc("/version", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusOK, map[string]string{"version": Version})
	}).Methods(http.MethodGet)
	return r
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

func (m *Main) serve(ctx context.Context) error {
	ln, err := net.Listen("tcp", m.Config.ListenAddr)
	if err != nil {
		return fmt.Errorf("LISTEN_ADDR=%s: %w", m.Config.ListenAddr, err)
	}
	srv := &http.Server{Handler: m.routes(), ReadHeaderTimeout: 10 * time.Second}
	m.log.Info("serving", "addr", ln.Addr().String(), "version", Version)
	m.Addr <- ln.Addr().String()
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	m.log.Info("shutting down")
	sctx, cancel := context.WithTimeout(context.Background(), m.Config.ShutdownTimeout)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// Close closes the pool and stops the private cluster, if Run started one.
func (m *Main) Close() error {
	if m.pool != nil {
		m.pool.Close()
	}
	if m.cluster != nil {
		return m.cluster.Stop(context.Background())
	}
	return nil
}

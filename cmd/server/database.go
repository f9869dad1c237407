package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/internal/pgcluster"
)

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
		m.clusterUp = true
		if m.cluster.Started() {
			m.log.Info("started the private PostgreSQL cluster", "dir", dir, "port", m.cluster.Port)
			if m.Command == "serve" {
				m.takeCluster(dir)
			}
		} else {
			attrs := []any{"dir", dir, "port", m.cluster.Port}
			if m.cluster.Port != m.Config.DataPort {
				// The cluster of dir is the one: a command connects to it where it listens.
				attrs = append(attrs, "IDEM_DATA_PORT", m.Config.DataPort)
			}
			m.log.Info("reusing the running private PostgreSQL cluster", attrs...)
			if m.Command == "serve" && !clusterServerAlive(dir) {
				// The server that started it is gone (killed): this one stops it on exit, as
				// the one that started it would have; unless another process still uses it (a
				// second serve beside the one killed), which its stop would cut off.
				switch n, err := otherClients(ctx, m.cluster.ConnString("postgres")); {
				case err != nil:
					m.log.Warn("could not tell whether other clients use the private cluster: this server stops it on exit only if nobody else uses it then", "err", err)
				case n > 0:
					m.log.Info("the server that started the private cluster is gone, but other clients use it: this server stops it on exit only if nobody else uses it then",
						"dir", dir, "clients", n)
				default:
					m.takeCluster(dir)
					m.log.Info("the server that started the private cluster is gone: this server stops it on exit", "dir", dir)
				}
			}
		}
		url = m.cluster.ConnString("postgres")
	}
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return fmt.Errorf("DATABASE_URL: %w", err)
	}
	cfg.MaxConns = int32(m.Config.PoolSize)
	// The ledger reads timestamps, which in QueryExecModeExec (behind a pooler) come as text in
	// the session's DateStyle, and pgx parses ISO only: a database or role set to 'SQL, DMY'
	// failed every request with 500. The pool asks for ISO when it connects (a startup parameter
	// counts above the database's and the role's settings, and PgBouncer passes it on), unless
	// DATABASE_URL names a DateStyle itself (D231).
	if !runtimeParamGiven(cfg.ConnConfig.RuntimeParams, "datestyle") {
		cfg.ConnConfig.RuntimeParams["DateStyle"] = "ISO, MDY"
	}
	// pgx sends and reads UTF-8 text whatever the session's client_encoding says, which a
	// database's or role's setting may make LATIN1 (D232); idem's start check refuses that.
	if !runtimeParamGiven(cfg.ConnConfig.RuntimeParams, "client_encoding") {
		cfg.ConnConfig.RuntimeParams["client_encoding"] = "UTF8"
	}
	if !connectTimeoutGiven(url, cfg.ConnConfig.ConnectTimeout, os.Getenv) {
		cfg.ConnConfig.ConnectTimeout = connectTimeout
	}
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
		// The embedded default is always up to date, unless a newer release migrated it and
		// serves this one (D204): then this release's migrate would refuse it, and the
		// command's own check lets it run.
		if newerNote(ctx, pool) != "" && checkMigrated(ctx, pool) == nil {
			return nil
		}
		return m.migrate(ctx)
	}
	return nil
}

// openProbePool opens the pool that /healthz, the key gauges and the start's replication check
// read the database through: at most probeConns connections of its own, opened when first
// used. On the request pool, a busy service (every connection held by a request that waits)
// read as a database that does not answer: /healthz said 503 after its 2 s, so a load
// balancer took the instance out at the worst moment, and the key gauges went absent
// (IdemKeyGaugesAbsent) under load.
func (m *Main) openProbePool(ctx context.Context) error {
	cfg := m.pool.Config()
	cfg.MaxConns = probeConns
	cfg.MinConns, cfg.MinIdleConns = 0, 0 // DATABASE_URL's pool_min_conns and pool_min_idle_conns are the request pool's
	cfg.MaxConnIdleTime = time.Minute
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return err
	}
	m.probe = pool
	return nil
}

// probeConns is the most connections the probe pool opens: one for /healthz, one for the key
// gauges' read, which can take longer on a large table.
const probeConns = 2

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
		// exec mode: no named statement left on a pooler's server connection, and none of the
		// simple protocol's rules (pgx refuses it under standard_conforming_strings off, which
		// a database may set, D231)
		err = conn.QueryRow(ctx, `SELECT pg_backend_pid()`, pgx.QueryExecModeExec).Scan(&backend)
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

// connectTimeout is a connection's connect timeout when DATABASE_URL gives none
// (connect_timeout): without one, a database that stops answering while the pool opens a
// connection (a failover, a network that drops packets) holds the request that asked for it
// until the operating system gives up on the connect, minutes later, with no answer.
const connectTimeout = 5 * time.Second

// connectTimeoutGiven tells whether the connection's connect timeout may have been chosen:
// pgx parsed one (cfgTimeout), the connection string mentions connect_timeout or names a
// service (whose file may set it, 0 for no limit included), or the environment does
// (PGCONNECT_TIMEOUT, PGSERVICE). In doubt (a quoted value that mentions connect_timeout, say)
// it says yes: the default is applied only where nothing could have chosen a timeout.
func connectTimeoutGiven(url string, cfgTimeout time.Duration, getenv func(string) string) bool {
	return cfgTimeout != 0 || getenv("PGCONNECT_TIMEOUT") != "" || getenv("PGSERVICE") != "" ||
		strings.Contains(url, "connect_timeout") || serviceKey.MatchString(url)
}

// serviceKey finds a service named in a connection string: service=... among the keys of a
// key/value string or the parameters of a URL.
var serviceKey = regexp.MustCompile(`(^|[\s?&])service\s*=`)

// clusterServerFile names, in the private cluster's directory, the serving process that stops
// the cluster on exit: the one that started it, or the one that took it over from a server
// that is gone.
const clusterServerFile = "server.pid"

// takeCluster makes this process the private cluster's server: it stops the cluster on exit.
func (m *Main) takeCluster(dir string) {
	m.ownsCluster = true
	record := strconv.Itoa(os.Getpid())
	if start, ok := processStart(os.Getpid()); ok {
		record += " " + start
	}
	if err := os.WriteFile(filepath.Join(dir, clusterServerFile), []byte(record+"\n"), 0o644); err != nil {
		m.log.Warn("could not record this server as the private cluster's", "err", err)
	}
}

// releaseCluster removes this process's record as the private cluster's server.
func (m *Main) releaseCluster() {
	if m.cluster == nil || !m.ownsCluster {
		return
	}
	path := filepath.Join(m.cluster.Dir, clusterServerFile)
	if b, err := os.ReadFile(path); err == nil && recordedPid(string(b)) == os.Getpid() {
		_ = os.Remove(path)
	}
}

// clusterServerAlive tells whether the server recorded as the private cluster's still runs.
// No record (a cluster started by another command, or by a release without the record) is
// a server that is gone. The record holds the process number and, where the system says when
// a process started (Linux's /proc), that time: a live process with the recorded number that
// started at another time reuses the number of a server that is gone, and a process killed but not
// yet reaped by its parent (a zombie) is gone too. A record without the time
// (written by an earlier release, or where /proc is missing) counts any live process.
func clusterServerAlive(dir string) bool {
	b, err := os.ReadFile(filepath.Join(dir, clusterServerFile))
	if err != nil {
		return false
	}
	pid := recordedPid(string(b))
	if pid <= 0 {
		return false
	}
	if err := syscall.Kill(pid, 0); err != nil && !errors.Is(err, syscall.EPERM) {
		return false
	}
	state, start, ok := processStat(pid)
	if ok && (state == "Z" || state == "X") {
		// Killed and not yet reaped by its parent (a zombie): a number and a start time, but
		// no server.
		return false
	}
	if f := strings.Fields(string(b)); len(f) > 1 && ok && start != f[1] {
		return false
	}
	return true
}

// recordedPid reads the process number of a server.pid record, 0 when there is none.
func recordedPid(record string) int {
	f := strings.Fields(record)
	if len(f) == 0 {
		return 0
	}
	pid, err := strconv.Atoi(f[0])
	if err != nil {
		return 0
	}
	return pid
}

// processStart returns when process pid started (processStat).
func processStart(pid int) (string, bool) {
	_, start, ok := processStat(pid)
	return start, ok
}

// processStat returns process pid's state (the 3rd field of Linux's /proc/PID/stat: "Z" for a
// process that ended and that its parent has not reaped yet) and when it started (the 22nd, in
// clock ticks since boot); false where there is no such file. The field count starts after the
// command's name, which may hold spaces and parentheses: it ends at the last ')'.
func processStat(pid int) (state, start string, ok bool) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return "", "", false
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return "", "", false
	}
	f := strings.Fields(s[i+1:])
	if len(f) < 20 {
		return "", "", false
	}
	return f[0], f[19], true
}

// clientsCheckName is the application_name of otherClients' own connection.
const clientsCheckName = "idem-server-clients-check"

// otherClients counts the client connections to the cluster at url other than the one it
// opens to ask. The backends of a process that was just killed (the server whose cluster this
// one takes over) end when they find their socket closed, which takes a moment: the count is
// asked again for up to two seconds until it is 0.
func otherClients(ctx context.Context, url string) (int, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		return 0, err
	}
	// Named, so that two servers that stop at once do not count each other's question as a
	// client, and both leave the cluster running.
	cfg.RuntimeParams["application_name"] = clientsCheckName
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return 0, err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	var n int
	for try := 0; ; try++ {
		err = conn.QueryRow(ctx, `SELECT count(*) FROM pg_catalog.pg_stat_activity
			WHERE backend_type = 'client backend' AND pid <> pg_catalog.pg_backend_pid()
			AND application_name IS DISTINCT FROM $1`, clientsCheckName).Scan(&n)
		if err != nil || n == 0 || try == 20 {
			return n, err
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// runtimeParamGiven tells whether params (a connection string's run-time parameters) set name,
// in any case, as a parameter of its own or in options (-c name=..., also from PGOPTIONS).
func runtimeParamGiven(params map[string]string, name string) bool {
	for k, v := range params {
		if strings.EqualFold(k, name) || strings.EqualFold(k, "options") && strings.Contains(strings.ToLower(v), strings.ToLower(name)) {
			return true
		}
	}
	return false
}

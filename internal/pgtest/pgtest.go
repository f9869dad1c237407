// Package pgtest gives every test its own PostgreSQL database, cloned from a template that
// was migrated once per test binary with the real migrations and functions.
//
// The server is found in this order:
//
//  1. TEST_DATABASE_URL: an existing server; the role must be allowed to create databases
//     (and roles, for the migration's idem_app).
//  2. A testcontainers-go PostgreSQL container, when a Docker engine answers.
//  3. A private throwaway cluster from the local initdb/pg_ctl in a temporary directory
//     (run as the postgres user when the process is root), removed when the tests end.
//
// When none of them can be had, the tests fail with a message that says how to get one.
// Nothing is ever skipped.
package pgtest

import (
	"context"
	"fmt"
	"net"
	"net/url"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/testcontainers/testcontainers-go"
	tcpostgres "github.com/testcontainers/testcontainers-go/modules/postgres"

	"github.com/pgidem/pgidem/internal/pgcluster"
	idemsql "github.com/pgidem/pgidem/sql"
)

const howTo = `pgtest: no PostgreSQL for the tests. Get one of:
  - TEST_DATABASE_URL=postgres://user:pass@host:5432/postgres (a role that may create databases and roles);
  - a running Docker engine (testcontainers-go starts postgres:15);
  - the local server binaries: apt-get install postgresql-15 (initdb and pg_ctl; as root, the
    postgres user that the package creates runs them)`

var (
	adminURL  string // connection string to the server's maintenance database
	tcpAddr   string // the server's TCP host:port
	template  string // name of the migrated template database
	source    string // where the server came from, for messages
	setupErr  error
	counter   atomic.Int64
	setupOnce sync.Once
	teardown  []func()
)

// Main runs a package's tests with a PostgreSQL server found as the package comment says.
// Call it from TestMain: func TestMain(m *testing.M) { os.Exit(pgtest.Main(m)) }.
func Main(m *testing.M) int {
	code := m.Run()
	for i := len(teardown) - 1; i >= 0; i-- {
		teardown[i]()
	}
	return code
}

// Source tells where the server of this test binary came from: "TEST_DATABASE_URL",
// "testcontainers" or "local cluster".
func Source(t testing.TB) string {
	t.Helper()
	setup(t)
	return source
}

func setup(t testing.TB) {
	t.Helper()
	setupOnce.Do(func() { setupErr = start() })
	if setupErr != nil {
		t.Fatalf("%v", setupErr)
	}
}

func start() error {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	switch {
	case os.Getenv("TEST_DATABASE_URL") != "":
		adminURL, source = os.Getenv("TEST_DATABASE_URL"), "TEST_DATABASE_URL"
	case dockerAnswers(ctx):
		c, err := tcpostgres.Run(ctx, "postgres:15",
			tcpostgres.WithDatabase("postgres"), tcpostgres.WithUsername("postgres"),
			tcpostgres.WithPassword("postgres"), tcpostgres.BasicWaitStrategies(),
			testcontainers.WithCmdArgs("-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off",
				"-c", "max_connections=300", "-c", "shared_buffers=64MB"))
		if err != nil {
			return fmt.Errorf("pgtest: Docker answers but the PostgreSQL container did not start "+
				"(PGTEST_NO_DOCKER=1 uses the local server binaries instead): %w", err)
		}
		teardown = append(teardown, func() { _ = testcontainers.TerminateContainer(c) })
		url, err := c.ConnectionString(ctx, "sslmode=disable")
		if err != nil {
			return err
		}
		adminURL, source = url, "testcontainers"
	default:
		if _, err := pgcluster.BinDir(); err != nil {
			return fmt.Errorf("%s\n(%v)", howTo, err)
		}
		c, stop, err := pgcluster.StartTemp(ctx, "idem-pgtest-", map[string]string{
			"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off",
			"max_connections": "300", "shared_buffers": "64MB",
		})
		if err != nil {
			return fmt.Errorf("%s\n(%v)", howTo, err)
		}
		teardown = append(teardown, stop)
		adminURL, source, tcpAddr = c.ConnString("postgres"), "local cluster", c.TCPHostPort()
	}
	if tcpAddr == "" {
		if cfg, err := pgx.ParseConfig(adminURL); err == nil && !strings.HasPrefix(cfg.Host, "/") {
			tcpAddr = net.JoinHostPort(cfg.Host, strconv.Itoa(int(cfg.Port)))
		}
	}
	template = fmt.Sprintf("idem_template_%d_%d", os.Getpid(), time.Now().UnixNano()%1e6)
	if err := adminExec(ctx, "CREATE DATABASE "+template); err != nil {
		if source == "TEST_DATABASE_URL" {
			return fmt.Errorf("pgtest: create a template database on TEST_DATABASE_URL (does the server answer, "+
				"and may its role create databases and roles?): %w", err)
		}
		return fmt.Errorf("pgtest: create template on %s: %w", source, err)
	}
	teardown = append(teardown, func() {
		_ = adminExec(context.Background(), "DROP DATABASE IF EXISTS "+template+" WITH (FORCE)")
	})
	conn, err := pgx.Connect(ctx, withDB(adminURL, template))
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	if err := idemsql.Migrate(ctx, conn, idemsql.Options{}); err != nil {
		return fmt.Errorf("pgtest: migrate template: %w", err)
	}
	return nil
}

func dockerAnswers(ctx context.Context) (ok bool) {
	if os.Getenv("PGTEST_NO_DOCKER") != "" {
		return false
	}
	defer func() {
		if recover() != nil {
			ok = false
		}
	}()
	p, err := testcontainers.NewDockerProvider()
	if err != nil {
		return false
	}
	defer p.Close()
	ctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	return p.Health(ctx) == nil
}

func adminExec(ctx context.Context, sql string) error {
	conn, err := pgx.Connect(ctx, adminURL)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	_, err = conn.Exec(ctx, sql)
	return err
}

// withDB returns connStr with its database replaced by db. It accepts postgres:// URLs and
// key/value strings.
func withDB(connStr, db string) string {
	if u, err := url.Parse(connStr); err == nil && (u.Scheme == "postgres" || u.Scheme == "postgresql") {
		u.Path = "/" + db
		return u.String()
	}
	return connStr + " dbname=" + db
}

func newDatabase(t testing.TB, migrated bool) string {
	t.Helper()
	setup(t)
	from := "template0"
	if migrated {
		from = template
	}
	name := fmt.Sprintf("t_%d_%d", os.Getpid(), counter.Add(1))
	ctx := context.Background()
	if err := adminExec(ctx, fmt.Sprintf("CREATE DATABASE %s TEMPLATE %s", name, from)); err != nil {
		t.Fatalf("pgtest: create database %s from %s: %v", name, from, err)
	}
	t.Cleanup(func() {
		if err := adminExec(context.Background(), "DROP DATABASE IF EXISTS "+name+" WITH (FORCE)"); err != nil {
			t.Errorf("pgtest: drop database %s: %v", name, err)
		}
	})
	return withDB(adminURL, name)
}

// TCPAddr is the test server's TCP address (host:port), for tests that put a proxy in front
// of it. It fails the test when the server is reachable over a Unix socket only.
func TCPAddr(t testing.TB) string {
	t.Helper()
	setup(t)
	if tcpAddr == "" {
		t.Fatalf("pgtest: the %s server has no TCP address", source)
	}
	return tcpAddr
}

// Via returns url with its host and port replaced by hostPort (a proxy's address).
func Via(t testing.TB, url, hostPort string) string {
	t.Helper()
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	host, port, err := net.SplitHostPort(hostPort)
	if err != nil {
		t.Fatal(err)
	}
	pw := ""
	if cfg.Password != "" {
		pw = " password=" + cfg.Password
	}
	return fmt.Sprintf("host=%s port=%s user=%s dbname=%s sslmode=disable%s", host, port, cfg.User, cfg.Database, pw)
}

// NewDB creates a database for this test, cloned from the migrated template, drops it when
// the test ends, and returns its connection string (superuser or the TEST_DATABASE_URL role).
func NewDB(t testing.TB) string {
	t.Helper()
	return newDatabase(t, true)
}

// ExampleDB creates a migrated database for an Example function (which has no testing.T)
// and returns its connection string. It is dropped when the test binary ends. Call it only
// from a package whose TestMain uses Main. It panics where no server can be had or the
// database cannot be created (an Example has no testing.T); the watchdog stops a private
// cluster when the binary ends.
func ExampleDB() string {
	setupOnce.Do(func() { setupErr = start() })
	if setupErr != nil {
		panic(setupErr)
	}
	name := fmt.Sprintf("ex_%d_%d", os.Getpid(), counter.Add(1))
	if err := adminExec(context.Background(), fmt.Sprintf("CREATE DATABASE %s TEMPLATE %s", name, template)); err != nil {
		panic(err)
	}
	teardown = append(teardown, func() {
		_ = adminExec(context.Background(), "DROP DATABASE IF EXISTS "+name+" WITH (FORCE)")
	})
	return withDB(adminURL, name)
}

// NewEmptyDB creates an empty database (from template0) for tests of the migrations.
func NewEmptyDB(t testing.TB) string {
	t.Helper()
	return newDatabase(t, false)
}

// NewPool creates a database with NewDB and a pool of at most maxConns connections to it,
// closed when the test ends.
func NewPool(t testing.TB, maxConns int32) (*pgxpool.Pool, string) {
	t.Helper()
	url := NewDB(t)
	return PoolWith(t, url, maxConns, nil), url
}

// PoolWith opens a pool of at most maxConns connections to url whose sessions start with these
// settings (statement_timeout, lock_timeout: as a role's ALTER ROLE ... SET would), closed when
// the test ends.
func PoolWith(t testing.TB, url string, maxConns int32, settings map[string]string) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	cfg.MaxConns = maxConns
	for k, v := range settings {
		cfg.ConnConfig.RuntimeParams[k] = v
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// URLOf is the connection string of the database a pool created by NewPool uses.
func URLOf(t testing.TB, pool *pgxpool.Pool) string {
	t.Helper()
	return pool.Config().ConnConfig.ConnString()
}

// Connect opens one connection to url, closed when the test ends.
func Connect(t testing.TB, url string) *pgx.Conn {
	t.Helper()
	conn, err := pgx.Connect(context.Background(), url)
	if err != nil {
		t.Fatalf("pgtest: connect: %v", err)
	}
	t.Cleanup(func() { conn.Close(context.Background()) })
	return conn
}

package pgtest

import (
	"context"
	"net"
	"net/url"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/internal/pgbouncer"
)

// PgBouncer starts a PgBouncer in transaction mode (internal/pgbouncer) in front of the test
// server, with settings on top of pgbouncer.DefaultSettings, and stops it when the test ends.
// Clients log in as the test server's role. Route a database through it with
// ThroughPgBouncer.
func PgBouncer(t testing.TB, settings map[string]string) *pgbouncer.Bouncer {
	t.Helper()
	setup(t)
	host, port, err := net.SplitHostPort(TCPAddr(t))
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	p, _ := strconv.Atoi(port)
	cfg, err := pgx.ParseConfig(adminURL)
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	all := map[string]string{"admin_users": cfg.User} // the console for PgBouncerAdmin
	for k, v := range settings {
		all[k] = v
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	b, err := pgbouncer.Start(ctx, pgbouncer.Config{Host: host, Port: p,
		Users: map[string]string{cfg.User: cfg.Password}, Settings: all})
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	t.Cleanup(b.Stop)
	return b
}

// ThroughPgBouncer returns the connection string of dbURL's database through b, in the form
// docs/operations.md gives DATABASE_URL behind PgBouncer in transaction mode:
// postgres://user@host:port/db?sslmode=disable&default_query_exec_mode=exec.
func ThroughPgBouncer(t testing.TB, dbURL string, b *pgbouncer.Bouncer) string {
	t.Helper()
	cfg, err := pgx.ParseConfig(dbURL)
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	u := &url.URL{Scheme: "postgres", User: url.User(cfg.User), Host: b.HostPort(), Path: "/" + cfg.Database,
		RawQuery: "sslmode=disable&default_query_exec_mode=exec"}
	if cfg.Password != "" {
		u.User = url.UserPassword(cfg.User, cfg.Password)
	}
	return u.String()
}

// PgBouncerAdmin opens a connection to b's admin console (database pgbouncer; SHOW POOLS,
// SHOW STATS), closed when the test ends. The console speaks the simple protocol only.
func PgBouncerAdmin(t testing.TB, b *pgbouncer.Bouncer) *pgx.Conn {
	t.Helper()
	setup(t)
	admin, err := pgx.ParseConfig(adminURL)
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	cfg, err := pgx.ParseConfig(ThroughPgBouncer(t, "dbname=pgbouncer user="+admin.User, b))
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	cfg.Password = admin.Password
	cfg.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol
	conn, err := pgx.ConnectConfig(context.Background(), cfg)
	if err != nil {
		t.Fatalf("pgtest: connect to the PgBouncer console: %v\n%s", err, b.Log())
	}
	t.Cleanup(func() { conn.Close(context.Background()) })
	return conn
}

// PgBouncerServers is how many server connections PgBouncer b holds to database db (SHOW
// SERVERS): proof that clients went through it.
func PgBouncerServers(t testing.TB, b *pgbouncer.Bouncer, db string) int {
	t.Helper()
	rows, err := PgBouncerAdmin(t, b).Query(context.Background(), "SHOW SERVERS")
	if err != nil {
		t.Fatal(err)
	}
	maps, err := pgx.CollectRows(rows, pgx.RowToMap)
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, m := range maps {
		if m["database"] == db {
			n++
		}
	}
	return n
}

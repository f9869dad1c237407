package pgbouncer_test

import (
	"context"
	"net"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/internal/pgtest"
)

func TestMain(m *testing.M) { os.Exit(pgtest.Main(m)) }

// TestStartStop: PgBouncer comes up on its own port in transaction mode with the settings of
// DefaultSettings, passes queries to a test database, and Stop ends the process, frees the
// port and removes the directory.
func TestStartStop(t *testing.T) {
	t.Parallel()
	b := pgtest.PgBouncer(t, map[string]string{"default_pool_size": "3"})
	if b.Port == 6432 {
		t.Fatal("listening on the system service's port 6432")
	}
	ctx := context.Background()
	conn := pgtest.Connect(t, pgtest.ThroughPgBouncer(t, pgtest.NewDB(t), b))
	if n := pgtest.Count(t, conn, `SELECT $1::int + 1`, 41); n != 42 {
		t.Fatalf("through PgBouncer: %d", n)
	}
	rows, err := pgtest.PgBouncerAdmin(t, b).Query(ctx, "SHOW CONFIG")
	if err != nil {
		t.Fatal(err)
	}
	config, err := pgx.CollectRows(rows, pgx.RowToMap)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{"pool_mode": "transaction", "default_pool_size": "3", "max_client_conn": "500",
		"ignore_startup_parameters": "extra_float_digits", "unix_socket_dir": "", "listen_addr": "127.0.0.1"}
	for _, row := range config {
		if v, ok := want[row["key"].(string)]; ok {
			if row["value"] != v {
				t.Errorf("%s = %v, want %q", row["key"], row["value"], v)
			}
			delete(want, row["key"].(string))
		}
	}
	if len(want) > 0 {
		t.Errorf("settings missing from SHOW CONFIG: %v", want)
	}
	conn.Close(ctx)

	b.Stop()
	b.Stop() // idempotent
	if _, err := os.Stat(b.Dir); !os.IsNotExist(err) {
		t.Fatalf("the directory %s is still there (%v)", b.Dir, err)
	}
	if c, err := net.DialTimeout("tcp", b.HostPort(), time.Second); err == nil {
		c.Close()
		t.Fatalf("something still listens on %s", b.HostPort())
	}
}

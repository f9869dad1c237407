package idemmigrate_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/idem/idemmigrate"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// cancelAfter is a pgx tracer that ends a context once a statement with this text has run.
type cancelAfter struct {
	sql    string
	cancel context.CancelFunc
	mu     sync.Mutex
	seen   bool
}

type sqlKey struct{}

func (c *cancelAfter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	return context.WithValue(ctx, sqlKey{}, d.SQL)
}

func (c *cancelAfter) TraceQueryEnd(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryEndData) {
	if sql, _ := ctx.Value(sqlKey{}).(string); sql == c.sql && d.Err == nil {
		c.mu.Lock()
		c.seen = true
		c.mu.Unlock()
		c.cancel()
	}
}

// TestMigrateCutInTernsOwnLockRunsAgain: tern takes its advisory lock for the session when
// the migrate builds its migrator (to create its version table), and releases it with the
// migrate's context. A context that ended in between (here: right after tern's lock) left the
// lock held by a connection that stays open, and the next migrate, on any connection, waited
// for it without end (TestCancelledMigrateRunsAgain hung ten minutes under load). D268.
func TestMigrateCutInTernsOwnLockRunsAgain(t *testing.T) {
	t.Parallel()
	url := pgtest.NewEmptyDB(t)
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	tracer := &cancelAfter{sql: "select pg_advisory_lock($1)", cancel: cancel}
	cfg.Tracer = tracer
	conn, err := pgx.ConnectConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	err = idemmigrate.Migrate(ctx, conn, idemmigrate.Options{})
	if !tracer.seen || !errors.Is(err, context.Canceled) {
		t.Fatalf("the migrate cut right after tern's lock: seen %v, %v; want context.Canceled", tracer.seen, err)
	}
	if conn.IsClosed() {
		t.Fatal("the connection closed: the test needs it open, as a pool keeps it")
	}
	if n := pgtest.Count(t, pgtest.Connect(t, url), `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = $1`,
		int(conn.PgConn().PID())); n != 0 {
		t.Errorf("the cut migrate's connection still holds %d advisory locks", n)
	}
	next, stop := context.WithTimeout(context.Background(), 30*time.Second)
	defer stop()
	c2 := pgtest.Connect(t, url)
	if err := idemmigrate.Migrate(next, c2, idemmigrate.Options{}); err != nil {
		t.Fatalf("the next migrate, on another connection: %v", err)
	}
	if err := idem.CheckSchema(context.Background(), c2); err != nil {
		t.Fatal(err)
	}
	// And again on the connection of the cut one.
	if err := idemmigrate.Migrate(next, conn, idemmigrate.Options{}); err != nil {
		t.Fatalf("a migrate on the cut one's connection: %v", err)
	}
}

package dbidem_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/internal/dbidem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// lockTimeoutTracer signals each statement or batch that ended in a lock timeout (55P03), as
// long as seen has room.
type lockTimeoutTracer struct{ seen chan struct{} }

func (lockTimeoutTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	return ctx
}

func (l lockTimeoutTracer) TraceQueryEnd(_ context.Context, _ *pgx.Conn, data pgx.TraceQueryEndData) {
	l.saw(data.Err)
}

func (lockTimeoutTracer) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	return ctx
}

func (lockTimeoutTracer) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}

func (l lockTimeoutTracer) TraceBatchEnd(_ context.Context, _ *pgx.Conn, data pgx.TraceBatchEndData) {
	l.saw(data.Err)
}

func (l lockTimeoutTracer) saw(err error) {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "55P03" {
		select {
		case l.seen <- struct{}{}:
		default:
		}
	}
}

// TestTableBusyProbesOutliveTheirWait: a fresh key's probe that met a lock on the whole table
// (a blip: the relation's extension lock under load, or a short LOCK TABLE) is tried again a
// few times, a little later each time. Those probes are the claim's first try, not a wait on
// another holder of the key (D161): when the caller's wait ends in a pause between them (the
// middleware's drain at Shutdown ends it), they go on. They returned ErrStoreBusy at once, and
// a fresh key that Shutdown's drain still serves was told 503, the key table is locked (seen
// once in TestShutdownStressInvariants). Not parallel: it lengthens the pauses between the
// probes, so that the wait ends in the first, and the table is free before the second.
func TestTableBusyProbesOutliveTheirWait(t *testing.T) {
	defer dbidem.SetTableBusyPauses([]time.Duration{300 * time.Millisecond, 300 * time.Millisecond, 300 * time.Millisecond})()
	ctx := context.Background()
	tracer := lockTimeoutTracer{seen: make(chan struct{}, 1)}
	pool, ltx := lockedKeyTable(t, tracer)

	wait, endWait := context.WithCancel(ctx)
	defer endWait()
	done := make(chan error, 1)
	var got dbidem.Decision
	go func() {
		done <- dbidem.NewGate(dbidem.GateOptions{}).RunDetached(wait, ctx, pool, dbidem.TxOptions{}, claim("busy", `{}`), 0,
			func(tx *dbidem.Tx, d dbidem.Decision) error {
				got = d
				if d.Outcome == dbidem.Claimed {
					tx.CompleteOnCommit(dbidem.Response{Status: 201, Body: []byte("done")})
				}
				return nil
			})
	}()
	select {
	case <-tracer.seen: // the first probe met the locked table; its pause has begun
	case err := <-done:
		t.Fatalf("the claim ended before its probe met the locked table: %v", err)
	case <-time.After(30 * time.Second):
		t.Fatal("no probe met the locked table")
	}
	endWait()
	if err := ltx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil || got.Outcome != dbidem.Claimed {
		t.Fatalf("a fresh key whose wait ended between its probes of a table locked for a moment: %v (%q), want claimed",
			err, got.Outcome)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem.idempotency_keys WHERE key = 'busy' AND state = 'c'`); n != 1 {
		t.Fatalf("%d completed rows for the key, want 1", n)
	}
}

// lockedKeyTable is a pool with tracer on a new database whose key table a transaction of
// another connection (ltx, rolled back at the test's end) locks IN SHARE MODE: a claim's read
// passes, its INSERT waits on the table.
func lockedKeyTable(t *testing.T, tracer pgx.QueryTracer) (pool *pgxpool.Pool, ltx pgx.Tx) {
	t.Helper()
	ctx := context.Background()
	url := pgtest.NewDB(t)
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.Tracer = tracer
	pool, err = pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	locker := pgtest.Connect(t, url)
	ltx, err = locker.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ltx.Rollback(ctx) })
	pgtest.Exec(t, ltx, `LOCK TABLE idem.idempotency_keys IN SHARE MODE`)
	return pool, ltx
}

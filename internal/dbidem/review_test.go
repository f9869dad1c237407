package dbidem_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/internal/dbidem"
	"github.com/pgidem/pgidem/internal/pgcluster"
	"github.com/pgidem/pgidem/internal/pgtest"
	idemsql "github.com/pgidem/pgidem/sql"
)

// TestLeaseThatRanOutBeforeItStartedRunsNoWork (review finding, the rest of issue 28's
// "a lease can start already run out"): on the fresh-insert path idem_begin counts the lease
// from statement_timestamp(), before its wait on an uncommitted holder of the key. D64 made the
// local deadline count from before the send too, so the local side is never later than the
// database's; but when the wait outlasts the lease, the claim commits a lease that has
// already run out, and DoLease (the middleware's lease routes alike) still calls the work: the
// heartbeat's expiry fires asynchronously, after fn has started. Meanwhile any duplicate takes
// the key over at once, so two attempts run the work at the same time: the very thing
// "leases that never start late" was to prevent. (Lock timeout 5 s, lease 1 s, the documented
// minimum: a holder that keeps its transactional claim for more than a second, then rolls back.)
//
// The gap is held by a real row lock: another request's uncommitted claim of the key.
func TestLeaseThatRanOutBeforeItStartedRunsNoWork(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 8)
	ctx := context.Background()
	job := dbidem.Job{Principal: "p", Key: "doa", Action: "payout", Input: map[string]int{"amount": 1},
		Lease: time.Second, LockTimeout: 5 * time.Second, Gate: dbidem.NewGate(dbidem.GateOptions{})}

	holder, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = holder.Rollback(ctx) }()
	if _, err := holder.Exec(ctx, `SELECT idem.idem_begin('p', 'doa', 'another request', sha256('x'))`); err != nil {
		t.Fatal(err)
	}

	var running, concurrent, deadAtStart atomic.Int32
	fn := func(ctx context.Context, c dbidem.LeaseClaim) (int, error) {
		if running.Add(1) > 1 {
			concurrent.Add(1)
		}
		defer running.Add(-1)
		var over bool
		if err := pool.QueryRow(context.Background(), `SELECT lease_expires_at <= clock_timestamp() FROM idem.idempotency_keys
			WHERE key = 'doa'`).Scan(&over); err != nil {
			return 0, err
		}
		if over {
			deadAtStart.Add(1)
			// Another process's attempt of the same job, now.
			other := job
			other.Gate = dbidem.NewGate(dbidem.GateOptions{})
			_, _, err := dbidem.DoLease(context.Background(), pool, other, func(context.Context, dbidem.LeaseClaim) (int, error) {
				if running.Add(1) > 1 {
					concurrent.Add(1)
				}
				defer running.Add(-1)
				return 2, nil
			})
			t.Logf("another attempt while the first one's work runs: %v", err)
		}
		return 1, nil
	}
	done := make(chan error, 1)
	go func() {
		_, _, err := dbidem.DoLease(ctx, pool, job, fn)
		done <- err
	}()
	pgtest.WaitFor(t, pool, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE '%idem_begin%'`)
	time.Sleep(1200 * time.Millisecond) // the claim waits on the holder longer than its lease
	_ = holder.Rollback(ctx)
	err = <-done
	t.Logf("the first DoLease: %v", err)
	if deadAtStart.Load() > 0 {
		t.Errorf("DoLease ran the work on a lease that had already run out in the database (%d attempts ran it at once): "+
			"a duplicate could take the key over before the work began", 1+concurrent.Load())
	}
}

// TestKeyWaitIsRecognisedOnALocalizedServer (review finding): the Gate tells a key wait from a
// locked table by the first context line of the 55P03 ("while inserting index tuple (0,8) in
// relation "idempotency_keys""), which PostgreSQL translates with lc_messages. On a server
// whose messages are in another language (a German, French or Japanese install: lc_messages
// comes from initdb's locale) the line reads `beim Einfügen von Indextupel (0,1) in Relation
// »idempotency_keys«`, no key wait is ever recognised, and a duplicate that should wait for the
// request in flight in another process and replay its answer gets ErrStoreBusy (503
// store_unavailable) after about 50 ms, as if the table were locked.
//
// A cluster of its own with German messages (the translations ship with Debian's
// postgresql-15; LANGUAGE selects them); the gap is a real uncommitted claim of the key.
func TestKeyWaitIsRecognisedOnALocalizedServer(t *testing.T) {
	pool := localizedServer(t, "de", "Division durch Null")
	duplicateOfAFreshKey(t, pool, "de-1")
	// A third request queued behind another waiter on the row: its timeout's context is the
	// locking read's statement, in German too.
	thirdInLine(t, pool, "de-2")
}

// TestThirdInLineOnAFrenchServer: French messages quote a statement as « … », with a space
// inside the quotes, and write a row's position (0, 3), with a space after the comma (D275:
// not matched before, so a fresh key's duplicate got ErrStoreBusy there); the duplicate of a
// fresh key and the third request queued on a key's row are key waits there too.
func TestThirdInLineOnAFrenchServer(t *testing.T) {
	pool := localizedServer(t, "fr", "division par zéro")
	duplicateOfAFreshKey(t, pool, "fr-0")
	thirdInLine(t, pool, "fr-1")
}

// TestKeyWaitOnAKoreanServer: Korean messages write a row's position without parentheses,
// first on the context's line ("0,3 튜플 인덱스(해당 릴레이션 ...)를 삽입하는 중에 발생"), so no
// key wait was recognised there: a duplicate of a request in flight got ErrStoreBusy (D275).
func TestKeyWaitOnAKoreanServer(t *testing.T) {
	pool := localizedServer(t, "ko", "0으로는 나눌수 없습니다")
	duplicateOfAFreshKey(t, pool, "ko-0")
	thirdInLine(t, pool, "ko-1")
}

// duplicateOfAFreshKey: a duplicate of a fresh key's request in flight in another process
// (answered, not committed yet) waits on the key's row and replays its answer once it commits,
// not ErrStoreBusy.
func duplicateOfAFreshKey(t *testing.T, pool *pgxpool.Pool, key string) {
	t.Helper()
	ctx := context.Background()
	// Another process's request of the same key, answered but not committed yet.
	cl := claim(key, `{"amount":1}`)
	holder, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	d, err := dbidem.Begin(ctx, holder, cl)
	if err != nil || d.Outcome != dbidem.Claimed {
		t.Fatalf("holder: %+v %v", d, err)
	}
	if err := dbidem.Complete(ctx, holder, cl.Principal, cl.Key, d.Attempt, dbidem.Response{Status: 201, Body: []byte("ok")}); err != nil {
		t.Fatal(err)
	}
	go func() {
		time.Sleep(500 * time.Millisecond)
		_ = holder.Commit(ctx)
	}()

	cl.LockTimeout = 5 * time.Second
	var got dbidem.Decision
	err = dbidem.NewGate(dbidem.GateOptions{}).Run(ctx, pool, dbidem.TxOptions{}, cl, func(_ *dbidem.Tx, d dbidem.Decision) error {
		got = d
		return nil
	})
	if err != nil || got.Outcome != dbidem.Replay {
		var pgErr *pgconn.PgError
		where := ""
		if errors.As(err, &pgErr) {
			where = pgErr.Where
		}
		t.Fatalf("a duplicate of a request in flight in another process: %v (%+v), want the replay once it commits; "+
			"the 55P03's context: %q", err, got.Outcome, where)
	}
}

// localizedServer starts a migrated cluster of its own whose messages are in language (the
// translations ship with Debian's postgresql-15; LANGUAGE selects them), checked by the text
// of a division by zero, and returns a pool on it.
func localizedServer(t *testing.T, language, divisionByZero string) *pgxpool.Pool {
	t.Helper()
	t.Setenv("LANGUAGE", language)
	ctx := context.Background()
	c, stop, err := pgcluster.StartTemp(ctx, "idem-review-"+language+"-", map[string]string{"fsync": "off"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(stop)
	admin, err := pgx.Connect(ctx, c.ConnString("postgres"))
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close(ctx)
	if err := idemsql.Migrate(ctx, admin, idemsql.Options{}); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.Exec(ctx, `SELECT 1/0`); err == nil || !strings.Contains(err.Error(), divisionByZero) {
		t.Fatalf("the server's messages are not in %s: %v", language, err)
	}
	pool, err := pgxpool.New(ctx, c.ConnString("postgres"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

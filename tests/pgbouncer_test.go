package tests

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"regexp"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/internal/dbidem"
	"github.com/pgidem/pgidem/internal/pgbouncer"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// bouncerPool opens a pool of at most maxConns connections to url's database through
// PgBouncer b (transaction mode), in pgx's mode (pgx.QueryExecModeExec is what the docs
// prescribe), closed when the test ends.
func bouncerPool(t *testing.T, url string, b *pgbouncer.Bouncer, mode pgx.QueryExecMode, maxConns int32) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(pgtest.ThroughPgBouncer(t, url, b))
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.DefaultQueryExecMode = mode
	cfg.MaxConns = maxConns
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

func dbName(t *testing.T, url string) string {
	t.Helper()
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	return cfg.Database
}

var stmtName = regexp.MustCompile(`stmtcache_[0-9a-f]+`)

func keyedClaim(key, body string) dbidem.Claim {
	return dbidem.Claim{Principal: "p", Key: key, Action: "POST /t", Fingerprint: sha256.Sum256([]byte(body))}
}

// TestPgBouncerRunTxRetriesSerializationFailure: dbidem.RunTx's retry of a serialization
// failure works through PgBouncer in transaction mode. A REPEATABLE READ unit of work takes
// its snapshot; another client (through the same PgBouncer) completes the same key and
// commits; the unit's claim then fails with 40001 and RunTx runs it again, in a new
// transaction on whatever server connection PgBouncer gives it, where it replays the stored
// answer.
func TestPgBouncerRunTxRetriesSerializationFailure(t *testing.T) {
	t.Parallel()
	url := pgtest.NewDB(t)
	b := pgtest.PgBouncer(t, nil)
	pool := bouncerPool(t, url, b, pgx.QueryExecModeExec, 4)
	ctx := context.Background()
	c := keyedClaim("k", "body")

	var runs int
	var firstErr error
	var final dbidem.Decision
	opts := dbidem.TxOptions{TxOptions: pgx.TxOptions{IsoLevel: pgx.RepeatableRead}, Backoff: time.Millisecond}
	err := dbidem.RunTx(ctx, pool, opts, func(tx *dbidem.Tx) error {
		runs++
		if _, err := tx.Exec(ctx, `SELECT 1`); err != nil { // the snapshot
			return err
		}
		if runs == 1 {
			err := dbidem.RunTx(ctx, pool, dbidem.TxOptions{}, func(other *dbidem.Tx) error {
				d, err := other.Claim(ctx, c)
				if err != nil || d.Outcome != dbidem.Claimed {
					return fmt.Errorf("the other client: %+v %v", d, err)
				}
				other.CompleteOnCommit(dbidem.Response{Status: 201, Body: []byte("first")})
				return nil
			})
			if err != nil {
				t.Errorf("the other client: %v", err)
			}
		}
		d, err := tx.Claim(ctx, c)
		if err != nil {
			if runs == 1 {
				firstErr = err
			}
			return err
		}
		final = d
		if d.Outcome == dbidem.Claimed {
			tx.CompleteOnCommit(dbidem.Response{Status: 201, Body: []byte("second")})
		}
		return nil
	})
	if err != nil {
		t.Fatalf("RunTx: %v", err)
	}
	if runs != 2 {
		t.Fatalf("the unit of work ran %d times, want 2 (a 40001, then the retry)", runs)
	}
	if sqlstate(firstErr) != "40001" || !dbidem.IsRetryable(firstErr) {
		t.Fatalf("the first run's claim: %v, want SQLSTATE 40001", firstErr)
	}
	if final.Outcome != dbidem.Replay || string(final.Response.Body) != "first" {
		t.Fatalf("the retry: %+v, want a replay of first", final)
	}
	if n := pgtest.PgBouncerServers(t, b, dbName(t, url)); n < 2 {
		t.Fatalf("PgBouncer holds %d server connections to the database, want 2 (one per client at once)", n)
	}
}

// TestPgBouncerStatementCacheFails shows what pgx's default mode (a cache of named prepared
// statements) does through PgBouncer 1.18 in transaction mode, which does not carry
// prepared statements from one server connection to another: under concurrency the keyed
// transactions fail with SQLSTATE 26000 (prepared statement "stmtcache_..." does not
// exist: this server connection never saw it) or 42P05 (... already exists: another client
// prepared it on this server connection). The same load in QueryExecModeExec (the documented
// default_query_exec_mode=exec) has no failure at all.
func TestPgBouncerStatementCacheFails(t *testing.T) {
	t.Parallel()
	b := pgtest.PgBouncer(t, nil)
	load := func(pool *pgxpool.Pool) (ok int, failures map[string]int, other []error) {
		ctx := context.Background()
		var mu sync.Mutex
		failures = map[string]int{}
		var wg sync.WaitGroup
		for w := range 8 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := range 25 {
					c := keyedClaim(fmt.Sprintf("k-%d-%d", w, i), "body")
					err := dbidem.RunTx(ctx, pool, dbidem.TxOptions{}, func(tx *dbidem.Tx) error {
						d, err := tx.Claim(ctx, c)
						if err == nil && d.Outcome == dbidem.Claimed {
							tx.CompleteOnCommit(dbidem.Response{Status: 201})
						}
						return err
					})
					mu.Lock()
					var pgErr *pgconn.PgError
					switch {
					case err == nil:
						ok++
					case errors.As(err, &pgErr) && (pgErr.Code == "26000" || pgErr.Code == "42P05") &&
						strings.HasPrefix(pgErr.Message, `prepared statement "stmtcache_`):
						failures[pgErr.Code+": "+stmtName.ReplaceAllString(pgErr.Message, "stmtcache_...")]++
					default:
						other = append(other, err)
					}
					mu.Unlock()
				}
			}()
		}
		wg.Wait()
		return ok, failures, other
	}

	cached := bouncerPool(t, pgtest.NewDB(t), b, pgx.QueryExecModeCacheStatement, 8)
	var ok int
	var failures map[string]int
	var other []error
	for round := 0; round < 5 && len(failures) == 0; round++ { // one round fails as a rule
		ok, failures, other = load(cached)
		if len(other) > 0 {
			t.Fatalf("failures other than the statement cache's: %v", other)
		}
	}
	if len(failures) == 0 {
		t.Fatal("every transaction succeeded with the statement cache through PgBouncer, 5 rounds of 200: expected 26000/42P05")
	}
	var lines []string
	for k, n := range failures {
		lines = append(lines, fmt.Sprintf("%d × SQLSTATE %s", n, k))
	}
	sort.Strings(lines)
	t.Logf("QueryExecModeCacheStatement through PgBouncer: %d of 200 transactions committed; failures:\n%s", ok, strings.Join(lines, "\n"))

	ok, failures, other = load(bouncerPool(t, pgtest.NewDB(t), b, pgx.QueryExecModeExec, 8))
	if ok != 200 || len(failures) > 0 || len(other) > 0 {
		t.Fatalf("QueryExecModeExec through PgBouncer: %d of 200 committed; %v %v", ok, failures, other)
	}
}

package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/internal/pgbouncer"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// The reference server behind a real PgBouncer (internal/pgbouncer: Debian's pgbouncer 1.18
// in transaction mode, a private port). `server migrate` goes to PostgreSQL directly (tern
// holds a session advisory lock while it migrates, which a transaction pooler cannot keep);
// every server process then serves through PgBouncer with the DATABASE_URL form that
// docs/operations.md gives: ...?sslmode=disable&default_query_exec_mode=exec.

// bounced is a migrated database, a PgBouncer in front of the test server, and a pool that
// goes to the database directly (to watch pg_stat_activity and hold locks).
type bounced struct {
	db     string // the database, directly
	via    string // the same database through PgBouncer, in the documented form
	b      *pgbouncer.Bouncer
	direct *pgxpool.Pool
}

func behindPgBouncer(t *testing.T) *bounced {
	t.Helper()
	db := pgtest.NewEmptyDB(t)
	mig := NewMain(io.Discard, io.Discard)
	if err := mig.ParseFlags([]string{"migrate"}, serverEnv(db, nil)); err != nil {
		t.Fatal(err)
	}
	if err := mig.Run(context.Background()); err != nil {
		t.Fatalf("migrate: %v", err)
	}
	_ = mig.Close()
	b := pgtest.PgBouncer(t, nil)
	direct, err := pgxpool.New(context.Background(), db)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(direct.Close)
	return &bounced{db: db, via: pgtest.ThroughPgBouncer(t, db, b), b: b, direct: direct}
}

// waitingOnLocks waits until n backends of the database wait on a lock.
func (bb *bounced) waitingOnLocks(t *testing.T, n int) {
	t.Helper()
	pgtest.WaitFor(t, bb.direct, `SELECT count(*) - $1 + 1 FROM pg_stat_activity
		WHERE datname = current_database() AND wait_event_type = 'Lock'`, n)
}

// holdAccount locks an account's row from a direct connection until the returned release.
func (bb *bounced) holdAccount(t *testing.T, id int) (release func()) {
	t.Helper()
	ctx := context.Background()
	holder, err := bb.direct.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	release = func() { once.Do(func() { _ = holder.Rollback(ctx) }) }
	t.Cleanup(release)
	pgtest.Exec(t, holder, `SELECT 1 FROM ledger.accounts WHERE id = $1 FOR UPDATE`, id)
	return release
}

// servers counts the server connections PgBouncer holds to the test's database.
func (bb *bounced) servers(t *testing.T) int {
	t.Helper()
	cfg, err := pgx.ParseConfig(bb.db)
	if err != nil {
		t.Fatal(err)
	}
	return pgtest.PgBouncerServers(t, bb.b, cfg.Database)
}

func accountID(t *testing.T, s *testServer, token string) int {
	t.Helper()
	r := s.call("POST", "/v1/accounts", token, "", `{"name":"a","currency":"EUR"}`)
	if r.status != 201 {
		t.Fatalf("create account: %+v", r)
	}
	return int(r.json(t)["id"].(float64))
}

// twoAccounts creates a principal and two accounts, the first with 1000 in it.
func twoAccounts(t *testing.T, s *testServer) (token string, from, to int) {
	t.Helper()
	_, token = s.principal("bounced")
	from, to = accountID(t, s, token), accountID(t, s, token)
	if r := s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", from), token, "seed", `{"amount":1000}`); r.status != 201 {
		t.Fatalf("deposit: %+v", r)
	}
	return token, from, to
}

// TestPgBouncerDuplicateWaitsThenReplays: two server processes behind PgBouncer on one
// database. A keyed transfer R1 (process 1) claims its key and then waits on its account's
// row, held from a direct connection; the same transfer R2 (process 2: a duplicate in
// another process, so the Gate of process 1 cannot coalesce it) waits on the key's row in
// the database. When the account is released R1 commits, and R2 replays R1's answer.
func TestPgBouncerDuplicateWaitsThenReplays(t *testing.T) {
	t.Parallel()
	bb := behindPgBouncer(t)
	env := map[string]string{"IDEMPOTENCY_LOCK_TIMEOUT": "20s"}
	s1, s2 := serveOn(t, bb.via, env), serveOn(t, bb.via, env)
	token, from, to := twoAccounts(t, s1)
	release := bb.holdAccount(t, from)

	body := fmt.Sprintf(`{"from":%d,"to":%d,"amount":100}`, from, to)
	r1, r2 := make(chan resp, 1), make(chan resp, 1)
	go func() { r1 <- s1.call("POST", "/v1/transfers", token, "dup", body) }()
	bb.waitingOnLocks(t, 1) // R1 holds the key and waits on the account
	go func() { r2 <- s2.call("POST", "/v1/transfers", token, "dup", body) }()
	bb.waitingOnLocks(t, 2) // R2 waits on the key's row
	release()
	first, second := <-r1, <-r2
	if first.status != 201 || first.header.Get("Idempotent-Replayed") != "" {
		t.Fatalf("R1: %+v", first)
	}
	if second.status != 201 || second.body != first.body || second.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("R2: %d %s %v, want R1's answer replayed", second.status, second.body, second.header)
	}
	if n := s1.count(`SELECT count(*) FROM ledger.transfers`); n != 1 {
		t.Fatalf("%d transfers, want 1", n)
	}
	if n := s1.count(`SELECT balance FROM ledger.accounts WHERE id = $1`, from); n != 900 {
		t.Fatalf("balance %d, want 900: the money moved %d times", n, (1000-n)/100)
	}
	if n := bb.servers(t); n < 2 {
		t.Fatalf("PgBouncer holds %d server connections to the database: the servers did not go through it", n)
	}
}

// TestPgBouncerLockTimeout: the same two processes behind PgBouncer with
// IDEMPOTENCY_LOCK_TIMEOUT=300ms. A duplicate that waits on the key's row longer than that
// gets 409 request_in_progress with Retry-After; once the first request commits, a retry
// replays it.
func TestPgBouncerLockTimeout(t *testing.T) {
	t.Parallel()
	bb := behindPgBouncer(t)
	env := map[string]string{"IDEMPOTENCY_LOCK_TIMEOUT": "300ms"}
	s1, s2 := serveOn(t, bb.via, env), serveOn(t, bb.via, env)
	token, from, to := twoAccounts(t, s1)
	release := bb.holdAccount(t, from)

	body := fmt.Sprintf(`{"from":%d,"to":%d,"amount":100}`, from, to)
	r1 := make(chan resp, 1)
	go func() { r1 <- s1.call("POST", "/v1/transfers", token, "slow", body) }()
	bb.waitingOnLocks(t, 1)
	start := time.Now()
	busy := s2.call("POST", "/v1/transfers", token, "slow", body)
	waited := time.Since(start)
	if busy.status != 409 || busy.json(t)["code"] != "request_in_progress" {
		t.Fatalf("the duplicate: %+v, want 409 request_in_progress", busy)
	}
	if secs, err := strconv.Atoi(busy.header.Get("Retry-After")); err != nil || secs < 1 {
		t.Fatalf("Retry-After %q, want a number of seconds", busy.header.Get("Retry-After"))
	}
	if waited < 250*time.Millisecond {
		t.Fatalf("the duplicate was answered after %v: it did not wait for the lock timeout (300ms)", waited)
	}
	release()
	if first := <-r1; first.status != 201 {
		t.Fatalf("R1: %+v", first)
	}
	retry := s2.call("POST", "/v1/transfers", token, "slow", body)
	if retry.status != 201 || retry.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("the retry: %+v, want a replay", retry)
	}
	if n := s1.count(`SELECT count(*) FROM ledger.transfers`); n != 1 {
		t.Fatalf("%d transfers, want 1", n)
	}
}

// TestPgBouncerOneCleaner: the cleanup's single-runner election (a transaction-scoped
// advisory lock held on one connection while the batches run on others) works through
// PgBouncer in transaction mode. Two cleaners, each with its own pool through PgBouncer as
// two processes would have: while one runs a pass (its batch held back by a table lock taken
// from a direct connection), the other skips; two at once delete every expired key exactly
// once; and no advisory lock is left behind on a pooled server connection.
func TestPgBouncerOneCleaner(t *testing.T) {
	t.Parallel()
	bb := behindPgBouncer(t)
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	pool := func() *pgxpool.Pool {
		p, err := pgxpool.New(context.Background(), bb.via)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(p.Close)
		return p
	}
	a, b := newCleaner(pool(), 100, true, 1, log), newCleaner(pool(), 100, true, 1, log)
	ctx := context.Background()
	principal := func(name string) string {
		id, _, err := createPrincipal(ctx, bb.direct, name)
		if err != nil {
			t.Fatal(err)
		}
		return id
	}
	pgtest.InsertExpired(t, bb.direct, principal("p"), 3000)

	// a runs; its first batch waits behind a SHARE lock on the key table.
	holder, err := bb.direct.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = holder.Rollback(ctx) }()
	pgtest.Exec(t, holder, `LOCK TABLE idem.idempotency_keys IN SHARE MODE`)
	type result struct {
		n   int
		ran bool
		err error
	}
	done := make(chan result, 1)
	go func() {
		n, ran, err := a.pass(ctx)
		done <- result{n, ran, err}
	}()
	bb.waitingOnLocks(t, 1)
	if n, ran, err := b.pass(ctx); err != nil || ran || n != 0 {
		t.Fatalf("a pass while another runs: %d deleted, ran %v, %v; want skipped", n, ran, err)
	}
	_ = holder.Rollback(ctx)
	if r := <-done; r.err != nil || !r.ran || r.n != 3000 {
		t.Fatalf("the running pass: %d deleted, ran %v, %v; want 3000", r.n, r.ran, r.err)
	}

	// Two at once: one runs, the other skips or (starting after it) finds nothing.
	pgtest.InsertExpired(t, bb.direct, principal("q"), 3000)
	var wg sync.WaitGroup
	results := make([]result, 2)
	for i, c := range []*cleaner{a, b} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			n, ran, err := c.pass(ctx)
			results[i] = result{n, ran, err}
		}()
	}
	wg.Wait()
	for _, r := range results {
		if r.err != nil {
			t.Fatal(r.err)
		}
	}
	if results[0].n+results[1].n != 3000 || (!results[0].ran && !results[1].ran) {
		t.Fatalf("two passes at once: %+v, want 3000 deleted in all", results)
	}
	if n := pgtest.Count(t, bb.direct, `SELECT count(*) FROM idem.idempotency_keys`); n != 0 {
		t.Fatalf("%d keys left", n)
	}
	if n := pgtest.Count(t, bb.direct, `SELECT count(*) FROM pg_locks
		WHERE locktype = 'advisory' AND database = (SELECT oid FROM pg_database WHERE datname = current_database())`); n != 0 {
		t.Fatalf("%d advisory locks left on pooled server connections", n)
	}
}

// TestPgBouncerPoolOfOneCleans: behind a PgBouncer whose pool has one server connection, a
// cleanup pass deletes every expired key (it used to wait on itself: its lock transaction
// held the one connection its batches needed).
func TestPgBouncerPoolOfOneCleans(t *testing.T) {
	t.Parallel()
	db := pgtest.NewEmptyDB(t)
	if err := migrateDB(t, db); err != nil {
		t.Fatal(err)
	}
	b := pgtest.PgBouncer(t, map[string]string{"default_pool_size": "1", "query_wait_timeout": "5"})
	pool, err := pgxpool.New(context.Background(), pgtest.ThroughPgBouncer(t, db, b))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	direct := pgtest.Connect(t, db)
	id, _, err := createPrincipal(context.Background(), pool, "p")
	if err != nil {
		t.Fatal(err)
	}
	pgtest.InsertExpired(t, direct, id, 1500)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	c := newCleaner(pool, 100, true, 1, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if n, ran, err := c.pass(ctx); err != nil || !ran || n != 1500 {
		t.Fatalf("a pass through a pool of one server connection: deleted %d, ran %v, %v; want 1500", n, ran, err)
	}
	cfg, err := pgx.ParseConfig(db)
	if err != nil {
		t.Fatal(err)
	}
	if n := pgtest.PgBouncerServers(t, b, cfg.Database); n != 1 {
		t.Fatalf("PgBouncer holds %d server connections to the database, want the one of its pool", n)
	}
}

// TestPgBouncerQuickstart runs the README quickstart verbatim (as TestQuickstart does) with
// the server and the `principal create` command behind PgBouncer: DATABASE_URL is the
// documented form through PgBouncer. Then the README's psql block, through PgBouncer too.
func TestPgBouncerQuickstart(t *testing.T) {
	t.Parallel()
	bb := behindPgBouncer(t)
	s := serveOn(t, bb.via, nil)
	out := runQuickstart(t, s, bb.via)
	if n := s.count(`SELECT count(*) FROM ledger.transfers`); n != 1 {
		t.Errorf("%d transfers, want 1:\n%s", n, out)
	}

	runQuickstartPsql(t, bb.via)
	if n := bb.servers(t); n < 1 {
		t.Fatal("PgBouncer holds no server connection to the database: the quickstart did not go through it")
	}
}

// logBuffer is a server's log, safe to read while the server writes it.
type logBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *logBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *logBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// serveLogged is serveWith with the server's log kept in a logBuffer.
func serveLogged(t *testing.T, db, poolURL string, env map[string]string) (*testServer, *logBuffer) {
	t.Helper()
	log := &logBuffer{}
	return serveWith(t, db, poolURL, env, log), log
}

// keyedLoad sends 8 × 15 keyed account creations at once and counts the answers by status.
func keyedLoad(t *testing.T, s *testServer, token string) map[int]int {
	t.Helper()
	var mu sync.Mutex
	statuses := map[int]int{}
	var wg sync.WaitGroup
	for w := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 15 {
				r := s.call("POST", "/v1/accounts", token, fmt.Sprintf("acc-%d-%d", w, i), `{"name":"a","currency":"EUR"}`)
				mu.Lock()
				statuses[r.status]++
				if r.status != 201 && statuses[r.status] <= 2 { // an example of each
					t.Logf("%d %s", r.status, r.body)
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	return statuses
}

// withoutExecMode is a connection string through PgBouncer as an operator might first write
// it: without default_query_exec_mode (or with the given one).
func withoutExecMode(t *testing.T, via, mode string) string {
	t.Helper()
	u, err := url.Parse(via)
	if err != nil {
		t.Fatal(err)
	}
	q := u.Query()
	q.Del("default_query_exec_mode")
	if mode != "" {
		q.Set("default_query_exec_mode", mode)
	}
	u.RawQuery = q.Encode()
	return u.String()
}

// TestPgBouncerStatementCacheOff: a DATABASE_URL through PgBouncer that does not set
// default_query_exec_mode would leave pgx's statement cache on, which fails under
// concurrency (tests.TestPgBouncerStatementCacheFails: SQLSTATE 26000 and 42P05). The
// server sees the pooler at start (the connection's process id is not the backend's),
// switches the pool to QueryExecModeExec and says so in its log, naming the setting; every
// request of a concurrent load succeeds.
func TestPgBouncerStatementCacheOff(t *testing.T) {
	t.Parallel()
	bb := behindPgBouncer(t)
	s, log := serveLogged(t, withoutExecMode(t, bb.via, ""), bb.via, nil)
	if mode := s.main.pool.Config().ConnConfig.DefaultQueryExecMode; mode != pgx.QueryExecModeExec {
		t.Fatalf("the pool's mode behind PgBouncer: %v, want exec", mode)
	}
	if !strings.Contains(log.String(), "add default_query_exec_mode=exec to DATABASE_URL") {
		t.Fatalf("the log does not name the setting:\n%s", log)
	}
	_, token := s.principal("cache")
	if st := keyedLoad(t, s, token); st[201] != 120 {
		t.Fatalf("statuses %v, want 120 × 201", st)
	}

	// Straight to PostgreSQL nothing changes: the statement cache stays on.
	direct, log2 := serveLogged(t, bb.db, bb.db, nil)
	if mode := direct.main.pool.Config().ConnConfig.DefaultQueryExecMode; mode != pgx.QueryExecModeCacheStatement {
		t.Fatalf("the pool's mode without a pooler: %v, want cache_statement", mode)
	}
	if strings.Contains(log2.String(), "default_query_exec_mode") {
		t.Fatalf("a direct connection was taken for a pooler:\n%s", log2)
	}
}

// TestPgBouncerStatementCacheChosen: an operator who asks for the statement cache
// explicitly (default_query_exec_mode=cache_statement) behind PgBouncer 1.18 keeps it, with a
// warning at start; the requests that then fail (503 store_unavailable) leave an error in
// the log that names default_query_exec_mode=exec as the fix (the token lookup before the
// idempotency middleware answers 500 when it is the statement that fails).
func TestPgBouncerStatementCacheChosen(t *testing.T) {
	t.Parallel()
	bb := behindPgBouncer(t)
	s, log := serveLogged(t, withoutExecMode(t, bb.via, "cache_statement"), bb.via, nil)
	if !strings.Contains(log.String(), "sets default_query_exec_mode=cache_statement") {
		t.Fatalf("no warning at start:\n%s", log)
	}
	_, token := s.principal("cache")
	st := keyedLoad(t, s, token)
	if failed := 120 - st[201]; failed == 0 || st[500]+st[503] != failed {
		t.Fatalf("statuses %v, want some 503 store_unavailable (or 500 from the token lookup) among the 201s", st)
	}
	t.Logf("default_query_exec_mode=cache_statement through PgBouncer: %v", st)
	text := log.String()
	if !strings.Contains(text, "pgx's statement cache fails") || !strings.Contains(text, "add default_query_exec_mode=exec to DATABASE_URL") {
		t.Fatalf("the log does not name the fix:\n%s", text)
	}
}

// TestPgBouncerStatementCacheAtStartNamesTheFix: with default_query_exec_mode=cache_statement
// behind PgBouncer 1.18, a command's start check meets a prepared statement that an earlier
// session left on PgBouncer's server connection (42P05). The command exits with that error,
// which blamed "check the migrations"; it now names the fix, as the requests' log does (an
// operator's review started the server three times this way).
func TestPgBouncerStatementCacheAtStartNamesTheFix(t *testing.T) {
	t.Parallel()
	bb := behindPgBouncer(t)
	via := withoutExecMode(t, bb.via, "cache_statement")
	failed := 0
	for range 4 {
		m := NewMain(io.Discard, io.Discard)
		if err := m.ParseFlags([]string{"keys"}, serverEnv(via, nil)); err != nil {
			t.Fatal(err)
		}
		err := m.Run(context.Background())
		_ = m.Close()
		if err == nil {
			continue
		}
		failed++
		if !poolerCacheError(err) || !strings.Contains(err.Error(), "set default_query_exec_mode=exec in DATABASE_URL") {
			t.Fatalf("a start behind PgBouncer with the statement cache: %v; want the pooler's error naming the fix", err)
		}
	}
	if failed == 0 {
		t.Fatal("four starts with the statement cache behind PgBouncer never met a statement left by the one before; the test no longer shows the case")
	}
	t.Logf("%d of 4 starts met the earlier sessions' statements", failed)
}

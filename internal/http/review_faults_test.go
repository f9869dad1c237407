package idemhttp_test

// A review of the connection-level fault paths (a reply lost after COMMIT, a DBA's timeouts, a
// backend terminated mid-handler); its findings are fixed in D163.

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	idemhttp "github.com/pgidem/pgidem/internal/http"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// setOnDatabase sets a parameter on the test's database (what a DBA does with ALTER DATABASE
// or ALTER ROLE ... SET) and drops the pool's connections, so that every new one has it.
func setOnDatabase(t *testing.T, a *app, name, value string) {
	t.Helper()
	pgtest.Exec(t, a.pool, `DO $$ BEGIN EXECUTE format('ALTER DATABASE %I SET `+name+` = %L', current_database(), '`+value+`'); END $$`)
	a.pool.Reset()
}

// TestFaultsStatementTimeoutOnADuplicateIsNotStoreUnavailable (D163): a DBA sets
// statement_timeout on the servers' role or database (a common guard rail, here 300 ms, below
// the middleware's lock timeout of 5 s). A duplicate whose key another process holds waits on
// the key's row lock inside idem_begin; statement_timeout cancelled that wait with 57014, and
// the duplicate was answered 503 store_unavailable "the request could not be recorded; nothing
// was changed", as if the database had failed: it neither waited for the first request's
// answer (DuplicateWait) nor got a Retry-After for the work. A wait that the server ends
// before its lock timeout is a wait that ran out now: 409 request_in_progress (docs/http.md,
// "repeat while the first still runs"). The gap is held by a real row lock (another
// connection's uncommitted claim of the key).
func TestFaultsStatementTimeoutOnADuplicateIsNotStoreUnavailable(t *testing.T) {
	t.Parallel()
	a := newApp(t, nil) // LockTimeout 5 s
	setOnDatabase(t, a, "statement_timeout", "300ms")
	release := holdKeyElsewhere(t, a, "alice", "st-dup")
	defer release()
	start := time.Now()
	r := a.do("POST", "/transfers", "alice", "st-dup", `{"amount":1}`)
	t.Logf("the duplicate after %s: %d %s %v", time.Since(start).Round(time.Millisecond), r.status, r.body, r.header.Get("Retry-After"))
	if r.status != 409 || problemCode(t, r) != "request_in_progress" {
		t.Fatalf("a duplicate of a request another process runs, under a 300 ms statement_timeout: %d %s, want 409 request_in_progress",
			r.status, r.body)
	}
}

// TestFaultsTerminatedDuringHandlerConverges (checked, correct): pg_terminate_backend of a keyed
// transactional request's backend while its handler runs (held by a channel, after the claim).
// The handler's INSERT fails (FATAL 57P01): the client gets the handler's 500, nothing is
// stored, and the retry with the same key runs once and is replayed after: one effect.
func TestFaultsTerminatedDuringHandlerConverges(t *testing.T) {
	t.Parallel()
	a := newApp(t, nil)
	first := make(chan reply, 1)
	go func() { first <- a.do("POST", "/transfers", "alice", "term-handler", `{"amount":7,"block":true}`) }()
	<-a.started
	n := a.count(`SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity
		WHERE datname = current_database() AND pid <> pg_backend_pid() AND state = 'idle in transaction') x`)
	if n != 1 {
		t.Fatalf("%d backends terminated, want the request's one", n)
	}
	a.unblock()
	r := <-first
	t.Logf("the request whose backend was terminated: %d %s", r.status, r.body)
	if r.status < 500 {
		t.Fatalf("a request whose backend was terminated mid-handler: %d, want a 5xx", r.status)
	}
	if a.keys() != 0 || a.effects() != 0 {
		t.Fatalf("%d keys and %d effects after the terminated request, want none", a.keys(), a.effects())
	}
	r1 := a.do("POST", "/transfers", "alice", "term-handler", `{"amount":7}`)
	r2 := a.do("POST", "/transfers", "alice", "term-handler", `{"amount":7}`)
	if r1.status != 201 || r2.status != 201 || r1.body != r2.body || r2.header.Get("Idempotent-Replayed") != "true" || a.effects() != 1 {
		t.Fatalf("retries: %d %s / %d %s (replayed %q), %d effects; want 201 then its replay, one effect",
			r1.status, r1.body, r2.status, r2.body, r2.header.Get("Idempotent-Replayed"), a.effects())
	}
}

// TestFaultsIdleInTransactionTimeoutConverges (checked, correct): a DBA sets
// idle_in_transaction_session_timeout (300 ms) on the database; a transactional handler that
// holds its transaction idle longer (here it sleeps before its write) loses its session. The
// client gets a 5xx, nothing is stored, and the retry (a quick one) runs once: one effect.
func TestFaultsIdleInTransactionTimeoutConverges(t *testing.T) {
	t.Parallel()
	a := newApp(t, nil)
	setOnDatabase(t, a, "idle_in_transaction_session_timeout", "300ms")
	r := a.do("POST", "/transfers", "alice", "idle-tx", `{"amount":3,"sleep_ms":700}`)
	t.Logf("the slow request: %d %s", r.status, r.body)
	if r.status < 500 {
		t.Fatalf("a handler idle in its transaction past idle_in_transaction_session_timeout: %d, want a 5xx", r.status)
	}
	if a.keys() != 0 || a.effects() != 0 {
		t.Fatalf("%d keys and %d effects after the request that lost its session, want none", a.keys(), a.effects())
	}
	r1 := a.do("POST", "/transfers", "alice", "idle-tx", `{"amount":3}`)
	if r1.status != 201 || a.effects() != 1 {
		t.Fatalf("the retry: %d %s, %d effects; want 201 and one effect", r1.status, r1.body, a.effects())
	}
}

// commitCutApp is an app whose pool reaches the database through cutProxy, cutting at a
// COMMIT (pgx's Tx.Commit sends "commit", a batch "COMMIT"), in exec mode (the PgBouncer
// setting; in pgx's default mode a batch prepares its statements first, and the cut would fall
// on that round trip, before any COMMIT ran). Store 1 in cuts to cut at the next COMMIT.
// duplicateWait 0 keeps the app's.
func commitCutApp(t *testing.T, duplicateWait time.Duration) (a *app, cuts *atomic.Int32, cut chan struct{}) {
	t.Helper()
	cuts, cut = new(atomic.Int32), make(chan struct{}, 1)
	a = newApp(t, func(o *idemhttp.Options) {
		cfg, err := pgxpool.ParseConfig(pgtest.Via(t, pgtest.URLOf(t, o.DB), cutProxy(t, pgtest.TCPAddr(t), cuts, cut, "commit\x00", "COMMIT\x00")))
		if err != nil {
			t.Fatal(err)
		}
		cfg.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeExec
		pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(pool.Close)
		o.DB = pool
		if duplicateWait > 0 {
			o.DuplicateWait = duplicateWait
		}
	})
	return a, cuts, cut
}

// waitCut waits for cutProxy to report its cut (after it closed the client's side, so
// possibly after r came back), and fails the test when none came.
func waitCut(t *testing.T, cut <-chan struct{}, r reply) {
	t.Helper()
	select {
	case <-cut:
	case <-time.After(5 * time.Second):
		t.Fatalf("the proxy cut no COMMIT; the request got %d %s", r.status, r.body)
	}
}

// TestFaultsLeaseClaimCommitLostStallsTheRetryForALease (D163): on a lease route the claim
// commits on its own before the handler runs. When the connection is lost after that COMMIT
// was sent (a network cut, a pooler or proxy restart, a failover's cut), the middleware runs
// no work and answers 503 outcome_unknown with Retry-After: 1. If the COMMIT landed, the key
// was in progress under a lease that no work held: the client's retry, one second later as
// told, waited DuplicateWait and got 409 request_in_progress, and so did every retry until the
// whole lease had run out (Route.Lease: here a minute). The middleware knows the claim's
// token (the claim statement answered before COMMIT was sent), so it gives the claim up now
// (idem_yield, fenced by the token) before it answers: had the COMMIT landed, the retry takes
// the key over at once; had it not, the yield finds nothing. docs/http.md, outcome_unknown:
// "the retry replays the answer if it did, and runs if it did not".
func TestFaultsLeaseClaimCommitLostStallsTheRetryForALease(t *testing.T) {
	t.Parallel()
	a, cuts, cut := commitCutApp(t, 500*time.Millisecond)
	if r := a.do("POST", "/jobs", "alice", "warm-up", `{}`); r.status != 202 { // the middleware's first reads
		t.Fatalf("warm-up: %d %s", r.status, r.body)
	}
	cuts.Store(1)
	r := a.do("POST", "/jobs", "alice", "lost-claim", `{}`)
	waitCut(t, cut, r)
	t.Logf("the request whose claim's COMMIT reply was lost: %d %s (Retry-After %q)", r.status, r.body, r.header.Get("Retry-After"))
	time.Sleep(400 * time.Millisecond) // the server's side of the cut connection is gone
	if r.status != 503 || problemCode(t, r) != "outcome_unknown" {
		t.Errorf("want 503 outcome_unknown, got %d %s; keys in progress: %d", r.status, r.body,
			a.count(`SELECT count(*) FROM idem.idempotency_keys WHERE key = 'lost-claim' AND state = 'p'`))
	}
	t.Logf("the key: %d in progress, %d runs of the job", a.count(`SELECT count(*) FROM idem.idempotency_keys WHERE key = 'lost-claim' AND state = 'p'`), a.runs.Load())
	time.Sleep(time.Second) // Retry-After: 1
	r2 := a.do("POST", "/jobs", "alice", "lost-claim", `{}`)
	t.Logf("the retry a second later: %d %s (Retry-After %q)", r2.status, r2.body, r2.header.Get("Retry-After"))
	if r2.status != 202 {
		t.Fatalf("the retry of a lease request whose claim's COMMIT reply was lost, 1 s later as told: %d %s (Retry-After %q); want the work run (202): "+
			"the claim committed, no work holds it, and the retry waits for the whole lease", r2.status, r2.body, r2.header.Get("Retry-After"))
	}
}

// TestFaultsCommitReplyLostIsOutcomeUnknown (D163, a false "nothing was changed"): the
// connection is lost after a transactional request's COMMIT (with its completion) was sent and
// before its reply came back; the COMMIT landed (the effect and the stored answer are there).
// pgx v5.12 reports that as "conn closed" (pgconn.ErrConnClosed, whose SafeToRetry is true:
// MultiResultReader.NextResult drops peekMessage's read error, the connection is closed by
// then, and receiveMessage answers "conn closed"), and RunTx trusted SafeToRetry to mean
// "nothing was sent": the client got 503 store_unavailable "the request could not be recorded;
// nothing was changed", for a request that took effect. A client that believed it (and gave
// up, or tried again under a new key) got a double effect. Expected (docs/http.md: "the
// connection is lost while the request commits | 503 outcome_unknown with Retry-After: 1"):
// 503 outcome_unknown, and the retry with the same key replays. The cut is a proxy that
// forwards the COMMIT, drops the replies and closes the client's side.
func TestFaultsCommitReplyLostIsOutcomeUnknown(t *testing.T) {
	t.Parallel()
	a, cuts, cut := commitCutApp(t, 0)
	if r := a.do("POST", "/transfers", "alice", "warm-up", `{"amount":1}`); r.status != 201 {
		t.Fatalf("warm-up: %d %s", r.status, r.body)
	}
	cuts.Store(1)
	r := a.do("POST", "/transfers", "alice", "lost-reply", `{"amount":5}`) // no "commit" in the key: the proxy looks for it
	waitCut(t, cut, r)
	time.Sleep(400 * time.Millisecond) // the server's side of the cut connection is gone
	stored := a.count(`SELECT count(*) FROM idem.idempotency_keys WHERE key = 'lost-reply' AND state = 'c'`)
	effects := a.count(`SELECT count(*) FROM effects WHERE amount = 5`)
	t.Logf("the request whose COMMIT reply was lost: %d %s; stored answers %d, effects %d", r.status, r.body, stored, effects)
	if stored != 1 || effects != 1 {
		t.Fatalf("the COMMIT did not land (%d stored, %d effects): the cut came too early", stored, effects)
	}
	if r.status != 503 || problemCode(t, r) != "outcome_unknown" {
		t.Errorf("a request whose COMMIT landed but whose reply was lost: %d %s; want 503 outcome_unknown, not a claim that nothing was changed",
			r.status, r.body)
	}
	r2 := a.do("POST", "/transfers", "alice", "lost-reply", `{"amount":5}`)
	if r2.status != 201 || r2.header.Get("Idempotent-Replayed") != "true" || a.count(`SELECT count(*) FROM effects WHERE amount = 5`) != 1 {
		t.Errorf("the retry with the same key: %d %s (replayed %q); want the replay and one effect", r2.status, r2.body, r2.header.Get("Idempotent-Replayed"))
	}
}

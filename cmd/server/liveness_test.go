package main

import (
	"context"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/pgidem/pgidem/internal/history"
	"github.com/pgidem/pgidem/internal/pgcluster"
)

// Liveness of the reference server: clients that keep retrying must converge. Two scenarios,
// without faults, against a server whose work is slow:
//
//   - outlast tx: a deposit or transfer whose work (2.5 s) is longer than each of the client's
//     attempts (1 s), the client retrying under the same key for up to 5 s (9 s in the long
//     mode);
//   - duplicate lease: a payout (2 s at the provider, under a 10 s lease) and the same request
//     200 ms later from a second client, which honours Retry-After, for up to 4 s.
//
// The liveness check (internal/history, docs/testing.md) requires each client to get the
// answer, and a duplicate within 1.5 s of it being stored (the key table is watched).

const (
	liveTTL      = time.Minute
	liveLease    = 10 * time.Second
	liveProvider = 2 * time.Second
	liveWork     = 2500 * time.Millisecond // of a deposit or a transfer
	liveAttempt  = time.Second             // of a client of "outlast tx"
)

// slowWork makes every deposit and transfer of the database take liveWork, in the claim's
// transaction: a trigger of the test's own (schema livetest), which the server knows nothing
// of. The work outlives a client that hangs up (the middleware's WorkTimeout bounds it).
const slowWork = `
CREATE SCHEMA livetest;
CREATE FUNCTION livetest.slow() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
	PERFORM pg_sleep(%f);
	RETURN NEW;
END $$;
CREATE TRIGGER livetest_slow BEFORE INSERT ON ledger.deposits FOR EACH ROW EXECUTE FUNCTION livetest.slow();
CREATE TRIGGER livetest_slow BEFORE INSERT ON ledger.transfers FOR EACH ROW EXECUTE FUNCTION livetest.slow();`

// TestHTTPLiveness: retrying clients of the reference server converge, even when each attempt
// is shorter than the work, and a duplicate of a lease route's request gets the answer soon
// after it is stored. Short mode: each scenario once, at once (about 5 s); long mode (HISTORY_MODE=long):
// four workers for two minutes.
func TestHTTPLiveness(t *testing.T) {
	t.Parallel()
	mode := history.ModeFromEnv(1, time.Second, 2)
	if mode.Long && os.Getenv("HISTORY_OPS") == "" {
		mode.Ops = 100 // the duration decides: these scenarios last seconds each
	}
	// How long the client of "outlast tx" retries: the work and the bound, with room. In the long
	// mode two slow works may want the same account (a deposit and a transfer lock theirs
	// before the slow insert), so one may wait for the other's 2.5 s first.
	outlastFor := 5 * time.Second
	if mode.Long {
		outlastFor = 9 * time.Second
	}
	bin := serverBinary(t)
	c, db := ledgerCluster(t)
	ctx := context.Background()
	port, err := pgcluster.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	p := &process{t: t, bin: bin, addr: fmt.Sprintf("127.0.0.1:%d", port), env: append(os.Environ(),
		"DATABASE_URL="+c.URL("ledger"), "LISTEN_ADDR="+fmt.Sprintf("127.0.0.1:%d", port),
		"IDEMPOTENCY_TTL="+liveTTL.String(), "IDEMPOTENCY_LOCK_TIMEOUT=300ms", "PAYOUTS_LEASE="+liveLease.String(),
		"PAYOUT_PROVIDER_DELAY="+liveProvider.String(), "LOG_LEVEL=error", "DATABASE_POOL_SIZE=8")}
	p.start()
	defer p.kill()
	// The slow work holds its accounts' row locks for its 2.5 s (a transfer locks both before
	// its slow insert; a payout's insert waits for them through its foreign key). With four
	// accounts a principal, the long mode's four workers queued three or four such works on one
	// account, and a client gave up before the work it waited for had even started: the
	// ledger's contention, not the keys'. Many accounts keep that rare; the client of a lease
	// route waits a little longer for the one queue that remains.
	perUser, opTimeout := 4, 5*time.Second
	if mode.Long {
		perUser, opTimeout = 32, 8*time.Second
	}
	h := newHTTPHarnessOf(t, "http://"+p.addr, db, liveTTL, liveLease, perUser)
	if _, err := db.Exec(ctx, fmt.Sprintf(slowWork, liveWork.Seconds())); err != nil {
		t.Fatal(err)
	}

	hist := history.New()
	runner := &history.Runner{H: hist, Harness: h, Mode: mode, OpTimeout: opTimeout,
		Scenarios: []history.Scenario{
			history.Outlast(history.Transactional, liveAttempt, outlastFor, 1),
			history.Duplicate(history.Leased, 200*time.Millisecond, 4*time.Second, 1),
		}}
	t.Logf("seed %d (HISTORY_SEED), at least %d operations and %s", mode.Seed, mode.Ops, mode.Duration)
	runCtx, cancel := context.WithTimeout(ctx, mode.Duration*10+5*time.Minute)
	defer cancel()
	runner.Run(runCtx)
	// Settle: work left running (a payout, a deposit whose client hung up) ends.
	for i := 0; ; i++ {
		var n int
		err := db.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
			AND pid <> pg_backend_pid() AND (state = 'active' OR state LIKE 'idle in transaction%')`).Scan(&n)
		if err == nil && n == 0 {
			break
		}
		if i > 300 {
			t.Fatalf("work left running: %d backends (%v)", n, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	hist.Close()
	if err := runner.Observe(ctx); err != nil {
		t.Fatal(err)
	}
	res := history.Verify(t, hist, t.Name())
	t.Logf("scenarios: %v", runner.Ran())
	history.Require(t, "the scenario", runner.Ran(), map[string]int{"outlast tx": 1, "duplicate lease": 1})
	history.Require(t, "the check", map[string]int{"retrying clients": res.Chains}, map[string]int{"retrying clients": 3})
}

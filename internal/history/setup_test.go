package history

import (
	"context"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	idemsql "github.com/pgidem/pgidem/sql"
)

// runFaults runs the quiet scenarios first, without faults (Runner.Quiet), then the runner's
// scenarios while the injector injects faults, and stops the injector when they are done.
func runFaults(t testing.TB, h *History, inj *Injector, runner *Runner, mode Mode, quiet ...Scenario) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), mode.Duration*10+5*time.Minute)
	defer cancel()
	runner.Quiet(ctx, quiet...)
	faultCtx, stopFaults := context.WithCancel(ctx)
	faultErr := make(chan error, 1)
	go func() {
		faultErr <- inj.Run(faultCtx, mode.Seed, func(rng *rand.Rand) time.Duration {
			return time.Duration(150+rng.IntN(450)) * time.Millisecond
		})
	}()
	runner.Run(ctx)
	stopFaults()
	if err := <-faultErr; err != nil {
		t.Errorf("%v", err)
	}
}

// edgeWork is how long the work of an ExpiryEdge request takes in the SQL and Go harnesses:
// its claim and its answer that far apart, so that a TTL counted from the claim is gone
// edgeWork before the edge, well before the probe (edgeMargin before it).
const edgeWork = 700 * time.Millisecond

// cleanupEvery is how often the harnesses run idem_cleanup: a key deleted a second early is
// then deleted long before the edge probe.
const cleanupEvery = 100 * time.Millisecond

// edgeTTL is the TTL of the ExpiryEdge keys of the SQL and Go harnesses (which claim with a
// key's own TTL): short, for short runs; longer than a second, so that a key deleted a second
// early is deleted after its answer.
const edgeTTL = 1500 * time.Millisecond

// probeEdgesAgain runs ExpiryEdge again, quietly (after the faults), up to three times, for
// each kind of route whose edge probe never returned in time: a probe counts only when it
// returns within 450 ms, and the quiet ones run together at the start, when the other
// packages' tests start too; on a loaded machine (CI) all of a kind came back late, twice.
// requireEdges still asks for one of each.
func probeEdgesAgain(ctx context.Context, runner *Runner) {
	for range 3 {
		events := runner.Events()
		var again []Scenario
		if events["expiry probed before the edge tx"] == 0 {
			again = append(again, ExpiryEdge(Transactional, edgeWork, edgeTTL, 0))
		}
		if events["expiry probed before the edge lease"] == 0 {
			again = append(again, ExpiryEdge(Leased, edgeWork, edgeTTL, 0))
		}
		if len(again) == 0 {
			return
		}
		runner.Quiet(ctx, again...)
	}
}

// outcomeAgain runs scenario again, quietly (after the faults), up to three times, while the
// history holds fewer than want of outcome: the runs' checks ask for some, and in a short run
// (CI's) the faults can absorb the few that the scenarios make. Mismatches (2 of 3 once) from
// the changed-body scenarios; lost leases (0 in 5 stale holders once: under load the taker's
// claim came after the stale holder's completion, which then found its key not taken).
func outcomeAgain(ctx context.Context, h *History, runner *Runner, outcome string, want int, scenario Scenario) {
	for range 3 {
		if outcomes, _ := h.Counts(); outcomes[outcome] >= want {
			return
		}
		runner.Quiet(ctx, scenario)
	}
}

// requireEdges fails a run that probed the contract's bounds too little: unknown outcomes,
// takeovers, lost leases, COMMITs killed, probes before a key's expiry that returned in time,
// and cleanup passes; takeovers and lost leases only when leases (the SQL harness's scenarios
// make them; the Go harness's only faults do).
func requireEdges(t testing.TB, h *History, runner *Runner, cleanups int64, leases bool) {
	t.Helper()
	outcomes, _ := h.Counts()
	events := runner.Events()
	kills := 0
	for _, f := range h.Faults() {
		if f.Kind == "commit-kill" && strings.Contains(f.Detail, "terminated in COMMIT") {
			kills++
		}
	}
	t.Logf("edges: %v; COMMITs killed %d; cleanup passes %d", events, kills, cleanups)
	want := map[string]int{"unknown": 3, "expiry probed before the edge tx": 1, "expiry probed before the edge lease": 1,
		"COMMIT killed": 1, "cleanup pass": 20}
	if leases {
		want["lost"], want["takeover"] = 1, 1
	}
	Require(t, "the edge", map[string]int{"unknown": outcomes["unknown"], "lost": outcomes["lost"],
		"takeover": events["takeover"], "expiry probed before the edge tx": events["expiry probed before the edge tx"],
		"expiry probed before the edge lease": events["expiry probed before the edge lease"],
		"COMMIT killed":                       kills, "cleanup pass": int(cleanups)},
		want)
}

// waitIdle waits (up to 30 seconds) until no backend of the clients is left in a transaction
// or running a statement, and the cluster answers.
func waitIdle(t testing.TB, pool *pgxpool.Pool, app string) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		var n int
		err := pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity
			WHERE application_name = $1 AND state <> 'idle'`, app).Scan(&n)
		if err == nil && n == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the clients' backends did not settle: %d busy (%v)", n, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// historyDB starts a cluster with a database "hist" migrated and holding the effects' schema,
// a pool that observes it directly (closed when the test ends), and a fault proxy in front of
// it for the clients.
func historyDB(t *testing.T) (*Cluster, *pgxpool.Pool, *Proxy) {
	c := StartCluster(t)
	c.CreateDB(t, "hist")
	ctx := context.Background()
	admin, err := pgx.Connect(ctx, c.URL("hist"))
	if err != nil {
		t.Fatal(err)
	}
	if err := idemsql.Migrate(ctx, admin, idemsql.Options{}); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.Exec(ctx, historySchema); err != nil {
		t.Fatal(err)
	}
	admin.Close(ctx)
	observe, err := pgxpool.New(ctx, c.URL("hist"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(observe.Close)
	return c, observe, NewProxy(t, c.Addr())
}

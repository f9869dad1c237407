package history

import (
	"context"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	idemsql "github.com/pgidem/pgidem/sql"
)

// runFaults runs the scenarios while the injector injects faults, and stops the injector
// when the scenarios are done.
func runFaults(t testing.TB, h *History, inj *Injector, runner *Runner, mode Mode) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), mode.Duration*10+5*time.Minute)
	defer cancel()
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

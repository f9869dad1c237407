package idemriver_test

// A review (helper session; no broken promise found here) of pgx's query exec modes and a legacy login role's settings (D231) for idemriver's
// Work: a job whose first run fails after a step, its retry, a duplicate run while one works
// (snoozed), and a run after the result was stored. The job rows are built by hand, so that
// River's own queries (which may not support every mode) are not part of it; the River client
// is tried separately in TestRiverClientInEveryQueryMode.

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/idem/idemriver"
	"github.com/pgidem/pgidem/internal/pgtest"
)

var modesAll = []pgx.QueryExecMode{
	pgx.QueryExecModeCacheStatement, pgx.QueryExecModeCacheDescribe, pgx.QueryExecModeDescribeExec,
	pgx.QueryExecModeExec, pgx.QueryExecModeSimpleProtocol,
}

var modesLegacy = []string{
	"DateStyle = 'SQL, DMY'", "bytea_output = 'escape'", "IntervalStyle = 'sql_standard'",
	"extra_float_digits = -15", "TimeZone = 'Asia/Kathmandu'",
}

// modesAppPool is a pool in mode of a new idem_app login role with sets (ALTER ROLE), on db.
func modesAppPool(t *testing.T, db string, mode pgx.QueryExecMode, sets []string) *pgxpool.Pool {
	t.Helper()
	appURL := pgtest.LoginRole(t, db, "idem_app")
	admin := pgtest.Connect(t, db)
	cfg, err := pgxpool.ParseConfig(appURL)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range sets {
		pgtest.Exec(t, admin, `ALTER ROLE `+cfg.ConnConfig.User+` SET `+s)
	}
	cfg.ConnConfig.DefaultQueryExecMode = mode
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

func TestWorkInEveryQueryMode(t *testing.T) {
	t.Parallel()
	for _, mode := range modesAll {
		{ // the legacy settings only: the default ones run all over the suite
			name, sets := mode.String()+"/legacy", modesLegacy
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				ctx := context.Background()
				pool := modesAppPool(t, pgtest.NewDB(t), mode, sets)
				o := idemriver.Options{DB: pool, Lease: 2 * time.Second, Gate: idem.NewGate(idem.GateOptions{})}
				job := &rivertype.JobRow{ID: 42, Kind: "receipt", EncodedArgs: []byte(`{"order":7,"note":"a\\b"}`),
					CreatedAt: time.Now(), Attempt: 1}
				var runs, stepRuns atomic.Int32
				var keys []string
				var points []string
				fn := func(ctx context.Context, c idem.LeaseClaim) error {
					n := runs.Add(1)
					keys = append(keys, c.ProviderKey)
					points = append(points, c.RecoveryPoint)
					v, err := idem.Step(ctx, "charge", func(ctx context.Context, tx pgx.Tx) (string, error) {
						stepRuns.Add(1)
						return "ch_" + c.ProviderKey[:8], nil
					})
					if err != nil {
						return err
					}
					if v != "ch_"+c.ProviderKey[:8] {
						return fmt.Errorf("the step's value: %q", v)
					}
					if n == 1 {
						return errors.New("the mail server is down")
					}
					return nil
				}
				if err := idemriver.Work(ctx, job, o, fn); err == nil || err.Error() != "the mail server is down" {
					t.Fatalf("first run: %v; want fn's error", err)
				}
				job.Attempt = 2
				// A run while another holds the key: snoozed.
				hold, held := make(chan struct{}), make(chan struct{})
				other := make(chan error, 1)
				go func() {
					other <- idemriver.Work(ctx, job, o, func(ctx context.Context, c idem.LeaseClaim) error {
						close(held)
						<-hold
						return fn(ctx, c)
					})
				}()
				<-held
				var snooze *river.JobSnoozeError
				if err := idemriver.Work(ctx, job, idemriver.Options{DB: pool, Lease: 2 * time.Second}, fn); !errors.As(err, &snooze) {
					t.Errorf("a run while another holds the key: %v; want a snooze", err)
				}
				close(hold)
				if err := <-other; err != nil {
					t.Errorf("the retry: %v; want nil", err)
				}
				job.Attempt = 3
				if err := idemriver.Work(ctx, job, o, fn); err != nil {
					t.Errorf("a run after the stored result: %v; want nil", err)
				}
				if runs.Load() != 2 || stepRuns.Load() != 1 || len(keys) != 2 || keys[0] != keys[1] || points[1] != "charge" {
					t.Errorf("fn ran %d times, its step %d, provider keys %q, recovery points %q; want 2, 1, one key, [\"\" charge]",
						runs.Load(), stepRuns.Load(), keys, points)
				}
				story, ok, err := idem.ReadKey(ctx, pool, idemriver.DefaultPrincipal, "receipt/42")
				if err != nil || !ok || story.State != "completed" || story.KeptUntil.Before(time.Now().Add(29*24*time.Hour)) {
					t.Errorf("ReadKey of the job's key: %+v %v %v; want completed, kept 30 days", story, ok, err)
				}
			})
		}
	}
}

// TestRiverClientInEveryQueryMode runs a job through a River client whose pool (River's and idem's, as
// the package's doc has it) is in each mode, under the default settings: it tells which modes
// River itself supports.
func TestRiverClientInEveryQueryMode(t *testing.T) {
	t.Parallel()
	for _, mode := range modesAll {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			owner := newPool(t) // River's tables migrated, default mode
			cfg := owner.Config().Copy()
			cfg.ConnConfig.DefaultQueryExecMode = mode
			pool, err := pgxpool.NewWithConfig(ctx, cfg)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(pool.Close)
			p := newProvider()
			workers := river.NewWorkers()
			river.AddWorker(workers, &receiptWorker{p: p})
			client := newClient(t, pool, workers, idemriver.Middleware(idemriver.Options{DB: pool, Lease: 2 * time.Second}))
			res, err := client.Insert(ctx, ReceiptArgs{Order: 7}, nil)
			if err != nil {
				t.Fatalf("River's Insert in %v: %v", mode, err)
			}
			waitFor(t, owner, `SELECT count(*) FROM river_job WHERE id = $1 AND state = 'completed'`, res.Job.ID)
			if effects, calls := p.figures(); effects != 1 || len(calls) != 1 {
				t.Errorf("the provider: %d effects, calls %v; want one effect under one key", effects, calls)
			}
		})
	}
}

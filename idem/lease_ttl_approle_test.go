package idem_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestDoLeaseHeartbeatOutlivesAShortTTL: a DoLease with a TTL far below its work's length: the
// heartbeat keeps the key (its expiry is the TTL past the lease), a duplicate is in progress
// all along, the answer is recorded and replays for the TTL after it (D200), and after that a
// new run is a new generation with a new provider key.
func TestDoLeaseHeartbeatOutlivesAShortTTL(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 8)
	job := idem.Job{Principal: "alice", Key: "short-ttl-long-work", Action: "export", Lease: time.Second, TTL: 400 * time.Millisecond}
	var key1 string
	dupErrs := make(chan error, 1)
	n, replayed, err := idem.DoLease(ctx, pool, job, func(ctx context.Context, c idem.LeaseClaim) (int, error) {
		key1 = c.ProviderKey
		time.Sleep(1500 * time.Millisecond) // longer than the lease and the TTL together
		_, _, err := idem.DoLease(ctx, pool, job, func(context.Context, idem.LeaseClaim) (int, error) { return 0, errors.New("dup ran") })
		dupErrs <- err
		time.Sleep(800 * time.Millisecond)
		if ctx.Err() != nil {
			return 0, context.Cause(ctx)
		}
		return 1, nil
	})
	if err != nil || n != 1 || replayed {
		t.Fatalf("the long work: %d %v %v", n, replayed, err)
	}
	if e := <-dupErrs; !errors.Is(e, idem.ErrInProgress) {
		t.Fatalf("a duplicate while the work ran: %v, want ErrInProgress", e)
	}
	if n, replayed, err := idem.DoLease(ctx, pool, job, func(context.Context, idem.LeaseClaim) (int, error) { return 2, nil }); err != nil || n != 1 || !replayed {
		t.Fatalf("right after the answer: %d %v %v, want the replay of 1", n, replayed, err)
	}
	time.Sleep(600 * time.Millisecond)
	var key2 string
	if n, replayed, err := idem.DoLease(ctx, pool, job, func(_ context.Context, c idem.LeaseClaim) (int, error) { key2 = c.ProviderKey; return 3, nil }); err != nil || n != 3 || replayed || key2 == key1 {
		t.Fatalf("after the answer's TTL: %d %v %v (provider keys %q %q), want a new run under a new key", n, replayed, err, key1, key2)
	}
}

// TestStepsAsTheApplicationRole: everything DoLease and Step need, as a login role that is only a
// member of idem_app (docs/http.md "Two roles"): the claim, a step with the service's own
// write, the yield when fn fails, the takeover that skips the step, the answer, Do's refusal of
// a job with steps and its replay.
func TestStepsAsTheApplicationRole(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	owner, url := pgtest.NewPool(t, 4)
	appURL := pgtest.LoginRole(t, url, "idem_app")
	app, err := pgxpool.New(ctx, appURL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(app.Close)
	var role string
	if err := app.QueryRow(ctx, `SELECT current_user`).Scan(&role); err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, owner, `CREATE TABLE app_orders (id serial PRIMARY KEY, note text)`)
	pgtest.Exec(t, owner, `GRANT SELECT, INSERT ON app_orders TO `+pgx.Identifier{role}.Sanitize()+
		`; GRANT USAGE ON SEQUENCE app_orders_id_seq TO `+pgx.Identifier{role}.Sanitize())
	job := idem.Job{Principal: "alice", Key: "steps-app-role", Action: "order", Input: map[string]int{"n": 1}, Lease: 2 * time.Second,
		TTL: time.Minute}
	fail := true
	runs := 0
	work := func(ctx context.Context, c idem.LeaseClaim) (int, error) {
		id, err := idem.Step(ctx, "order", func(ctx context.Context, tx pgx.Tx) (int, error) {
			runs++
			var id int
			err := tx.QueryRow(ctx, `INSERT INTO app_orders (note) VALUES ('x') RETURNING id`).Scan(&id)
			return id, err
		})
		if err != nil {
			return 0, err
		}
		if fail {
			return 0, errors.New("the provider failed")
		}
		if c.RecoveryPoint != "order" {
			return 0, fmt.Errorf("RecoveryPoint %q, want order", c.RecoveryPoint)
		}
		return id, nil
	}
	if _, _, err := idem.DoLease(ctx, app, job, work); err == nil || err.Error() != "the provider failed" {
		t.Fatalf("first DoLease as idem_app: %v", err)
	}
	if _, _, err := idem.Do(ctx, app, job, idem.TxOptions{}, func(context.Context, pgx.Tx) (int, error) { return 0, nil }); !errors.Is(err, idem.ErrMismatch) {
		t.Fatalf("Do of the job with a step, as idem_app: %v, want ErrMismatch", err)
	}
	fail = false
	id, replayed, err := idem.DoLease(ctx, app, job, work)
	if err != nil || replayed || id != 1 || runs != 1 {
		t.Fatalf("the retry as idem_app: %d %v %v (step ran %d times)", id, replayed, err, runs)
	}
	if got, replayed, err := idem.Do(ctx, app, job, idem.TxOptions{}, func(context.Context, pgx.Tx) (int, error) { return 0, errors.New("ran") }); err != nil || !replayed || got != 1 {
		t.Fatalf("Do's replay as idem_app: %d %v %v", got, replayed, err)
	}
	if n := pgtest.Count(t, owner, `SELECT count(*) FROM app_orders`); n != 1 {
		t.Fatalf("%d orders, want 1", n)
	}
}

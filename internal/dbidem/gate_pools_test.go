package dbidem_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/internal/dbidem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestGateDefaultGateSpansDatabases: Job.Gate nil is one Gate shared by every Do of the
// process, and it lined requests up by (principal, key) alone: a Do on one database waited in
// Go for a Do with the same principal and key on another database (another tenant's, another
// shard's: the keys of two databases never meet), and was refused ErrInProgress at its lock
// timeout although nothing held its key in its database. A queue consumer with a fixed
// principal ("orders-consumer") and message ids as keys, one pool per tenant, met it whenever
// two tenants' ids coincided. The Gate keeps the keys of each pool apart.
func TestGateDefaultGateSpansDatabases(t *testing.T) {
	t.Parallel()
	pool1, _ := pgtest.NewPool(t, 4)
	pool2, _ := pgtest.NewPool(t, 4)
	ctx := context.Background()
	job := dbidem.Job{Principal: "orders-consumer", Key: "msg-1", Action: "consume", Input: map[string]int{"n": 1},
		LockTimeout: 4 * time.Second}
	in, release := make(chan struct{}), make(chan struct{})
	done1 := make(chan error, 1)
	go func() {
		_, _, err := dbidem.Do(ctx, pool1, job, dbidem.TxOptions{}, func(ctx context.Context, tx pgx.Tx) (int, error) {
			close(in)
			<-release
			return 1, nil
		})
		done1 <- err
	}()
	<-in
	start := time.Now()
	got, replayed, err := dbidem.Do(ctx, pool2, job, dbidem.TxOptions{}, func(ctx context.Context, tx pgx.Tx) (int, error) {
		return 2, nil
	})
	took := time.Since(start)
	close(release)
	if err1 := <-done1; err1 != nil {
		t.Errorf("the Do on database 1: %v", err1)
	}
	t.Logf("the Do on database 2 (nothing holds its key there): %d replayed=%v err=%v after %s", got, replayed, err, took.Round(time.Millisecond))
	// Its own work is a claim on a new connection of its pool, which a loaded machine can slow
	// to a second (250 ms was too tight); waiting for database 1's Do takes the whole lock
	// timeout (4 s) and ends in ErrInProgress.
	if err != nil || got != 2 || took > 2*time.Second {
		t.Errorf("a Do on database 2 whose key nothing holds in database 2 got %v (ErrInProgress: %v) after %s; "+
			"want it to run at once: the default Gate made it wait for a Do on database 1", err, errors.Is(err, dbidem.ErrInProgress), took)
	}
}

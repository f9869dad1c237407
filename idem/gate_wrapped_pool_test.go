package idem_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// wrappedPool is an idem.Pool that a caller wraps its *pgxpool.Pool in (a tracing or metrics
// wrapper, say): idem.Pool is an interface any such type satisfies.
type wrappedPool struct{ *pgxpool.Pool }

// TestWrappedSamePoolCoalesces: Job.Gate "coalesces concurrent calls of this process with
// the same key on the same pool" and the Gate's doc says "a request of this process never waits
// on a key that another request of this process holds (the Gate makes it wait in Go)". When
// flights were keyed by any pointer a pool was given as (a first build of D215), duplicates
// that reached the one pool through a wrapper made per call were not lined up: each probed,
// found the row held by this process, and took a wait slot; past MaxWaitingClaims they were
// told ErrInProgress at once, well before their lock timeout, while the first committed 300 ms
// later. Only a *pgxpool.Pool names its pool; wrappers are lined up as one pool.
func TestWrappedSamePoolCoalesces(t *testing.T) {
	t.Parallel()
	p, _ := pgtest.NewPool(t, 16)
	ctx := context.Background()
	gate := idem.NewGate(idem.GateOptions{MaxWaitingClaims: 2})
	job := idem.Job{Principal: "alice", Key: "wrapped", Action: "a", Input: map[string]int{"n": 1},
		LockTimeout: 3 * time.Second, Gate: gate}
	in := make(chan struct{})
	done1 := make(chan error, 1)
	go func() {
		_, _, err := idem.Do(ctx, &wrappedPool{p}, job, idem.TxOptions{}, func(ctx context.Context, tx pgx.Tx) (int, error) {
			close(in)
			time.Sleep(300 * time.Millisecond)
			return 1, nil
		})
		done1 <- err
	}()
	<-in
	const n = 6
	errs := make(chan error, n)
	for i := 0; i < n; i++ {
		go func() {
			start := time.Now()
			v, replayed, err := idem.Do(ctx, &wrappedPool{p}, job, idem.TxOptions{}, func(ctx context.Context, tx pgx.Tx) (int, error) {
				return 2, nil
			})
			if err != nil || !replayed || v != 1 {
				err = errors.Join(err, errors.New("after "+time.Since(start).Round(time.Millisecond).String()))
				errs <- err
				return
			}
			errs <- nil
		}()
	}
	if err := <-done1; err != nil {
		t.Fatal(err)
	}
	bad := 0
	for i := 0; i < n; i++ {
		if err := <-errs; err != nil {
			bad++
			t.Logf("a duplicate: %v", err)
		}
	}
	st := gate.Stats()
	t.Logf("gate: coalesced %d, refused %d", st.Coalesced, st.Refused)
	if bad > 0 || st.Coalesced == 0 {
		t.Errorf("%d of %d duplicates on the same pool (a wrapper made per call) did not get the first's answer; coalesced %d: "+
			"the Gate no longer lines them up in Go, they wait on the row with slots and the rest are refused at once", bad, n, st.Coalesced)
	}
}

package idemprom_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/idem"
)

// TestDoDuplicatesCountInTheirGate: idempotency_coalesced_total counts the middleware's Gate;
// Do's Gate counts in its own Stats (docs/operations.md; a first rewording of the row named
// "Do's" among what the counter counts, which it never did). A second idem.Do of a key whose
// first Do holds its claim (a real row lock, its transaction open) waits in line and gets the
// replay: counted by a Job.Gate's Stats, not by the middleware's counter.
func TestDoDuplicatesCountInTheirGate(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, reg, _ := srMiddleware(t, nil, nil)
	for _, tc := range []struct {
		name string
		gate *idem.Gate
	}{{"default Gate", nil}, {"Gate of its own", idem.NewGate(idem.GateOptions{})}} {
		job := idem.Job{Principal: "alice", Key: "do-coalesced-" + strings.ReplaceAll(tc.name, " ", "-"), Action: "job", Gate: tc.gate}
		before := srGauge(t, reg, "idempotency_coalesced_total")
		started, release := make(chan struct{}), make(chan struct{})
		first := make(chan error, 1)
		go func() {
			_, _, err := idem.Do(ctx, pool, job, idem.TxOptions{}, func(ctx context.Context, tx pgx.Tx) (int, error) {
				close(started)
				<-release
				return 7, nil
			})
			first <- err
		}()
		select { // the first holds its claim: the key's row is locked, its transaction open
		case <-started:
		case err := <-first:
			t.Fatalf("%s: the first Do ended before its work: %v", tc.name, err)
		case <-time.After(20 * time.Second):
			t.Fatalf("%s: the first Do never ran its work", tc.name)
		}
		type got struct {
			v        int
			replayed bool
			err      error
		}
		second := make(chan got, 1)
		go func() {
			v, replayed, err := idem.Do(ctx, pool, job, idem.TxOptions{}, func(ctx context.Context, tx pgx.Tx) (int, error) {
				return 8, nil
			})
			second <- got{v, replayed, err}
		}()
		if tc.gate != nil {
			deadline := time.Now().Add(10 * time.Second)
			for tc.gate.Stats().Waiting != 1 {
				if time.Now().After(deadline) {
					t.Fatalf("%s: the second Do never waited in the Gate: %+v", tc.name, tc.gate.Stats())
				}
				time.Sleep(5 * time.Millisecond)
			}
		} else {
			time.Sleep(500 * time.Millisecond) // it cannot finish while the first holds the key
		}
		select {
		case g := <-second:
			t.Fatalf("%s: the second Do returned while the first held the key: %+v", tc.name, g)
		default:
		}
		close(release)
		if err := <-first; err != nil {
			t.Fatal(err)
		}
		g := <-second
		if g.err != nil || !g.replayed || g.v != 7 {
			t.Fatalf("%s: the duplicate got %+v, want the replay of 7", tc.name, g)
		}
		if tc.gate != nil && tc.gate.Stats().Coalesced != 1 {
			t.Errorf("%s: the Gate counted %d coalesced, want 1", tc.name, tc.gate.Stats().Coalesced)
		}
		if after := srGauge(t, reg, "idempotency_coalesced_total"); after != before {
			t.Errorf("%s: idempotency_coalesced_total moved by %v for a Do duplicate, want 0: it counts the middleware's Gate",
				tc.name, after-before)
		}
	}
}

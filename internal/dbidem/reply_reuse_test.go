package dbidem_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/internal/dbidem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestBlackHoleRightAfterALargeReply: the pool's one connection has just received a
// large reply (a 3 MB replay, its last bytes a moment before), and the path black-holes right
// then: the next claim on the same connection (reused within microseconds) must still be given
// up at about the plain bound (Probe + ClaimReplyMargin), not held by the bytes of the reply
// before it (tcpi_last_data_recv at the first look).
func TestBlackHoleRightAfterALargeReply(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	direct, url := pgtest.NewPool(t, 2)
	for _, mode := range []pgtest.Fault{pgtest.Swallow, pgtest.Hold} {
		for _, lease := range []time.Duration{0, 30 * time.Second} {
			name := fmt.Sprintf("mode=%d/lease=%s", mode, lease)
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				big := strings.Repeat("q", 3<<20)
				job := dbidem.Job{Principal: "alice", Key: "big-" + name, Action: "a", Lease: lease, LockTimeout: 2 * time.Second}
				var err error
				if lease == 0 {
					_, _, err = dbidem.Do(ctx, direct, job, dbidem.TxOptions{}, func(context.Context, pgx.Tx) (string, error) { return big, nil })
				} else {
					_, _, err = dbidem.DoLease(ctx, direct, job, func(context.Context, dbidem.LeaseClaim) (string, error) { return big, nil })
				}
				if err != nil {
					t.Fatal(err)
				}
				small := dbidem.Job{Principal: "alice", Key: "small-" + name, Action: "a", Lease: lease, LockTimeout: 2 * time.Second}
				if _, _, err := replyDo(ctx, direct, small); err != nil {
					t.Fatal(err)
				}
				p := pgtest.NewProxy(t, pgtest.TCPAddr(t))
				p.Rate.Store(8 << 20) // 8 MB/s: the big replay's bytes keep arriving to its very end
				pool := replyPool(t, url, p.Addr)
				if _, replayed, err := replyDo(ctx, pool, small); err != nil || !replayed {
					t.Fatalf("warm-up: %v %v", replayed, err)
				}
				// the big replay, then at once the black hole and the next claim on the same connection
				v, replayed, err := replyDo(ctx, pool, job)
				if err != nil || !replayed || len(v) != len(big) {
					t.Fatalf("big replay: %d bytes, %v, %v", len(v), replayed, err)
				}
				p.SetFault(mode)
				start := time.Now()
				_, _, err = replyDo(ctx, pool, small)
				took := time.Since(start)
				t.Logf("%s: given up after %s: %v", name, took.Round(time.Millisecond), err)
				if !dbidem.IsNoReply(err) {
					t.Fatalf("black hole right after a large reply ended after %s with %v, want no reply", took, err)
				}
				if took > dbidem.ClaimReplyMargin+1500*time.Millisecond {
					t.Fatalf("black hole right after a large reply given up after %s; the plain bound is 5 ms + %s", took, dbidem.ClaimReplyMargin)
				}
			})
		}
	}
}

package dbidem_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/internal/dbidem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// poolVia is a pool through addr (a proxy's) to url's database.
func poolVia(t *testing.T, url, addr string) *pgxpool.Pool {
	t.Helper()
	pool, err := pgxpool.New(context.Background(), pgtest.Via(t, url, addr))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// An answer too large to arrive within the claim's reply bound (its lock timeout, a 5 ms
// probe's here, and ClaimReplyMargin, 5 s) on a slow link: its replay was taken for a lost
// connection every time, and a client that kept retrying never got the answer it had paid
// for. The bytes of the reply keep coming, so the replay waits for them (D213): 12 MB at
// 1.5 MB/s.
func TestReplayOfALargeAnswerOnASlowLinkArrives(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	direct, url := pgtest.NewPool(t, 2)
	big := strings.Repeat("x", 12<<20)
	for _, lease := range []time.Duration{0, 30 * time.Second} {
		job := dbidem.Job{Principal: "alice", Key: "large-" + lease.String(), Action: "a", Lease: lease}
		if lease == 0 {
			if _, _, err := dbidem.Do(ctx, direct, job, dbidem.TxOptions{}, func(context.Context, pgx.Tx) (string, error) { return big, nil }); err != nil {
				t.Fatal(err)
			}
		} else if _, _, err := dbidem.DoLease(ctx, direct, job, func(context.Context, dbidem.LeaseClaim) (string, error) { return big, nil }); err != nil {
			t.Fatal(err)
		}
	}
	slow := poolVia(t, url, pgtest.SlowLink(t, 3<<19, 0))
	for _, lease := range []time.Duration{0, 30 * time.Second} {
		t.Run("lease="+lease.String(), func(t *testing.T) {
			job := dbidem.Job{Principal: "alice", Key: "large-" + lease.String(), Action: "a", Lease: lease}
			start := time.Now()
			var v string
			var replayed bool
			var err error
			if lease == 0 {
				v, replayed, err = dbidem.Do(ctx, slow, job, dbidem.TxOptions{}, func(context.Context, pgx.Tx) (string, error) { return "", errors.New("ran again") })
			} else {
				v, replayed, err = dbidem.DoLease(ctx, slow, job, func(context.Context, dbidem.LeaseClaim) (string, error) { return "", errors.New("ran again") })
			}
			took := time.Since(start)
			if err != nil || !replayed || len(v) != len(big) {
				t.Fatalf("replay on a slow link after %s: %d bytes, replayed %v, %v", took, len(v), replayed, err)
			}
			if took < 7*time.Second {
				t.Fatalf("the link forwarded 12 MB in %s: it is not slow enough to pass the bound", took)
			}
		})
	}
}

// A reply that stops arriving midway is still given up: the bound waits for bytes that come,
// not for ever. The link dies after 3 MB of a 12 MB answer.
func TestReplyThatStopsMidwayIsGivenUp(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	direct, url := pgtest.NewPool(t, 2)
	job := dbidem.Job{Principal: "alice", Key: "cut", Action: "a"}
	if _, _, err := dbidem.Do(ctx, direct, job, dbidem.TxOptions{}, func(context.Context, pgx.Tx) (string, error) { return strings.Repeat("x", 12<<20), nil }); err != nil {
		t.Fatal(err)
	}
	cut := poolVia(t, url, pgtest.SlowLink(t, 3<<19, 3<<20))
	start := time.Now()
	_, _, err := dbidem.Do(ctx, cut, job, dbidem.TxOptions{}, func(context.Context, pgx.Tx) (string, error) { return "", errors.New("ran again") })
	took := time.Since(start)
	if !dbidem.IsNoReply(err) {
		t.Fatalf("a reply cut midway ended after %s with %v, want no reply", took, err)
	}
	// At most twice ClaimReplyMargin (the probe's lock timeout is 5 ms), with room: nothing
	// waits for ever.
	if took > 2*dbidem.ClaimReplyMargin+5*time.Second {
		t.Fatalf("a reply cut midway was given up after %s", took)
	}
}

// A replay whose bytes were all written long before the client had them (a buffering hop in
// front of a slow link): the server's transaction sat idle past its idle_in_transaction
// timeout (a lease claim's own, 5 s; a DBA's on the role for Do) and the server ended the
// connection before the claim's COMMIT. The client had the whole answer, and was told its
// commit's outcome was unknown. A claim that decided without writing leaves its transaction
// nothing to commit, so the replay stands (D226): 2 MB at 300 kB/s.
func TestReplayOutlastingTheServersIdleTimeoutStands(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	direct, url := pgtest.NewPool(t, 2)
	big := strings.Repeat("y", 2<<20)
	job := func(lease time.Duration) dbidem.Job {
		return dbidem.Job{Principal: "alice", Key: "idle-" + lease.String(), Action: "a", Lease: lease}
	}
	if _, _, err := dbidem.Do(ctx, direct, job(0), dbidem.TxOptions{}, func(context.Context, pgx.Tx) (string, error) { return big, nil }); err != nil {
		t.Fatal(err)
	}
	if _, _, err := dbidem.DoLease(ctx, direct, job(30*time.Second), func(context.Context, dbidem.LeaseClaim) (string, error) { return big, nil }); err != nil {
		t.Fatal(err)
	}
	p := pgtest.NewProxy(t, pgtest.TCPAddr(t))
	p.Buffered.Store(true)
	p.Rate.Store(300 << 10)
	slow, err := pgxpool.New(ctx, pgtest.Via(t, url, p.Addr)+" idle_in_transaction_session_timeout=2000")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(slow.Close)
	for _, lease := range []time.Duration{0, 30 * time.Second} {
		t.Run("lease="+lease.String(), func(t *testing.T) {
			start := time.Now()
			var v string
			var replayed bool
			var err error
			if lease == 0 {
				v, replayed, err = dbidem.Do(ctx, slow, job(lease), dbidem.TxOptions{}, func(context.Context, pgx.Tx) (string, error) { return "", errors.New("ran again") })
			} else {
				v, replayed, err = dbidem.DoLease(ctx, slow, job(lease), func(context.Context, dbidem.LeaseClaim) (string, error) { return "", errors.New("ran again") })
			}
			took := time.Since(start)
			if err != nil || !replayed || v != big {
				t.Fatalf("replay after %s: %d bytes, replayed %v, %v", took, len(v), replayed, err)
			}
			if took < 6*time.Second {
				t.Fatalf("the link forwarded 2 MB in %s: the transaction never sat idle past its timeout", took)
			}
		})
	}
}

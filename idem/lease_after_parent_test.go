package idem_test

import (
	"context"
	"errors"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestLeaseLostAfterItsHeartbeatEnded: the heartbeat ends with the lease's context (the
// parent's end, LeaseOptions.Timeout) and extends no more. The lease then ran out and another
// attempt took the key over, while Lost and Stop still said "not lost" (an adversarial review
// of the Go API), and DoLease returned the error of a fn that went on past it, not
// ErrLeaseLost. Past End, with no Stop before it, the lease is lost now.
func TestLeaseLostAfterItsHeartbeatEnded(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	fp := idem.ComputeFingerprint("POST", "/x", nil)

	t.Run("KeepAlive", func(t *testing.T) {
		t.Parallel()
		c := idem.Claim{Principal: "p", Key: "parent-ended", Action: "a", Fingerprint: fp.Sum, Lease: time.Second}
		d, err := idem.Begin(ctx, pool, c)
		if err != nil || d.Outcome != idem.Claimed {
			t.Fatal(d.Outcome, err)
		}
		parent, cancel := context.WithCancel(ctx)
		l := idem.KeepAlive(parent, pool, "p", "parent-ended", d.Attempt, idem.LeaseOptions{Lease: time.Second, Start: d.Sent})
		if l.Lost() {
			t.Fatal("lost at once")
		}
		cancel() // the caller gives up; the work goes on (a call that does not take ctx)
		time.Sleep(1500 * time.Millisecond)
		d2, err := idem.Begin(ctx, pool, c)
		if err != nil || d2.Outcome != idem.Claimed {
			t.Fatalf("the other attempt: %v %v; want it to take the key over (the test's premise)", d2.Outcome, err)
		}
		if !l.Lost() || !l.Stop() {
			t.Fatalf("another attempt holds the key, and the first lease says Lost %v, Stop %v; want lost", l.Lost(), l.Stop())
		}
	})
	t.Run("Stop-before-the-end", func(t *testing.T) {
		t.Parallel()
		c := idem.Claim{Principal: "p", Key: "stopped-in-time", Action: "a", Fingerprint: fp.Sum, Lease: time.Second}
		d, err := idem.Begin(ctx, pool, c)
		if err != nil || d.Outcome != idem.Claimed {
			t.Fatal(d.Outcome, err)
		}
		parent, cancel := context.WithCancel(ctx)
		l := idem.KeepAlive(parent, pool, "p", "stopped-in-time", d.Attempt, idem.LeaseOptions{Lease: time.Second, Start: d.Sent})
		cancel()
		if l.Stop() {
			t.Fatal("stopped before the lease's end, and told lost")
		}
		time.Sleep(1200 * time.Millisecond)
		if l.Lost() {
			t.Fatal("stopped before the lease's end, and Lost says lost after it")
		}
	})
	t.Run("DoLease", func(t *testing.T) {
		t.Parallel()
		parent, cancel := context.WithCancel(ctx)
		mine := errors.New("fn's own failure, after the lease ran out")
		_, _, err := idem.DoLease(parent, pool, idem.Job{Principal: "p", Key: "dolease-parent-ended", Action: "a", Lease: time.Second},
			func(context.Context, idem.LeaseClaim) (string, error) {
				cancel()
				time.Sleep(1500 * time.Millisecond) // work that does not watch its context
				return "", mine
			})
		if !errors.Is(err, idem.ErrLeaseLost) {
			t.Fatalf("DoLease: %v; want ErrLeaseLost (the lease ran out while fn ran)", err)
		}
	})
}

// TestClaimAfterACommitSentAsSQLIsRefused: a claim in RunTx after the work ended the
// transaction with COMMIT as SQL sent its batch outside any transaction and came back with
// PostgreSQL's "SAVEPOINT can only be used in transaction blocks" (25P01), which no Is* helper
// matches. It is ErrTxOwned, as every other statement after such a COMMIT is.
func TestClaimAfterACommitSentAsSQLIsRefused(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	fp := idem.ComputeFingerprint("POST", "/x", nil)
	var claimErr error
	err := idem.RunTx(ctx, pool, idem.TxOptions{}, func(tx *idem.Tx) error {
		// Refused after it ran (ErrTxOwned): the work that ignores it goes on and claims.
		_, _ = tx.Exec(ctx, `COMMIT`)
		_, claimErr = tx.Claim(ctx, idem.Claim{Principal: "p", Key: "after-commit", Action: "a", Fingerprint: fp.Sum})
		return claimErr
	})
	if !errors.Is(claimErr, idem.ErrTxOwned) || !errors.Is(err, idem.ErrTxOwned) {
		t.Fatalf("a claim after COMMIT as SQL: %v (RunTx: %v); want ErrTxOwned", claimErr, err)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem.idempotency_keys`); n != 0 {
		t.Fatalf("%d keys stored", n)
	}
}

// TestReplayThatDoesNotDecodeSaysSo: a replay of Do whose stored result does not decode into
// this call's T (the type changed between deploys) returned encoding/json's bare error, which
// did not say it was the stored result; a step's says so. Do's does too now.
func TestReplayThatDoesNotDecodeSaysSo(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	job := idem.Job{Principal: "p", Key: "changed-type", Action: "a"}
	if _, _, err := idem.Do(ctx, pool, job, idem.TxOptions{}, func(context.Context, pgx.Tx) (string, error) { return "text", nil }); err != nil {
		t.Fatal(err)
	}
	_, replayed, err := idem.Do(ctx, pool, job, idem.TxOptions{}, func(context.Context, pgx.Tx) (int, error) { return 1, nil })
	if err == nil || !replayed || !strings.Contains(err.Error(), "stored result") {
		t.Fatalf("a replay into another type: replayed %v, %v; want an error that names the stored result", replayed, err)
	}
}

// TestCleanupRefusesABatchSizeOutOfRange: Cleanup and CleanupPaced took a negative batch size
// for the default and sent 2^31 to the database, which refused it with a raw encoding error;
// CleanerOptions refuses both. They are ErrInvalidArgument now, before any statement.
func TestCleanupRefusesABatchSizeOutOfRange(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 2)
	for _, n := range []int{-1, 1_000_001, 1 << 31} {
		if _, err := idem.Cleanup(ctx, pool, n); !errors.Is(err, idem.ErrInvalidArgument) {
			t.Errorf("Cleanup with a batch of %d: %v; want ErrInvalidArgument", n, err)
		}
		if _, err := idem.CleanupPaced(ctx, pool, n, 0.5); !errors.Is(err, idem.ErrInvalidArgument) {
			t.Errorf("CleanupPaced with a batch of %d: %v; want ErrInvalidArgument", n, err)
		}
	}
	if _, err := idem.Cleanup(ctx, pool, 0); err != nil {
		t.Errorf("Cleanup with the default batch: %v", err)
	}
}

// TestLeaseRouteAnswerAfterItsLeaseTimeoutIsRecorded: on a lease route, a handler that runs
// past its LeaseTimeout (which ends its context and the heartbeat) and past the lease's end,
// then answers a final 422, had its answer stored (fenced by the token; nobody took the key
// over). D241's first build counted that lease lost: the answer was thrown away, the claim
// given up and the client told 409, and every retry ran the handler again (a review of the
// change). The middleware records it as before.
func TestLeaseRouteAnswerAfterItsLeaseTimeoutIsRecorded(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 4)
	ctx := context.Background()
	m, err := idem.New(ctx, idem.Options{DB: pool,
		Principal: func(*http.Request) (string, bool) { return "alice", true },
		Logger:    slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	runs := new(atomic.Int32)
	mux := http.NewServeMux()
	mux.Handle("POST /pay", m.Route(idem.Route{Required: true, Lease: time.Second, LeaseTimeout: 200 * time.Millisecond})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		time.Sleep(1500 * time.Millisecond) // ignores its context
		w.WriteHeader(http.StatusUnprocessableEntity)
		_, _ = w.Write([]byte("declined"))
	})))
	srv := httptest.NewServer(mux)
	defer srv.Close()
	cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	st, _, got := pgtest.Send(t, cctx, "POST", srv.URL+"/pay", `{"a":1}`, "Idempotency-Key", "late-final", "Content-Type", "application/json")
	st2, h2, got2 := pgtest.Send(t, cctx, "POST", srv.URL+"/pay", `{"a":1}`, "Idempotency-Key", "late-final", "Content-Type", "application/json")
	if st != http.StatusUnprocessableEntity || st2 != http.StatusUnprocessableEntity || got2 != "declined" ||
		h2.Get("Idempotent-Replayed") != "true" || runs.Load() != 1 {
		t.Fatalf("first %d %q, retry %d %q (replayed %q), handler runs %d; want the 422 stored and replayed, one run",
			st, got, st2, got2, h2.Get("Idempotent-Replayed"), runs.Load())
	}
}

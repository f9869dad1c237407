package idemhttp_test

// A review of D166-D168's first build: each test failed then, and its comment tells what it
// showed; D168's second part fixed it (the test asserts the fixed behaviour).

import (
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"

	"github.com/gorilla/mux"
	idemhttp "github.com/pgidem/pgidem/internal/http"
	"github.com/pgidem/pgidem/internal/pgtest"

	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/internal/dbidem"
)

// TestStepAgainWhileCommitInFlightRunsFnOnce: a step's COMMIT is on its way (held by the
// network: it has not reached the server yet, and the step's transaction holds the key's row)
// when the step's context ends: Step returns ErrCommitUnknown, as RunTx does for a COMMIT whose
// context ended. Step's doc (D168) promises that calling it again "first reads whether it was
// [recorded]: the saved value if so, without running fn; fn again if not". The read
// (idem_recovery) takes no lock, so it sees the step as not recorded while its COMMIT is still
// in flight: fn runs again (an outside call in it repeats), then the first COMMIT lands and the
// second try ends with ErrStepRecorded, the very symptom D168 says it fixed.
func TestStepAgainWhileCommitInFlightRunsFnOnce(t *testing.T) {
	t.Parallel()
	const lease = 20 * time.Second // long: the lease stays alive all along
	z := newGapApp(t, lease, nil)
	hold := z.proxy.rule("commit\x00", gapHoldRequest)
	job := gapJob("step-inflight", lease)
	var runs atomic.Int32
	stepFn := func(ctx context.Context, tx pgx.Tx) (int, error) {
		runs.Add(1)
		var id int
		err := tx.QueryRow(ctx, `INSERT INTO gap_rows (key, step) VALUES ('step-inflight', 'a') RETURNING id`).Scan(&id)
		return id, err
	}
	var first, second error
	_, _, err := dbidem.DoLease(context.Background(), z.proxied, job, func(ctx context.Context, c dbidem.LeaseClaim) (int, error) {
		hold.arm(1)
		sctx, cancel := context.WithTimeout(ctx, time.Second)
		_, first = dbidem.Step(sctx, "a", stepFn)
		cancel()
		// The network gives the held COMMIT back while the step is asked for again.
		go func() { time.Sleep(500 * time.Millisecond); hold.free() }()
		v, err := dbidem.Step(ctx, "a", stepFn)
		second = err
		return v, err
	})
	hold.free()
	rows := z.count(`SELECT count(*) FROM gap_rows WHERE key = 'step-inflight'`)
	t.Logf("first Step: %v; Step again: %v; DoLease: %v; step fn runs %d, rows %d", first, second, err, runs.Load(), rows)
	if !errors.Is(first, dbidem.ErrCommitUnknown) {
		t.Fatalf("the first Step did not end with ErrCommitUnknown (%v): the scenario did not happen", first)
	}
	if runs.Load() != 1 || second != nil {
		t.Fatalf("Step called again after ErrCommitUnknown while the COMMIT was still in flight: fn ran %d times, "+
			"the second call returned %v; want fn run once and the saved value (the re-read must wait for the "+
			"abandoned COMMIT's outcome, e.g. take the key's row lock, instead of reading past it)", runs.Load(), second)
	}
}

// TestStepAgainWhileCommitHeldPastLockTimeout: as above, but the step's COMMIT stays on its
// way longer than idem_extend's lock timeout (2 s, the SQL API's default). Step called again
// cannot learn the outcome in time (its re-read waits on the key's row, which the step's
// transaction holds): it returns
// ErrCommitUnknown again and does not run fn (D168). Called once more after the COMMIT has
// landed, it returns the saved value: fn ran once, one row.
func TestStepAgainWhileCommitHeldPastLockTimeout(t *testing.T) {
	t.Parallel()
	const lease = 20 * time.Second
	z := newGapApp(t, lease, nil)
	hold := z.proxy.rule("commit\x00", gapHoldRequest)
	job := gapJob("step-held", lease)
	stepFn := z.gapStepFn("step-held", "a")
	var first, second, third error
	var secondTook time.Duration
	var got int
	_, _, err := dbidem.DoLease(context.Background(), z.proxied, job, func(ctx context.Context, c dbidem.LeaseClaim) (int, error) {
		hold.arm(1)
		sctx, cancel := context.WithTimeout(ctx, time.Second)
		_, first = dbidem.Step(sctx, "a", stepFn)
		cancel()
		start := time.Now()
		_, second = dbidem.Step(ctx, "a", stepFn)
		secondTook = time.Since(start)
		hold.free()
		// The COMMIT lands now; the next call reads it.
		for range 50 {
			got, third = dbidem.Step(ctx, "a", stepFn)
			if !errors.Is(third, dbidem.ErrCommitUnknown) {
				break
			}
			time.Sleep(100 * time.Millisecond)
		}
		return got, third
	})
	hold.free()
	rows := z.count(`SELECT count(*) FROM gap_rows WHERE key = 'step-held'`)
	t.Logf("first Step: %v; again while held: %v after %s; after the COMMIT landed: %d, %v; DoLease: %v; fn runs %d, rows %d",
		first, second, secondTook.Round(time.Millisecond), got, third, err, z.steps.Load(), rows)
	if !errors.Is(first, dbidem.ErrCommitUnknown) {
		t.Fatalf("the first Step did not end with ErrCommitUnknown (%v): the scenario did not happen", first)
	}
	if !errors.Is(second, dbidem.ErrCommitUnknown) {
		t.Errorf("Step again while the COMMIT is held past the lock timeout: %v, want ErrCommitUnknown", second)
	}
	if secondTook > 5*time.Second {
		t.Errorf("Step again took %s, want it bounded by about idem_extend's lock timeout (2 s)", secondTook)
	}
	if third != nil || err != nil || z.steps.Load() != 1 || rows != 1 {
		t.Errorf("after the COMMIT landed: Step %v, DoLease %v, fn runs %d, rows %d; want the saved value, fn run once, one row",
			third, err, z.steps.Load(), rows)
	}
}

// TestDoLeaseClaimCommitInFlightIsGivenUp: DoLease's context ends while its fresh lease
// claim's COMMIT is on its way (not yet at the server). DoLease returns ErrCommitUnknown and,
// since D168, gives the claim up with idem_yield: but the claim's row is an uncommitted INSERT,
// which idem_yield's UPDATE does not see (no wait, no error: "not given up", taken as "the
// COMMIT did not land"). The COMMIT then lands (within the 5 s idle timeout), and the next
// DoLease of the job gets ErrInProgress for the whole lease: the stall D168 meant to remove.
func TestDoLeaseClaimCommitInFlightIsGivenUp(t *testing.T) {
	t.Parallel()
	const lease = 10 * time.Second
	z := newGapApp(t, lease, nil)
	hold := z.proxy.rule("commit\x00", gapHoldRequest)
	hold.arm(1)
	job := dbidem.Job{Principal: "alice", Key: "do-commit-inflight", Action: "ship", Input: 1, Lease: lease, LockTimeout: time.Second}
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		select {
		case <-hold.hit:
		case <-time.After(15 * time.Second):
		}
		time.Sleep(100 * time.Millisecond)
		cancel()
	}()
	runs := 0
	_, _, err := dbidem.DoLease(ctx, z.proxied, job, func(ctx context.Context, c dbidem.LeaseClaim) (int, error) {
		runs++
		return 1, nil
	})
	// The held COMMIT goes on now (the network recovers), well within the claim's idle timeout.
	hold.free()
	time.Sleep(500 * time.Millisecond)
	inProgress := z.count(`SELECT count(*) FROM idem.idempotency_keys WHERE key = 'do-commit-inflight' AND state = 'p'
		AND lease_expires_at > clock_timestamp()`)
	start := time.Now()
	_, _, err2 := dbidem.DoLease(context.Background(), z.proxied, job, func(ctx context.Context, c dbidem.LeaseClaim) (int, error) {
		runs++
		return 2, nil
	})
	t.Logf("first DoLease: %v; key in progress with a live lease after it: %d; next DoLease: %v after %s; runs %d",
		err, inProgress, err2, time.Since(start).Round(time.Millisecond), runs)
	if !errors.Is(err, dbidem.ErrCommitUnknown) {
		t.Fatalf("the first DoLease did not end with ErrCommitUnknown (%v): the scenario did not happen", err)
	}
	if err2 != nil {
		t.Fatalf("the next DoLease after a claim whose COMMIT was in flight when DoLease gave it up: %v; want fn run at once "+
			"(the give-up must wait for the abandoned COMMIT's outcome; idem_yield does not see an uncommitted fresh claim)", err2)
	}
}

// TestLeaseAnswerWithNulResourceIDConverges: a lease route's handler answers a one-time
// secret whose top-level "id" (the resource id stored in its place, topLevelID) holds U+0000,
// say an id the client chose. PostgreSQL refuses the text (22021), which D166 maps to
// ErrInvalidArgument, "final": Persist stops at once. But the lease route answers 503
// outcome_unknown ("retry with the same key after Retry-After") and leaves the claim in
// progress: each retry waits the lease out, takes the key over and runs the work again, and
// fails the same way, forever. The transactional route answers such a refusal 500
// idempotency_misconfigured; the lease route should too (and give the claim up), or the
// resource id should be made storable (U+0000 replaced, as defaultAction does).
func TestLeaseAnswerWithNulResourceIDConverges(t *testing.T) {
	t.Parallel()
	const lease = time.Second
	direct, _ := pgtest.NewPool(t, 10)
	m, err := idemhttp.New(idemhttp.Options{DB: direct, Principal: func(r *http.Request) (string, bool) { return "alice", true },
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)), RouteTemplate: muxTemplate})
	if err != nil {
		t.Fatal(err)
	}
	var runs atomic.Int32
	r := mux.NewRouter()
	r.Handle("/secret", m.Route(idemhttp.Route{Lease: lease, Required: true})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		idemhttp.MarkOneTimeSecret(r.Context())
		w.WriteHeader(http.StatusCreated)
		fmt.Fprint(w, `{"id":"k\u0000ey","secret":"s3cr3t"}`)
	}))).Methods("POST")
	srv := httptest.NewServer(r)
	defer srv.Close()
	var statuses []int
	for i := 0; i < 3; i++ {
		status, _, body := pgtest.Send(t, context.Background(), "POST", srv.URL+"/secret", `{}`, "Idempotency-Key", "nul-id", "Content-Type", "application/json")
		statuses = append(statuses, status)
		t.Logf("try %d: %d %s", i, status, body)
		time.Sleep(lease + 200*time.Millisecond)
	}
	t.Logf("statuses %v, runs %d", statuses, runs.Load())
	if runs.Load() != 1 || statuses[0] != http.StatusCreated || statuses[1] != http.StatusConflict || statuses[2] != http.StatusConflict {
		t.Fatalf("a lease answer whose resource id PostgreSQL cannot hold: statuses %v, the work ran %d times; want it run once "+
			"and a final answer (500 idempotency_misconfigured, or the answer stored with the id made storable), not 503 outcome_unknown "+
			"and a rerun after every lease", statuses, runs.Load())
	}
}

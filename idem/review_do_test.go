package idem_test

// A review of Do, DoLease, Step and idemriver against their go doc (D170). The tests whose
// comment says "was" failed then; each asserts the fixed behaviour.

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// reviewPool is a pool of its own on url (a separate "process": its own Gate is passed by the
// caller).
func reviewPool(t *testing.T, url string, n int32) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = n
	p, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	return p
}

// reviewClaim is the claim DoLease makes for job (same fingerprint), for a worker by hand.
func reviewClaim(job idem.Job) idem.Claim {
	var in []byte
	if job.Input != nil {
		in, _ = json.Marshal(job.Input)
	}
	fp := idem.ComputeFingerprint("DO", job.Action, in)
	return idem.Claim{Principal: job.Principal, Key: job.Key, Action: job.Action, Fingerprint: fp.Sum,
		Fields: fp.Fields, TTL: job.TTL, Lease: job.Lease}
}

// TestReviewDoHostileInputsAreInvalidArgument: "ErrInvalidArgument: the functions refused an
// argument ..., or PostgreSQL a text argument it cannot hold ...: a caller or configuration
// error, not a reason to retry." Every refused argument of Do and DoLease must be
// ErrInvalidArgument (a caller that retries the others would retry forever), and fn must not
// run. A lease under a second was a plain error (idemriver let River retry the job for weeks),
// and a negative LockTimeout was taken as the default.
func TestReviewDoHostileInputsAreInvalidArgument(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	base := idem.Job{Principal: "alice", Key: "k", Action: "pay", Input: map[string]int{"a": 1}, Lease: 2 * time.Second}
	cases := []struct {
		name string
		edit func(*idem.Job)
	}{
		{"empty key", func(j *idem.Job) { j.Key = "" }},
		{"key of 256", func(j *idem.Job) { j.Key = strings.Repeat("k", 256) }},
		{"key of 1 MB", func(j *idem.Job) { j.Key = strings.Repeat("k", 1<<20) }},
		{"key with NUL", func(j *idem.Job) { j.Key = "a\x00b" }},
		{"key with space", func(j *idem.Job) { j.Key = "a b" }},
		{"key not UTF-8", func(j *idem.Job) { j.Key = "a\xffb" }},
		{"empty principal", func(j *idem.Job) { j.Principal = "" }},
		{"principal with NUL", func(j *idem.Job) { j.Principal = "a\x00" }},
		{"principal not UTF-8", func(j *idem.Job) { j.Principal = "a\xff" }},
		{"principal of 256", func(j *idem.Job) { j.Principal = strings.Repeat("p", 256) }},
		{"empty action", func(j *idem.Job) { j.Action = "" }},
		{"action of 1001", func(j *idem.Job) { j.Action = strings.Repeat("a", 1001) }},
		{"action with NUL", func(j *idem.Job) { j.Action = "a\x00" }},
		{"negative TTL", func(j *idem.Job) { j.TTL = -time.Second }},
		{"TTL over 10 years", func(j *idem.Job) { j.TTL = idem.MaxDuration + time.Hour }},
		{"negative lock timeout", func(j *idem.Job) { j.LockTimeout = -time.Second }},
		{"lease over 10 years", func(j *idem.Job) { j.Lease = idem.MaxDuration + time.Hour }},
		{"lease under a second", func(j *idem.Job) { j.Lease = 500 * time.Millisecond }},
		{"zero lease", func(j *idem.Job) { j.Lease = 0 }},
	}
	for _, c := range cases {
		job := base
		c.edit(&job)
		var ran atomic.Int32
		cctx, cancel := context.WithTimeout(ctx, 20*time.Second)
		_, _, errL := idem.DoLease(cctx, pool, job, func(context.Context, idem.LeaseClaim) (int, error) { ran.Add(1); return 1, nil })
		var errD error
		if c.name != "lease over 10 years" && c.name != "lease under a second" && c.name != "zero lease" {
			_, _, errD = idem.Do(cctx, pool, job, idem.TxOptions{}, func(context.Context, pgx.Tx) (int, error) { ran.Add(1); return 1, nil })
		} else {
			errD = idem.ErrInvalidArgument
		}
		cancel()
		if !errors.Is(errL, idem.ErrInvalidArgument) || !errors.Is(errD, idem.ErrInvalidArgument) || ran.Load() != 0 {
			t.Errorf("%s: DoLease %v; Do %v; fn ran %d; want ErrInvalidArgument from both, fn not run", c.name, errL, errD, ran.Load())
		}
	}
}

// TestReviewDoDeadWorkerTakeoverKeepsProviderKeyAndSteps: a worker claims (DoLease's claim, by
// hand), records a step and dies. After its lease runs out, DoLease of the same job takes over
// "with the same claim.ProviderKey", its RecoveryPoint is the step, and Step skips it. After a
// release, the next run is a new generation: a new provider key and no steps.
func TestReviewDoDeadWorkerTakeoverKeepsProviderKeyAndSteps(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 6)
	pgtest.Exec(t, pool, `CREATE TABLE review_rows (name text)`)
	job := idem.Job{Principal: "alice", Key: "dead-1", Action: "payout", Input: map[string]any{"amount": 7}, Lease: time.Second}
	var dead idem.Decision
	if err := idem.RunTx(ctx, pool, idem.TxOptions{}, func(tx *idem.Tx) error {
		var err error
		dead, err = tx.Claim(ctx, reviewClaim(job))
		return err
	}); err != nil || dead.Outcome != idem.Claimed {
		t.Fatalf("the dead worker's claim: %v %+v", err, dead)
	}
	if err := idem.RunTx(ctx, pool, idem.TxOptions{}, func(tx *idem.Tx) error {
		if _, err := tx.Exec(ctx, `INSERT INTO review_rows VALUES ('first')`); err != nil {
			return err
		}
		return idem.RecordStep(ctx, tx, job.Principal, job.Key, dead.Attempt, "first", json.RawMessage(`41`))
	}); err != nil {
		t.Fatal(err)
	}
	// the worker dies here
	time.Sleep(1500 * time.Millisecond)
	var firstRuns atomic.Int32
	got, replayed, err := idem.DoLease(ctx, pool, job, func(ctx context.Context, c idem.LeaseClaim) (string, error) {
		if c.ProviderKey != dead.ProviderKey {
			t.Errorf("takeover's provider key %s, dead worker's %s: want the same", c.ProviderKey, dead.ProviderKey)
		}
		if c.RecoveryPoint != "first" {
			t.Errorf("takeover's recovery point %q, want first", c.RecoveryPoint)
		}
		v, err := idem.Step(ctx, "first", func(ctx context.Context, tx pgx.Tx) (int, error) {
			firstRuns.Add(1)
			_, err := tx.Exec(ctx, `INSERT INTO review_rows VALUES ('first')`)
			return 99, err
		})
		if err != nil || v != 41 {
			t.Errorf("Step first after the takeover: %v %v, want 41 saved by the dead worker", v, err)
		}
		return c.ProviderKey, nil
	})
	if err != nil || replayed || got != dead.ProviderKey || firstRuns.Load() != 0 {
		t.Fatalf("takeover: %q %v %v (step ran %d)", got, replayed, err, firstRuns.Load())
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM review_rows`); n != 1 {
		t.Fatalf("%d rows, want 1", n)
	}
}

// TestReviewDoTwoProcessesOneKey: two processes (pools, gates of their own) run DoLease and Do with
// one key at once, released by a barrier: fn runs once per key, every call ends with the
// result or ErrInProgress, and a later call replays.
func TestReviewDoTwoProcessesOneKey(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, url := pgtest.NewPool(t, 2)
	admin := reviewPool(t, url, 2)
	pgtest.Exec(t, admin, `CREATE TABLE review_effects (k text)`)
	const procs = 4
	pools := make([]*pgxpool.Pool, procs)
	gates := make([]*idem.Gate, procs)
	for i := range pools {
		pools[i] = reviewPool(t, url, 4)
		gates[i] = idem.NewGate(idem.GateOptions{})
	}
	for round := 0; round < 5; round++ {
		var leaseRuns, txRuns atomic.Int32
		start := make(chan struct{})
		var wg sync.WaitGroup
		errs := make(chan error, 4*procs)
		for i := 0; i < procs; i++ {
			for j := 0; j < 2; j++ {
				wg.Add(2)
				go func(i int) {
					defer wg.Done()
					<-start
					job := idem.Job{Principal: "alice", Key: "both-l-" + string(rune('a'+round)), Action: "a", Lease: 2 * time.Second, Gate: gates[i]}
					_, _, err := idem.DoLease(ctx, pools[i], job, func(ctx context.Context, c idem.LeaseClaim) (int, error) {
						leaseRuns.Add(1)
						_, err := idem.Step(ctx, "w", func(ctx context.Context, tx pgx.Tx) (bool, error) {
							_, err := tx.Exec(ctx, `INSERT INTO review_effects VALUES ($1)`, job.Key)
							return true, err
						})
						time.Sleep(20 * time.Millisecond)
						return 1, err
					})
					if err != nil && !errors.Is(err, idem.ErrInProgress) {
						errs <- err
					}
				}(i)
				go func(i int) {
					defer wg.Done()
					<-start
					job := idem.Job{Principal: "alice", Key: "both-t-" + string(rune('a'+round)), Action: "a", Gate: gates[i]}
					_, _, err := idem.Do(ctx, pools[i], job, idem.TxOptions{}, func(ctx context.Context, tx pgx.Tx) (int, error) {
						txRuns.Add(1)
						_, err := tx.Exec(ctx, `INSERT INTO review_effects VALUES ($1)`, job.Key)
						return 1, err
					})
					if err != nil && !errors.Is(err, idem.ErrInProgress) {
						errs <- err
					}
				}(i)
			}
		}
		close(start)
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Errorf("round %d: %v", round, err)
		}
		if leaseRuns.Load() != 1 || txRuns.Load() != 1 {
			t.Errorf("round %d: DoLease fn ran %d, Do fn ran %d; want 1 each", round, leaseRuns.Load(), txRuns.Load())
		}
	}
	if n := pgtest.Count(t, admin, `SELECT count(*) FROM review_effects`); n != 10 {
		t.Fatalf("%d effects, want 10", n)
	}
}

// TestReviewDoStepBackendTerminated: the step's backend is terminated while fn runs (a crash of the
// database session). Step fails, fn fails, DoLease yields; the next DoLease runs the step
// once, under the same provider key: one row.
func TestReviewDoStepBackendTerminated(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, url := pgtest.NewPool(t, 6)
	admin := reviewPool(t, url, 2)
	pgtest.Exec(t, admin, `CREATE TABLE review_rows (name text)`)
	job := idem.Job{Principal: "alice", Key: "term-1", Action: "a", Lease: 2 * time.Second}
	var pks []string
	kill := true
	for i := 0; i < 2; i++ {
		_, _, err := idem.DoLease(ctx, pool, job, func(ctx context.Context, c idem.LeaseClaim) (int, error) {
			pks = append(pks, c.ProviderKey)
			return idem.Step(ctx, "s", func(ctx context.Context, tx pgx.Tx) (int, error) {
				if _, err := tx.Exec(ctx, `INSERT INTO review_rows VALUES ('s')`); err != nil {
					return 0, err
				}
				if kill {
					kill = false
					var pid uint32
					if err := tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
						return 0, err
					}
					if _, err := admin.Exec(ctx, `SELECT pg_terminate_backend($1)`, pid); err != nil {
						return 0, err
					}
					time.Sleep(100 * time.Millisecond)
				}
				return 5, nil
			})
		})
		if i == 0 && err == nil {
			t.Fatalf("the first run succeeded although its step's session was terminated")
		}
		if i == 1 && err != nil {
			t.Fatalf("the second run: %v", err)
		}
	}
	if n := pgtest.Count(t, admin, `SELECT count(*) FROM review_rows`); n != 1 || pks[0] != pks[1] {
		t.Fatalf("%d rows (want 1), provider keys %v (want the same)", n, pks)
	}
}

// TestReviewDoStaleHolderRecordsNothing: a holder whose extensions are held up (the key's row locked
// by another session) loses its lease while its fn goes on; another process takes the key
// over. The stale holder's Step must fail with ErrLeaseLost and write nothing, and its result
// must not be recorded; the new holder keeps the provider key and its result is the answer.
// Also the operators' view names the generation's provider key during the takeover.
func TestReviewDoStaleHolderRecordsNothing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, url := pgtest.NewPool(t, 2)
	admin := reviewPool(t, url, 3)
	pgtest.Exec(t, admin, `CREATE TABLE review_rows (who text, name text)`)
	poolA, poolB := reviewPool(t, url, 4), reviewPool(t, url, 4)
	job := idem.Job{Principal: "alice", Key: "stale-1", Action: "a", Lease: time.Second, LockTimeout: 5 * time.Second}
	jobA, jobB := job, job
	jobA.Gate, jobB.Gate = idem.NewGate(idem.GateOptions{}), idem.NewGate(idem.GateOptions{})

	aStarted, bTook, aDone := make(chan idem.LeaseClaim, 1), make(chan idem.LeaseClaim, 1), make(chan struct{})
	var aStepErr, aCause error
	var aRes int
	var aErr error
	go func() {
		defer close(aDone)
		aRes, _, aErr = idem.DoLease(ctx, poolA, jobA, func(ctx context.Context, c idem.LeaseClaim) (int, error) {
			aStarted <- c
			<-ctx.Done()
			aCause = context.Cause(ctx)
			<-bTook // a hung worker: goes on after the takeover
			_, aStepErr = idem.Step(ctx, "late", func(ctx context.Context, tx pgx.Tx) (bool, error) {
				_, err := tx.Exec(context.WithoutCancel(ctx), `INSERT INTO review_rows VALUES ('a', 'late')`)
				return true, err
			})
			return 1, nil
		})
	}()
	ca := <-aStarted
	// Hold the key's row: A's extensions wait, its lease runs out.
	lock, err := admin.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := lock.Exec(ctx, `SELECT 1 FROM idem.idempotency_keys WHERE principal_id = 'alice' AND key = 'stale-1' FOR UPDATE`); err != nil {
		t.Fatal(err)
	}
	time.Sleep(3500 * time.Millisecond)
	_ = lock.Rollback(ctx)
	// B takes over once the lease has run out in the database.
	var bRes int
	deadline := time.Now().Add(30 * time.Second)
	for {
		var bErr error
		bRes, _, bErr = idem.DoLease(ctx, poolB, jobB, func(ctx context.Context, c idem.LeaseClaim) (int, error) {
			stuck, err := idem.ReadStuck(ctx, admin, 0, 10)
			if err != nil || len(stuck) != 1 || stuck[0].ProviderKey != c.ProviderKey || stuck[0].Attempt != c.Attempt {
				t.Errorf("ReadStuck during the takeover: %+v %v; claim %+v", stuck, err, c)
			}
			bTook <- c
			<-aDone
			_, err = idem.Step(ctx, "late", func(ctx context.Context, tx pgx.Tx) (bool, error) {
				_, err := tx.Exec(ctx, `INSERT INTO review_rows VALUES ('b', 'late')`)
				return true, err
			})
			return 2, err
		})
		if bErr == nil {
			break
		}
		if !errors.Is(bErr, idem.ErrInProgress) || time.Now().After(deadline) {
			close(bTook)
			t.Fatalf("B: %v", bErr)
		}
		time.Sleep(200 * time.Millisecond)
	}
	<-aDone
	cb := ca
	if !errors.Is(aCause, idem.ErrLeaseLost) {
		t.Errorf("A's context cause %v, want ErrLeaseLost", aCause)
	}
	// Lost by A's clock (its extensions waited on the row): ErrLeaseLost alone, as Step's doc
	// says; A asked the database nothing.
	if !errors.Is(aStepErr, idem.ErrLeaseLost) || errors.Is(aStepErr, idem.ErrClaimLost) {
		t.Errorf("A's late Step: %v, want ErrLeaseLost without ErrClaimLost (lost by its clock)", aStepErr)
	}
	if !errors.Is(aErr, idem.ErrLeaseLost) {
		t.Errorf("A's DoLease: %d %v, want ErrLeaseLost", aRes, aErr)
	}
	if bRes != 2 {
		t.Errorf("B's result %d", bRes)
	}
	if n := pgtest.Count(t, admin, `SELECT count(*) FROM review_rows WHERE who = 'a'`); n != 0 {
		t.Errorf("the stale holder wrote %d rows", n)
	}
	v, replayed, err := idem.DoLease(ctx, poolA, jobA, func(context.Context, idem.LeaseClaim) (int, error) { return 3, nil })
	if err != nil || !replayed || v != 2 {
		t.Errorf("replay: %d %v %v, want B's 2", v, replayed, err)
	}
	_ = cb
}

// TestReviewDoInputsThatJSONCannotHoldAreNotOneRequest: "Another Input under the key is
// ErrMismatch". encoding/json writes every invalid UTF-8 byte of a string as U+FFFD, so two
// different inputs (a binary reference held in a string, say) fingerprinted alike, and the
// second Do replayed the first's result for another input instead of ErrMismatch. Such an
// input is ErrInvalidArgument now, before fn runs; a valid U+FFFD is an input like any other.
func TestReviewDoInputsThatJSONCannotHoldAreNotOneRequest(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	runs := 0
	do := func(ref string) (string, bool, error) {
		job := idem.Job{Principal: "alice", Key: "utf8-1", Action: "a", Input: map[string]string{"ref": ref}}
		return idem.Do(ctx, pool, job, idem.TxOptions{}, func(context.Context, pgx.Tx) (string, error) {
			runs++
			return "done for " + ref, nil
		})
	}
	for _, ref := range []string{"ref-\xfe", "ref-\xff"} {
		if got, replayed, err := do(ref); !errors.Is(err, idem.ErrInvalidArgument) || runs != 0 {
			t.Fatalf("an input %q: %q replayed=%v err=%v (fn ran %d); want ErrInvalidArgument, fn not run", ref, got, replayed, err, runs)
		}
	}
	if _, _, err := do("ref-\ufffd"); err != nil || runs != 1 {
		t.Fatalf("an input with a valid U+FFFD: %v (fn ran %d)", err, runs)
	}
	if _, _, err := do(`ref-\ufffd`); !errors.Is(err, idem.ErrMismatch) || runs != 1 {
		t.Fatalf("another input (a backslash, then ufffd) under the key: %v (fn ran %d), want ErrMismatch", err, runs)
	}
}

package dbidem_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgidem/pgidem/internal/dbidem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestExtendIsFenced: only the current holder extends; an extension never shortens the lease
// or the key's life; a stale token gets ErrClaimLost and changes nothing.
func TestExtendIsFenced(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 4)
	ctx := context.Background()
	c := claim("lease", `{"job":1}`)
	c.Lease = time.Minute
	d, err := dbidem.Begin(ctx, pool, c)
	if err != nil || d.Outcome != dbidem.Claimed {
		t.Fatalf("claim: %+v %v", d, err)
	}
	end, err := dbidem.Extend(ctx, pool, c.Principal, c.Key, d.Attempt, 10*time.Minute)
	if err != nil || time.Until(end) < 9*time.Minute {
		t.Fatalf("extend: %v %v", end, err)
	}
	var lease, expires time.Time
	read := func() {
		t.Helper()
		if err := pool.QueryRow(ctx, `SELECT lease_expires_at, expires_at FROM idem.idempotency_keys WHERE key = 'lease'`).Scan(&lease, &expires); err != nil {
			t.Fatal(err)
		}
	}
	read()
	l0, e0 := lease, expires
	if again, err := dbidem.Extend(ctx, pool, c.Principal, c.Key, d.Attempt, time.Second); err != nil || !again.Equal(l0) {
		t.Fatalf("a shorter extension: %v %v, want the lease unchanged at %v", again, err, l0)
	}
	read()
	if !lease.Equal(l0) || !expires.Equal(e0) {
		t.Fatalf("a shorter extension moved the lease %v -> %v or the key %v -> %v", l0, lease, e0, expires)
	}
	pgtest.Exec(t, pool, `UPDATE idem.idempotency_keys SET lease_expires_at = now() - interval '1 s' WHERE key = 'lease'`)
	taken, err := dbidem.Begin(ctx, pool, c)
	if err != nil || taken.Outcome != dbidem.Claimed {
		t.Fatalf("takeover: %+v %v", taken, err)
	}
	read()
	l1 := lease
	if _, err := dbidem.Extend(ctx, pool, c.Principal, c.Key, d.Attempt, time.Hour); !errors.Is(err, dbidem.ErrClaimLost) {
		t.Fatalf("a stale token extends: %v, want ErrClaimLost", err)
	}
	read()
	if !lease.Equal(l1) {
		t.Fatal("a stale token moved the lease")
	}
}

// TestDoLease: a job that takes three times its lease, with duplicates all along: the
// duplicates get ErrInProgress, the job runs once, its result is stored and replayed; its
// provider key is the same for every attempt. A job whose lease is taken over meanwhile
// learns it (its context's cause is ErrLeaseLost) and nothing of it is stored.
func TestDoLease(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 8)
	ctx := context.Background()
	job := dbidem.Job{Principal: "p", Key: "job-1", Action: "payout", Input: map[string]int{"amount": 5}, Lease: time.Second,
		LockTimeout: 100 * time.Millisecond}
	var runs atomic.Int32
	var finished atomic.Bool // the work has returned its result (its completion may follow)
	var keys sync.Map
	work := func(ctx context.Context, c dbidem.LeaseClaim) (int, error) {
		runs.Add(1)
		keys.Store(c.ProviderKey, true)
		select {
		case <-time.After(3 * time.Second):
			finished.Store(true)
			return 42, nil
		case <-ctx.Done():
			return 0, context.Cause(ctx)
		}
	}
	done := make(chan error, 1)
	go func() {
		n, replayed, err := dbidem.DoLease(ctx, pool, job, work)
		if err == nil && (n != 42 || replayed) {
			err = errors.New("wrong result")
		}
		done <- err
	}()
	for runs.Load() == 0 {
		time.Sleep(5 * time.Millisecond)
	}
	dups := 0
	for busy := true; busy; {
		select {
		case err := <-done:
			if err != nil {
				t.Fatal(err)
			}
			busy = false
		case <-time.After(400 * time.Millisecond):
			dups++
			// A duplicate that races the job's end may already get its answer.
			n, replayed, err := dbidem.DoLease(ctx, pool, job, work)
			if errors.Is(err, dbidem.ErrInProgress) || (err == nil && n == 42 && replayed && finished.Load()) {
				continue
			}
			t.Fatalf("a duplicate while the job runs: %d, replayed %v, %v; want ErrInProgress (or, once the work returned, its replay)", n, replayed, err)
		}
	}
	n, replayed, err := dbidem.DoLease(ctx, pool, job, work)
	if err != nil || n != 42 || !replayed || runs.Load() != 1 || dups < 5 {
		t.Fatalf("after the job: %d, replayed %v, %v; %d runs, %d duplicates", n, replayed, err, runs.Load(), dups)
	}

	// A takeover while the job runs (the token changes under it): the job is told, nothing stored.
	lost := job
	lost.Key = "job-2"
	causes := make(chan error, 1)
	go func() {
		_, _, err := dbidem.DoLease(ctx, pool, lost, func(ctx context.Context, c dbidem.LeaseClaim) (int, error) {
			keys.Store(c.ProviderKey, true)
			<-ctx.Done()
			causes <- context.Cause(ctx)
			return 0, ctx.Err()
		})
		done <- err
	}()
	pgtest.WaitFor(t, pool, `SELECT count(*) FROM idem.idempotency_keys WHERE key = 'job-2'`)
	pgtest.Exec(t, pool, `UPDATE idem.idempotency_keys SET attempt = nextval('idem.attempt_seq') WHERE key = 'job-2'`)
	if cause := <-causes; !errors.Is(cause, dbidem.ErrLeaseLost) {
		t.Fatalf("the job's context ended with %v, want ErrLeaseLost", cause)
	}
	if err := <-done; !errors.Is(err, dbidem.ErrLeaseLost) {
		t.Fatalf("DoLease returned %v, want ErrLeaseLost", err)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem.idempotency_keys WHERE key = 'job-2' AND state = 'c'`); n != 0 {
		t.Fatal("the lost job's result was stored")
	}
	distinct := 0
	keys.Range(func(any, any) bool { distinct++; return true })
	_, ok1 := keys.Load(dbidem.ProviderKey("p", "job-1"))
	_, ok2 := keys.Load(dbidem.ProviderKey("p", "job-2"))
	if distinct != 2 || !ok1 || !ok2 {
		t.Fatalf("%d provider keys for two jobs, want each job's own", distinct)
	}
}

package dbidem_test

import (
	"context"
	"errors"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/internal/canon"
	"github.com/pgidem/pgidem/internal/dbidem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestFinalAnswerKeepsTheClaim: a final error rolls the work back to the savepoint and is
// stored in the claiming transaction; a duplicate that waits on the key's row meanwhile
// (a real row lock, not a sleep) gets the stored answer, never the free key.
func TestFinalAnswerKeepsTheClaim(t *testing.T) {
	t.Parallel()
	pool, url := pgtest.NewPool(t, 4)
	ctx := context.Background()
	pgtest.Exec(t, pool, `CREATE TABLE effects (n int)`)
	c := claim("final", `{"amount":5}`)
	final := dbidem.Response{Status: 422, Header: http.Header{"Content-Type": {"application/problem+json"}},
		Body: []byte(`{"code":"insufficient_funds"}`)}

	claimed, release := make(chan struct{}), make(chan struct{})
	t.Cleanup(func() {
		select {
		case <-release:
		default:
			close(release)
		}
	})
	done := make(chan error, 1)
	go func() {
		done <- dbidem.RunTx(ctx, pool, dbidem.TxOptions{}, func(tx *dbidem.Tx) error {
			d, err := tx.Claim(ctx, c)
			if err != nil {
				return err
			}
			if _, err := tx.Exec(ctx, `INSERT INTO effects VALUES (1)`); err != nil {
				return err
			}
			close(claimed)
			<-release
			if d.Outcome == dbidem.Claimed {
				tx.FinalOnCommit(final)
			}
			return nil
		})
	}()
	<-claimed

	dup, pid := singleConnPool(t, url)
	type answer struct {
		d   dbidem.Decision
		err error
	}
	got := make(chan answer, 1)
	go func() {
		var a answer
		a.err = dbidem.RunTx(ctx, dup, dbidem.TxOptions{}, func(tx *dbidem.Tx) error {
			var err error
			a.d, err = tx.Claim(ctx, c)
			return err
		})
		got <- a
	}()
	pgtest.WaitUntilBlocked(t, pool, pid)
	close(release)
	if err := <-done; err != nil {
		t.Fatalf("the claimer: %v", err)
	}
	a := <-got
	if a.err != nil || a.d.Outcome != dbidem.Replay || a.d.Response.Status != 422 || string(a.d.Response.Body) != string(final.Body) {
		t.Fatalf("the duplicate: %+v %v, want the stored 422", a.d, a.err)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM effects`); n != 0 {
		t.Fatalf("%d effects survived the final error", n)
	}
}

// singleConnPool is a pool of one connection to url, and that connection's backend pid.
func singleConnPool(t *testing.T, url string) (*pgxpool.Pool, uint32) {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 1
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	conn, err := pool.Acquire(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	pid := conn.Conn().PgConn().PID()
	conn.Release()
	return pool, pid
}

// TestFencingTokensAreNeverReused: a lease holder whose key expired, was cleaned up and
// claimed again cannot complete the new claim; nor can a holder whose lease was taken over.
func TestFencingTokensAreNeverReused(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 4)
	ctx := context.Background()
	lease := claim("job", `{"n":1}`)
	lease.Lease = time.Minute
	first, err := dbidem.Begin(ctx, pool, lease)
	if err != nil || first.Outcome != dbidem.Claimed {
		t.Fatalf("lease: %+v %v", first, err)
	}
	// The key and its lease run out; cleanup deletes the row; a new request claims the key.
	pgtest.Exec(t, pool, `UPDATE idem.idempotency_keys SET expires_at = now() - interval '1 s', lease_expires_at = now() - interval '1 s'`)
	if n, err := dbidem.Cleanup(ctx, pool, 100); err != nil || n != 1 {
		t.Fatalf("cleanup: %d %v", n, err)
	}
	second, err := dbidem.Begin(ctx, pool, lease)
	if err != nil || second.Outcome != dbidem.Claimed || second.Attempt == first.Attempt {
		t.Fatalf("the new claim: %+v %v (the first had %d)", second, err, first.Attempt)
	}
	if err := dbidem.Complete(ctx, pool, lease.Principal, lease.Key, first.Attempt, dbidem.Response{Status: 200}); !errors.Is(err, dbidem.ErrClaimLost) {
		t.Fatalf("the stale holder completed the new claim: %v", err)
	}

	// The lease runs out (the key does not): the same request takes it over; the superseded
	// holder is fenced off, the new one completes.
	pgtest.Exec(t, pool, `UPDATE idem.idempotency_keys SET lease_expires_at = now() - interval '1 s'`)
	third, err := dbidem.Begin(ctx, pool, lease)
	if err != nil || third.Outcome != dbidem.Claimed || third.Attempt == second.Attempt || third.Attempt == first.Attempt {
		t.Fatalf("takeover: %+v %v", third, err)
	}
	if err := dbidem.Complete(ctx, pool, lease.Principal, lease.Key, second.Attempt, dbidem.Response{Status: 200}); !errors.Is(err, dbidem.ErrClaimLost) {
		t.Fatalf("the superseded holder completed: %v", err)
	}
	if err := dbidem.Complete(ctx, pool, lease.Principal, lease.Key, third.Attempt, dbidem.Response{Status: 202, Body: []byte("done")}); err != nil {
		t.Fatalf("the current holder: %v", err)
	}
	if d, err := dbidem.Begin(ctx, pool, lease); err != nil || d.Outcome != dbidem.Replay || string(d.Response.Body) != "done" {
		t.Fatalf("replay: %+v %v", d, err)
	}
}

// TestLeaseNeverOutlivesItsKey: a lease taken over near the end of the key's TTL extends
// the key; meanwhile the same request is told in_progress and cleanup leaves the row alone.
func TestLeaseNeverOutlivesItsKey(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 4)
	ctx := context.Background()
	lease := claim("job", `{"n":1}`)
	lease.Lease, lease.TTL = 2*time.Second, 3*time.Second
	if d, err := dbidem.Begin(ctx, pool, lease); err != nil || d.Outcome != dbidem.Claimed {
		t.Fatalf("lease: %+v %v", d, err)
	}
	// 2.5 s later: the lease ran out, the key has half a second left.
	pgtest.Exec(t, pool, `UPDATE idem.idempotency_keys SET lease_expires_at = now() - interval '0.5 s', expires_at = now() + interval '0.5 s'`)
	taken, err := dbidem.Begin(ctx, pool, lease)
	if err != nil || taken.Outcome != dbidem.Claimed {
		t.Fatalf("takeover: %+v %v", taken, err)
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem.idempotency_keys WHERE expires_at >= lease_expires_at`); n != 1 {
		t.Fatal("the new lease outlives its key")
	}
	// One second later the key's original TTL is over; the lease still runs.
	pgtest.Exec(t, pool, `UPDATE idem.idempotency_keys SET expires_at = expires_at - interval '1 s', lease_expires_at = lease_expires_at - interval '1 s'`)
	if d, err := dbidem.Begin(ctx, pool, lease); err != nil || d.Outcome != dbidem.InProgress {
		t.Fatalf("a request while the lease runs: %+v %v, want in_progress", d, err)
	}
	if n, err := dbidem.Cleanup(ctx, pool, 100); err != nil || n != 0 {
		t.Fatalf("cleanup deleted %d rows (%v) while a lease runs", n, err)
	}
	if err := dbidem.Complete(ctx, pool, lease.Principal, lease.Key, taken.Attempt, dbidem.Response{Status: 200}); err != nil {
		t.Fatalf("the holder: %v", err)
	}
}

// TestCommitOutcomeUnknown: the connection dies after COMMIT was sent (a deferred trigger
// holds the COMMIT while the backend is terminated): RunTx says ErrCommitUnknown, not
// "nothing was changed".
func TestCommitOutcomeUnknown(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 4)
	ctx := context.Background()
	pgtest.Exec(t, pool, `CREATE TABLE slow (n int);
		CREATE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN PERFORM pg_sleep(30); RETURN NULL; END $$;
		CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT ON slow DEFERRABLE INITIALLY DEFERRED
		    FOR EACH ROW EXECUTE FUNCTION slow_commit()`)
	c := claim("unknown", `{}`)
	done := make(chan error, 1)
	go func() {
		done <- dbidem.RunTx(ctx, pool, dbidem.TxOptions{}, func(tx *dbidem.Tx) error {
			if _, err := tx.Claim(ctx, c); err != nil {
				return err
			}
			if _, err := tx.Exec(ctx, `INSERT INTO slow VALUES (1)`); err != nil {
				return err
			}
			tx.CompleteOnCommit(dbidem.Response{Status: 201})
			return nil
		})
	}()
	pgtest.WaitFor(t, pool, `SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'PgSleep' AND datname = current_database()`)
	pgtest.Exec(t, pool, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE wait_event = 'PgSleep' AND datname = current_database()`)
	if err := <-done; !errors.Is(err, dbidem.ErrCommitUnknown) {
		t.Fatalf("RunTx: %v, want ErrCommitUnknown", err)
	}
}

// TestGateCoalescesDuplicates: while one Do holds a key, its duplicates in this process
// wait in Go (no connection, no lock wait on the database), then replay its result.
func TestGateCoalescesDuplicates(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 3)
	ctx := context.Background()
	pgtest.Exec(t, pool, `CREATE TABLE effects (n int)`)
	gate := dbidem.NewGate(dbidem.GateOptions{MaxWaitingClaims: 1})
	inside, release := make(chan struct{}), make(chan struct{})
	t.Cleanup(func() {
		select {
		case <-release:
		default:
			close(release)
		}
	})
	job := dbidem.Job{Principal: "w", Key: "k", Action: "ship", Input: 1, Gate: gate, LockTimeout: 10 * time.Second}
	run := func(first bool) (int, bool, error) {
		return dbidem.Do(ctx, pool, job, dbidem.TxOptions{}, func(ctx context.Context, tx pgx.Tx) (int, error) {
			var n int
			err := tx.QueryRow(ctx, `INSERT INTO effects VALUES (1) RETURNING 7`).Scan(&n)
			if first {
				close(inside)
				<-release
			}
			return n, err
		})
	}
	var wg sync.WaitGroup
	errs := make(chan error, 20)
	wg.Add(1)
	go func() {
		defer wg.Done()
		if _, _, err := run(true); err != nil {
			errs <- err
		}
	}()
	<-inside
	const dups = 12
	replays := make(chan bool, dups)
	for range dups {
		wg.Add(1)
		go func() {
			defer wg.Done()
			n, replayed, err := run(false)
			if err != nil || n != 7 {
				errs <- errors.Join(err, errors.New("wrong result"))
			}
			replays <- replayed
		}()
	}
	deadline := time.Now().Add(10 * time.Second)
	for gate.Waiting() != dups && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	if w := gate.Waiting(); w != dups {
		t.Fatalf("%d duplicates wait in Go, want %d", w, dups)
	}
	// Three connections: the holder's, and two the duplicates did not take.
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'`); n != 0 {
		t.Fatalf("%d backends wait on a lock", n)
	}
	close(release)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	close(replays)
	for r := range replays {
		if !r {
			t.Fatal("a duplicate ran the work instead of replaying")
		}
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM effects`); n != 1 {
		t.Fatalf("%d effects, want 1", n)
	}
	if gate.Coalesced() != dups || gate.Waiting() != 0 {
		t.Fatalf("coalesced %d, waiting %d", gate.Coalesced(), gate.Waiting())
	}
}

// TestGateBoundsLockWaits: claims that find their key held by another process take a wait
// slot; with every slot taken, the next one is refused at once.
func TestGateBoundsLockWaits(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 4)
	ctx := context.Background()
	// "Another process" holds two keys, uncommitted.
	holder, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = holder.Rollback(ctx) }()
	for _, k := range []string{"a", "b"} {
		if _, err := dbidem.Begin(ctx, holder, claim(k, `{}`)); err != nil {
			t.Fatal(err)
		}
	}
	gate := dbidem.NewGate(dbidem.GateOptions{MaxWaitingClaims: 1})
	waited := make(chan error, 1)
	go func() {
		c := claim("a", `{}`)
		c.LockTimeout = 3 * time.Second
		waited <- gate.Run(ctx, pool, dbidem.TxOptions{}, c, func(tx *dbidem.Tx, d dbidem.Decision) error {
			tx.CompleteOnCommit(dbidem.Response{Status: 200})
			return nil
		})
	}()
	for deadline := time.Now().Add(10 * time.Second); gate.LockWaits() != 1; {
		if time.Now().After(deadline) {
			t.Fatal("the first claim never took the wait slot")
		}
		time.Sleep(time.Millisecond)
	}
	c := claim("b", `{}`)
	c.LockTimeout = 3 * time.Second
	start := time.Now()
	err = gate.Run(ctx, pool, dbidem.TxOptions{}, c, func(*dbidem.Tx, dbidem.Decision) error { return nil })
	if !errors.Is(err, dbidem.ErrInProgress) || !dbidem.IsRefusedByGate(err) || time.Since(start) > time.Second {
		t.Fatalf("with the one slot taken: %v after %s, want a prompt refusal", err, time.Since(start))
	}
	if gate.Refused() != 1 {
		t.Fatalf("refused %d, want 1", gate.Refused())
	}
	_ = holder.Rollback(ctx)
	if err := <-waited; err != nil {
		t.Fatalf("the waiting claim, once the holder rolled back: %v", err)
	}
}

// TestKeyWaitIsRecognised: a lock timeout while waiting for another transaction's claim of
// the key is a key wait (the Gate then needs a wait slot); any other lock timeout is not.
func TestKeyWaitIsRecognised(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 4)
	ctx := context.Background()
	holder, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = holder.Rollback(ctx) }()
	if _, err := dbidem.Begin(ctx, holder, claim("held", `{}`)); err != nil {
		t.Fatal(err)
	}
	c := claim("held", `{}`)
	c.LockTimeout = 20 * time.Millisecond
	err = dbidem.RunTx(ctx, pool, dbidem.TxOptions{}, func(tx *dbidem.Tx) error { _, err := tx.Claim(ctx, c); return err })
	if !dbidem.IsKeyWait(err) {
		t.Fatalf("waiting on a held key: %v, want a key wait", err)
	}
	pgtest.Exec(t, pool, `CREATE TABLE other (n int)`)
	pgtest.Exec(t, holder, `LOCK TABLE other`)
	err = dbidem.RunTx(ctx, pool, dbidem.TxOptions{}, func(tx *dbidem.Tx) error {
		_, err := tx.Exec(ctx, `SET LOCAL lock_timeout = '20ms'; SELECT * FROM other`)
		return err
	})
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "55P03" || dbidem.IsKeyWait(err) {
		t.Fatalf("a timeout on another table's lock: %v, want a 55P03 that is not a key wait", err)
	}
}

// TestTransactionalTakeoverKeepsItsAnswerTheTTL (issue 28, finding 3): DoLease dies after its
// claim (a process killed mid-work), its lease runs out, and a while later Do runs the same
// job (they fingerprint alike), taking the dead lease over in a transaction. Its answer must
// be kept the TTL after it is given: a repeat most of a TTL later replays. It used to keep the
// dead claim's expiry, the TTL after the dead lease's end, so the repeat ran the job again.
func TestTransactionalTakeoverKeepsItsAnswerTheTTL(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 4)
	ctx := context.Background()
	const ttl = 4 * time.Second
	job := dbidem.Job{Principal: "p", Key: "takeover", Action: "payout", Input: map[string]int{"amount": 5}, TTL: ttl,
		Lease: time.Second}
	// The dying DoLease: its lease claim commits, then nothing extends or completes it.
	fp := canon.Compute("DO", job.Action, []byte(`{"amount":5}`))
	dead := dbidem.Claim{Principal: job.Principal, Key: job.Key, Action: job.Action, Fingerprint: fp.Sum, TTL: ttl, Lease: job.Lease}
	if d, err := dbidem.Begin(ctx, pool, dead); err != nil || d.Outcome != dbidem.Claimed {
		t.Fatalf("the dying lease claim: %+v %v", d, err)
	}
	time.Sleep(job.Lease + 1500*time.Millisecond) // the lease ran out a while ago
	runs := 0
	run := func() (int, bool, error) {
		return dbidem.Do(ctx, pool, job, dbidem.TxOptions{}, func(ctx context.Context, tx pgx.Tx) (int, error) {
			runs++
			return 42, nil
		})
	}
	if n, replayed, err := run(); err != nil || n != 42 || replayed {
		t.Fatalf("the takeover: %d %v %v", n, replayed, err)
	}
	answered := time.Now()
	time.Sleep(ttl * 3 / 4)
	n, replayed, err := run()
	if err != nil || n != 42 || !replayed || runs != 1 {
		t.Fatalf("a repeat %v after the answer (TTL %v): %d, replayed %v, %v; %d runs, want the answer replayed and one run",
			time.Since(answered).Round(time.Millisecond), ttl, n, replayed, err, runs)
	}
}

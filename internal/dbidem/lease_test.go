package dbidem_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

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
	// A 2 s lease: each extension may take a third of it (a loaded CI machine under the race
	// detector once took longer than a third of 1 s twice in a row in the middleware's test).
	job := dbidem.Job{Principal: "p", Key: "job-1", Action: "payout", Input: map[string]int{"amount": 5}, Lease: 2 * time.Second,
		LockTimeout: 100 * time.Millisecond}
	var runs atomic.Int32
	var finished atomic.Bool // the work has returned its result (its completion may follow)
	var keys sync.Map
	work := func(ctx context.Context, c dbidem.LeaseClaim) (int, error) {
		runs.Add(1)
		keys.Store(c.ProviderKey, true)
		select {
		case <-time.After(6 * time.Second):
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
	// Duplicates every 400 ms for 6 s: at least 3 of them, however slow the machine (coverage
	// and the race detector slow each one down).
	if err != nil || n != 42 || !replayed || runs.Load() != 1 || dups < 3 {
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
	pgtest.Exec(t, pool, `UPDATE idem.idempotency_keys SET attempt = nextval('idem.token_seq') WHERE key = 'job-2'`)
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
	keys.Range(func(k, _ any) bool {
		if len(k.(string)) == 64 {
			distinct++
		}
		return true
	})
	if distinct != 2 {
		t.Fatalf("%d provider keys of 64 hex digits for two jobs, want each job's own", distinct)
	}
}

// TestDoLeaseAnswerRecordedPastTheLeasesEnd (D143): the key's row is locked from the work's
// start (no extension lands) until 1.3 s after the work returned, past the 2 s lease's end by
// this process's clock. Nothing took the key over, so DoLease still records the result and
// returns it. Before, the recording stopped at the lease's end and DoLease returned its error.
func TestDoLeaseAnswerRecordedPastTheLeasesEnd(t *testing.T) {
	t.Parallel()
	pool, url := pgtest.NewPool(t, 8)
	ctx := context.Background()
	locker := pgtest.Connect(t, url)
	job := dbidem.Job{Principal: "p", Key: "late", Action: "payout", Input: map[string]int{"amount": 5}, Lease: 2 * time.Second,
		LockTimeout: 100 * time.Millisecond}
	extensions := 0
	released := make(chan time.Time, 1)
	began := time.Now()
	n, replayed, err := dbidem.DoLease(ctx, pool, job, func(ctx context.Context, c dbidem.LeaseClaim) (int, error) {
		tx, err := locker.Begin(ctx)
		if err != nil {
			return 0, err
		}
		if _, err := tx.Exec(ctx, `SELECT 1 FROM idem.idempotency_keys WHERE key = 'late' FOR UPDATE`); err != nil {
			return 0, err
		}
		time.Sleep(time.Second)
		extensions = pgtest.Count(t, pool, `SELECT count(*) FROM idem.idempotency_keys
			WHERE key = 'late' AND lease_expires_at > claimed_at + interval '2.5 s'`)
		go func() {
			time.Sleep(1300 * time.Millisecond)
			at := time.Now()
			if err := tx.Rollback(context.Background()); err != nil {
				t.Error(err)
			}
			released <- at
		}()
		return 42, nil
	})
	at := <-released
	if extensions != 0 {
		t.Fatal("an extension landed while the key's row was locked; the lease's end did not pass")
	}
	if at.Sub(began) < 2*time.Second {
		t.Fatalf("the row was released %v after the claim, before the lease's end", at.Sub(began))
	}
	if err != nil || n != 42 || replayed {
		t.Fatalf("DoLease: %d, replayed %v, %v; want 42, recorded past the lease's end", n, replayed, err)
	}
	if n, replayed, err := dbidem.DoLease(ctx, pool, job, func(context.Context, dbidem.LeaseClaim) (int, error) {
		return 0, errors.New("the work ran again")
	}); err != nil || n != 42 || !replayed {
		t.Fatalf("the retry: %d, replayed %v, %v; want the replay of 42", n, replayed, err)
	}
}

// TestLeaseNeverStartsLate (issue 28, finding 4): a lease claim that first waits on an
// uncommitted holder of its key. The database counts the lease from when it received the
// claim, before the wait; the heartbeat's local deadline must not be later than that, and its
// first extension must come before the database's lease runs out, or another process takes
// the key over while this one still works. Before the fix the local lease began when the
// heartbeat started (after the wait and the COMMIT) and its end was the wait's length late.
func TestLeaseNeverStartsLate(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 8)
	ctx := context.Background()
	const lease = time.Second
	hold := 700 * time.Millisecond
	c := claim("late", `{"job":1}`)
	c.Lease = lease

	// The holder: another request's uncommitted transactional claim of the key, rolled back
	// after hold.
	holder, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	other := c
	other.Lease = 0
	other.Fingerprint[0] ^= 1
	if d, err := dbidem.Begin(ctx, holder, other); err != nil || d.Outcome != dbidem.Claimed {
		t.Fatalf("holder: %+v %v", d, err)
	}
	go func() {
		time.Sleep(hold)
		_ = holder.Rollback(ctx)
	}()

	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	d, err := dbidem.Begin(ctx, tx, c) // waits for the holder
	if err != nil || d.Outcome != dbidem.Claimed {
		t.Fatalf("claim: %+v %v", d, err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	l := dbidem.KeepAlive(ctx, pool, c.Principal, c.Key, d.Attempt, dbidem.LeaseOptions{Lease: lease, Start: d.Sent})
	defer l.Stop()
	// The database's remaining time first, then the local one: read later, the local one is,
	// if anything, the smaller, so a local deadline later than the database's still shows
	// (before the fix it was the wait on the holder late, 700 ms here), however slow the query.
	var db time.Duration
	if err := pool.QueryRow(ctx, `SELECT (extract(epoch FROM lease_expires_at - clock_timestamp()) * 1e6)::bigint * 1000
		FROM idem.idempotency_keys WHERE key = $1`, c.Key).Scan(&db); err != nil {
		t.Fatal(err)
	}
	local := time.Until(l.End())
	if local > db+5*time.Millisecond {
		t.Fatalf("the local lease ends %v from now, the database's %v: the local deadline is late", local, db)
	}

	// A competitor polls for a takeover while the work runs two leases long: with the first
	// extension due a third of a lease after the claim was sent, it never gets one.
	stop := time.Now().Add(2 * lease)
	for time.Now().Before(stop) {
		var outcome string
		if err := pool.QueryRow(ctx, `SELECT outcome FROM idem.idem_begin(p_principal => $1, p_key => $2, p_action => $3,
			p_request_sha256 => $4, p_lease => '1 second')`, c.Principal, c.Key, c.Action, c.Fingerprint[:]).Scan(&outcome); err != nil {
			t.Fatal(err)
		}
		if outcome != "in_progress" {
			t.Fatalf("a competitor got %q while the lease's holder still works and heartbeats", outcome)
		}
		time.Sleep(5 * time.Millisecond)
	}
	if l.Lost() || l.Extensions() < 4 {
		t.Fatalf("lost %v after %d extensions", l.Lost(), l.Extensions())
	}
}

// TestLeaseLostBeforeATakeoverUnderATableLock (issue 31): the key table is locked longer than
// a lease while lease work runs, so no extension can succeed. The work must learn that its
// lease is lost (its context ends with ErrLeaseLost) at its lease's end by its own clock, which
// is never later than the database's (before any other process could take the key over), told
// by a wake-up (within 200 ms here), not by the blocked extension's return.
func TestLeaseLostBeforeATakeoverUnderATableLock(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 8)
	ctx := context.Background()
	c := claim("locked-lease", `{"job":1}`)
	c.Lease = time.Second
	d, err := dbidem.Begin(ctx, pool, c)
	if err != nil || d.Outcome != dbidem.Claimed {
		t.Fatalf("claim: %+v %v", d, err)
	}
	l := dbidem.KeepAlive(ctx, pool, c.Principal, c.Key, d.Attempt, dbidem.LeaseOptions{Lease: c.Lease, Start: d.Sent})
	defer l.Stop()
	locker, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := locker.Exec(ctx, `LOCK TABLE idem.idempotency_keys IN ACCESS EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	var lostAt time.Time
	select {
	case <-l.Context().Done():
		lostAt = time.Now()
	case <-time.After(5 * time.Second):
		t.Fatal("the work never learned that its lease could not be extended")
	}
	if !errors.Is(context.Cause(l.Context()), dbidem.ErrLeaseLost) {
		t.Fatalf("the work's context ended with %v, want ErrLeaseLost", context.Cause(l.Context()))
	}
	time.Sleep(500 * time.Millisecond)
	_ = locker.Rollback(ctx)
	// The work is told at the lease's end by its own clock (a timer of its own, whatever the
	// extension blocked on the table does: D261), which is never later than the database's
	// end; the telling takes a wake-up, not the blocked extension's cancel.
	var dbEnd time.Time
	if err := pool.QueryRow(ctx, `SELECT lease_expires_at FROM idem.idempotency_keys WHERE key = $1`, c.Key).Scan(&dbEnd); err != nil {
		t.Fatal(err)
	}
	if end := l.End(); end.After(dbEnd) || lostAt.Sub(end) > 200*time.Millisecond {
		t.Fatalf("the lease's end by the process's clock %v, the database's %v, the work told at %v",
			end.Format(time.StampMicro), dbEnd.Format(time.StampMicro), lostAt.Format(time.StampMicro))
	}
}

// TestStopDuringAnExtension: Stop is called while an extension waits on the key's row, and
// the next extension falls due before that one gives up. Stop must end the heartbeat there:
// not start another extension, and not report the lease lost because that one ran to the
// lease's end. Before the fix the heartbeat's select picked the due beat over Stop half the
// time, waited through one more extension to the lease's end, and then picked the expiry over
// Stop half the time: a lease whose work ended well before its end counted as lost, and
// DoLease threw the answer away. Sixteen leases at once, so the old behaviour shows in all but
// about one run in a hundred.
func TestStopDuringAnExtension(t *testing.T) {
	t.Parallel()
	const n = 16
	pool, _ := pgtest.NewPool(t, n+4)
	ctx := context.Background()
	// An extension falls due every 1.33 s: time enough to claim sixteen keys and lock their
	// rows first, also on a machine busy with the rest of the suite (2 s left 667 ms, and a
	// busy run took 765).
	const lease = 4 * time.Second
	decisions := make([]dbidem.Decision, n)
	keys := make([]string, n)
	for i := range decisions {
		c := claim(fmt.Sprintf("stop-%d", i), `{"job":1}`)
		c.Lease = lease
		d, err := dbidem.Begin(ctx, pool, c)
		if err != nil || d.Outcome != dbidem.Claimed {
			t.Fatalf("claim: %+v %v", d, err)
		}
		decisions[i], keys[i] = d, c.Key
	}
	// Every key's row is locked before the first extension falls due (a third of the lease
	// after its claim), so each first extension waits until its deadline, when the next one is
	// due.
	locker, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = locker.Rollback(ctx) }()
	if _, err := locker.Exec(ctx, `SELECT 1 FROM idem.idempotency_keys WHERE key LIKE 'stop-%' FOR UPDATE`); err != nil {
		t.Fatal(err)
	}
	if time.Since(decisions[0].Sent) > lease/3 {
		t.Fatalf("the rows were locked %v after the first claim, after its first extension fell due", time.Since(decisions[0].Sent))
	}
	type stop struct {
		lost    bool
		at, end time.Time
	}
	stops := make(chan stop, n)
	for i, d := range decisions {
		l := dbidem.KeepAlive(ctx, pool, "alice", keys[i], d.Attempt, dbidem.LeaseOptions{Lease: lease, Start: d.Sent})
		go func() {
			// Half-way through the first extension's wait.
			time.Sleep(time.Until(d.Sent.Add(lease / 2)))
			end := l.End()
			lost := l.Stop()
			stops <- stop{lost: lost, at: time.Now(), end: end}
		}()
	}
	for range n {
		s := <-stops
		if s.lost {
			t.Fatal("a lease stopped a second before its end counted as lost")
		}
		if !s.at.Before(s.end) {
			t.Fatalf("Stop returned %v after the lease's end: it waited through one more extension", s.at.Sub(s.end))
		}
	}
}

// TestDoLeaseRecordsThroughALockTimeout: the key's row is locked from just before the work
// returns until 2.5 s after, longer than idem_complete's own lock timeout (2 s), and nothing
// takes the key over. DoLease must record the result (Persist tries again until the lease's
// AnswerDeadline) and return it without an error. Before, it tried once and returned the
// result with an error wrapping ErrInProgress ("request in progress", which River's Work
// reads as another run holding the key), and the key stayed in progress for the whole lease.
func TestDoLeaseRecordsThroughALockTimeout(t *testing.T) {
	t.Parallel()
	pool, url := pgtest.NewPool(t, 8)
	ctx := context.Background()
	locker := pgtest.Connect(t, url)
	job := dbidem.Job{Principal: "p", Key: "locked-answer", Action: "payout", Input: map[string]int{"amount": 5}, Lease: 10 * time.Second}
	released := make(chan time.Time, 1)
	var returned time.Time
	n, replayed, err := dbidem.DoLease(ctx, pool, job, func(ctx context.Context, c dbidem.LeaseClaim) (int, error) {
		tx, err := locker.Begin(ctx)
		if err != nil {
			return 0, err
		}
		if _, err := tx.Exec(ctx, `SELECT 1 FROM idem.idempotency_keys WHERE key = 'locked-answer' FOR UPDATE`); err != nil {
			return 0, err
		}
		returned = time.Now()
		go func() {
			time.Sleep(2500 * time.Millisecond)
			at := time.Now()
			if err := tx.Rollback(context.Background()); err != nil {
				t.Error(err)
			}
			released <- at
		}()
		return 42, nil
	})
	at := <-released
	if err != nil || n != 42 || replayed {
		t.Fatalf("DoLease: %d, replayed %v, %v; want 42 recorded after the row was released", n, replayed, err)
	}
	if at.Sub(returned) < 2*time.Second {
		t.Fatalf("the row was released %v after the work returned, within one lock timeout", at.Sub(returned))
	}
	if n := pgtest.Count(t, pool, `SELECT count(*) FROM idem.idempotency_keys WHERE key = 'locked-answer' AND state = 'c'`); n != 1 {
		t.Fatal("the result was not recorded")
	}
	if n, replayed, err := dbidem.DoLease(ctx, pool, job, func(context.Context, dbidem.LeaseClaim) (int, error) {
		return 0, errors.New("the work ran again")
	}); err != nil || n != 42 || !replayed {
		t.Fatalf("the retry: %d, replayed %v, %v; want the replay of 42", n, replayed, err)
	}
}

// TestDoLeaseDuplicateIsInProgress: a DoLease of the same job while the first one's work runs
// (its lease claim committed, nothing locked) gets ErrInProgress at once. Before, the Gate took
// that error for a probe that timed out on a table lock: it claimed three more times and
// returned ErrStoreBusy ("the key table is locked"), counted as refused.
func TestDoLeaseDuplicateIsInProgress(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 8)
	ctx := context.Background()
	gate := dbidem.NewGate(dbidem.GateOptions{})
	job := dbidem.Job{Principal: "p", Key: "dup", Action: "payout", Input: map[string]int{"amount": 5}, Lease: 5 * time.Second, Gate: gate}
	running, finish, first := make(chan struct{}), make(chan struct{}), make(chan error, 1)
	go func() {
		_, _, err := dbidem.DoLease(ctx, pool, job, func(ctx context.Context, c dbidem.LeaseClaim) (int, error) {
			close(running)
			<-finish
			return 1, nil
		})
		first <- err
	}()
	<-running
	began := time.Now()
	_, _, err := dbidem.DoLease(ctx, pool, job, func(context.Context, dbidem.LeaseClaim) (int, error) {
		return 0, errors.New("the work ran twice")
	})
	took := time.Since(began)
	close(finish)
	if e := <-first; e != nil {
		t.Fatal(e)
	}
	if !errors.Is(err, dbidem.ErrInProgress) || errors.Is(err, dbidem.ErrStoreBusy) {
		t.Fatalf("the duplicate got %v, want ErrInProgress and not ErrStoreBusy", err)
	}
	if gate.Refused() != 0 {
		t.Fatalf("the gate counted %d refused", gate.Refused())
	}
	t.Logf("the duplicate was answered in %v", took)
}

// TestDoLeasePanicGivesTheClaimUp: fn panics and the caller recovers (as a job runner does).
// The panic must reach the caller, the heartbeat stop and the claim be given up, so that a
// retry runs the work at once. Before, the heartbeat went on extending the lease until
// Job.Timeout (5 minutes by default) and every retry was told the work was in progress.
func TestDoLeasePanicGivesTheClaimUp(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 8)
	ctx := context.Background()
	job := dbidem.Job{Principal: "p", Key: "panics", Action: "payout", Input: map[string]int{"amount": 5}, Lease: 2 * time.Second}
	var provider string
	recovered := func() (r any) {
		defer func() { r = recover() }()
		_, _, _ = dbidem.DoLease(ctx, pool, job, func(ctx context.Context, c dbidem.LeaseClaim) (int, error) {
			provider = c.ProviderKey
			panic("boom")
		})
		return nil
	}()
	if recovered != "boom" {
		t.Fatalf("recovered %v, want the work's panic", recovered)
	}
	n, replayed, err := dbidem.DoLease(ctx, pool, job, func(ctx context.Context, c dbidem.LeaseClaim) (int, error) {
		if c.ProviderKey != provider {
			t.Errorf("the retry's provider key %s, want the first run's %s", c.ProviderKey, provider)
		}
		return 7, nil
	})
	if err != nil || n != 7 || replayed {
		t.Fatalf("the retry right after the panic: %d, replayed %v, %v; want the work run again", n, replayed, err)
	}
}

// lostReply is a pool whose first idem_complete runs (and commits, or fails) and then reports a
// broken connection, as when the server's answer is lost on its way back; noticed after `after`
// (a TCP timeout, a network outage), at once when it is 0. next, when set, runs once the second
// idem_complete has run, before its answer is returned: the gap before PersistAnswer's read of
// the key's row.
type lostReply struct {
	*pgxpool.Pool
	after time.Duration
	next  func()
	lost  atomic.Bool
	n     atomic.Int32 // idem_complete calls
}

func (p *lostReply) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	tag, err := p.Pool.Exec(ctx, sql, args...)
	if sql != dbidem.CompleteSQL {
		return tag, err
	}
	switch p.n.Add(1) {
	case 1:
		p.lost.Store(true)
		time.Sleep(p.after)
		return pgconn.CommandTag{}, fmt.Errorf("read the answer: %w", io.ErrUnexpectedEOF)
	case 2:
		if p.next != nil {
			p.next()
		}
	}
	return tag, err
}

// TestDoLeaseAnswerWhoseReplyWasLost (review finding): the recording of DoLease's result
// commits and its reply is lost. The next try finds the claim completed (55000): DoLease
// reported the lease lost (ErrLeaseLost), and a River job ran again only to replay. The answer
// stored is this attempt's, so DoLease returns its result.
func TestDoLeaseAnswerWhoseReplyWasLost(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 8)
	ctx := context.Background()
	db := &lostReply{Pool: pool}
	job := dbidem.Job{Principal: "p", Key: "lost-reply", Action: "payout", Input: map[string]int{"amount": 5}, Lease: 5 * time.Second}
	n, replayed, err := dbidem.DoLease(ctx, db, job, func(context.Context, dbidem.LeaseClaim) (int, error) { return 42, nil })
	if !db.lost.Load() {
		t.Fatal("no reply was lost")
	}
	if err != nil || n != 42 || replayed {
		t.Fatalf("DoLease whose recording's reply was lost: %d, replayed %v, %v; want 42", n, replayed, err)
	}
	// Another attempt's answer is not taken for this one's: with the reply of its first try
	// lost too, a later attempt than the one that completed the key still gets ErrClaimLost.
	c := dbidem.Claim{Principal: "p", Key: "other", Action: "a", Fingerprint: [32]byte{1}, Lease: 5 * time.Second}
	d, err := dbidem.Begin(ctx, pool, c)
	if err != nil || d.Outcome != dbidem.Claimed {
		t.Fatalf("claim: %+v %v", d, err)
	}
	db.lost.Store(false)
	err = dbidem.PersistAnswer(ctx, db, pool, c, d.Attempt, dbidem.Response{Status: 201})
	if err != nil {
		t.Fatalf("PersistAnswer, the reply lost: %v", err)
	}
	db.lost.Store(false)
	if err := dbidem.PersistAnswer(ctx, db, pool, c, d.Attempt+1, dbidem.Response{Status: 201}); !errors.Is(err, dbidem.ErrClaimLost) {
		t.Fatalf("PersistAnswer of an attempt that never held the key: %v, want ErrClaimLost", err)
	}
}

// TestDoLeaseResultAfterItsLeaseRanOut (D149): the key's row is locked from the work's start,
// so no extension lands and the lease runs out by this process's clock: the work's context
// ends with ErrLeaseLost. The work returns a result all the same.
//
//   - Nobody took the key over: the result is recorded, fenced by the token, and returned;
//     the retry replays it. Before, DoLease threw it away (ErrLeaseLost) and a retry ran the
//     work again.
//   - Another run took the key over (and answered) before the first returned: the first's
//     recording is refused, DoLease returns ErrLeaseLost, and the key keeps the other run's
//     answer.
func TestDoLeaseResultAfterItsLeaseRanOut(t *testing.T) {
	t.Parallel()
	pool, url := pgtest.NewPool(t, 8)
	ctx := context.Background()
	// lockedWork locks the key's row on its own connection, waits for its lease to be lost,
	// releases the row, runs released (when not nil) and returns result.
	lockedWork := func(key string, result int, released func()) func(context.Context, dbidem.LeaseClaim) (int, error) {
		return func(ctx context.Context, c dbidem.LeaseClaim) (int, error) {
			locker := pgtest.Connect(t, url)
			tx, err := locker.Begin(context.Background())
			if err == nil {
				_, err = tx.Exec(context.Background(), `SELECT 1 FROM idem.idempotency_keys WHERE key = $1 FOR UPDATE`, key)
			}
			if err != nil {
				return 0, err
			}
			select {
			case <-ctx.Done():
			case <-time.After(10 * time.Second):
				return 0, errors.New("the lease was not lost while its row was locked")
			}
			if cause := context.Cause(ctx); !errors.Is(cause, dbidem.ErrLeaseLost) {
				return 0, fmt.Errorf("the work's context ended with %v, want ErrLeaseLost", cause)
			}
			time.Sleep(200 * time.Millisecond)
			if err := tx.Rollback(context.Background()); err != nil {
				return 0, err
			}
			if released != nil {
				released()
			}
			return result, nil
		}
	}
	job := dbidem.Job{Principal: "p", Key: "ran-out", Action: "payout", Input: map[string]int{"amount": 5}, Lease: time.Second,
		LockTimeout: 100 * time.Millisecond}
	n, replayed, err := dbidem.DoLease(ctx, pool, job, lockedWork(job.Key, 42, nil))
	if err != nil || n != 42 || replayed {
		t.Fatalf("DoLease whose lease ran out, nobody taking over: %d, replayed %v, %v; want 42, recorded", n, replayed, err)
	}
	if n, replayed, err := dbidem.DoLease(ctx, pool, job, func(context.Context, dbidem.LeaseClaim) (int, error) {
		return 0, errors.New("the work ran again")
	}); err != nil || n != 42 || !replayed {
		t.Fatalf("the retry: %d, replayed %v, %v; want the replay of 42", n, replayed, err)
	}

	// Taken over: the other run claims the key once the first's row lock is gone and its lease
	// has run out in the database too, and answers 7.
	taken := job
	taken.Key = "taken-over"
	tookOver := false
	takeOver := func() {
		for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
			n, replayed, err := dbidem.DoLease(ctx, pool, taken, func(context.Context, dbidem.LeaseClaim) (int, error) { return 7, nil })
			if errors.Is(err, dbidem.ErrInProgress) {
				continue
			}
			if err != nil || n != 7 || replayed {
				t.Errorf("the takeover: %d, replayed %v, %v; want 7", n, replayed, err)
			}
			tookOver = true
			return
		}
		t.Error("the key was never taken over")
	}
	n, _, err = dbidem.DoLease(ctx, pool, taken, lockedWork(taken.Key, 42, takeOver))
	if !tookOver {
		t.Fatal("no takeover happened")
	}
	if !errors.Is(err, dbidem.ErrLeaseLost) || n != 0 {
		t.Fatalf("DoLease whose key was taken over: %d, %v; want ErrLeaseLost", n, err)
	}
	if n, replayed, err := dbidem.DoLease(ctx, pool, taken, func(context.Context, dbidem.LeaseClaim) (int, error) {
		return 0, errors.New("the work ran again")
	}); err != nil || n != 7 || !replayed {
		t.Fatalf("the retry after the takeover: %d, replayed %v, %v; want the takeover's 7", n, replayed, err)
	}
}

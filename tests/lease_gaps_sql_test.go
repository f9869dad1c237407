package tests

// Adversarial walk of the SQL API's lease and steps lifecycle (docs/sql-api.md): between each
// pair of statements of a lease claim's life, a duplicate (same key, same fingerprint), another
// request (same key, other fingerprint) and an idem_cleanup run from a second connection, and
// what each sees checked against the page. Gaps are held open with real row locks (an open
// transaction of the holder), never sleeps; the passage of time is simulated by moving the
// key's timestamps as the table's owner.

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/pgidem/pgidem/internal/pgtest"
)

type gapAnswer struct {
	Outcome string
	Attempt int64
	Retry   *float64 // seconds
	PK      *string
	Point   *string
	Saved   *string
}

type gapQ interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// gapBegin calls idem_begin_steps for principal p, with action 'POST /gaps', fingerprint
// sha256(body), TTL 1 hour, lease (NULL when ""), and a lock timeout of 300 ms so that an
// unexpected wait shows as 55P03 quickly.
func gapBegin(ctx context.Context, q gapQ, key, body, lease string) (gapAnswer, error) {
	var a gapAnswer
	var leaseArg any
	if lease != "" {
		leaseArg = lease
	}
	err := q.QueryRow(ctx, `SELECT outcome, attempt, extract(epoch FROM retry_after)::float8, provider_key,
		recovery_point, recovery_saved::text
		FROM idem.idem_begin_steps(p_principal => 'p', p_key => $1, p_action => 'POST /gaps',
		     p_request_sha256 => sha256($2::bytea), p_ttl => '1 hour', p_lease => $3::interval,
		     p_lock_timeout => '300 ms')`, key, body, leaseArg).
		Scan(&a.Outcome, &a.Attempt, &a.Retry, &a.PK, &a.Point, &a.Saved)
	return a, err
}

func gapMust(t *testing.T, ctx context.Context, q gapQ, key, body, lease string) gapAnswer {
	t.Helper()
	a, err := gapBegin(ctx, q, key, body, lease)
	if err != nil {
		t.Fatalf("idem_begin: %v", err)
	}
	return a
}

func gapStr(p *string) string {
	if p == nil {
		return "<nil>"
	}
	return *p
}

// gapAt runs, from connection b, a duplicate (body "req"), another request (body "other") and
// one idem_cleanup; it checks the duplicate's outcome, attempt and provider key, that the other
// request gets mismatch with the same attempt, and that the cleanup deleted nothing. want.Attempt
// 0 skips the attempt check; want.PK nil skips the provider key check.
func gapAt(t *testing.T, ctx context.Context, b *pgx.Conn, where, key string, want gapAnswer) gapAnswer {
	t.Helper()
	cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	d, err := gapBegin(cctx, b, key, "req", "1 minute")
	if err != nil {
		t.Fatalf("%s: duplicate: %v", where, err)
	}
	if d.Outcome != want.Outcome || (want.Attempt != 0 && d.Attempt != want.Attempt) ||
		(want.PK != nil && gapStr(d.PK) != *want.PK) {
		t.Errorf("%s: duplicate got %s attempt %d pk %s, want %s attempt %d pk %s", where, d.Outcome, d.Attempt,
			gapStr(d.PK), want.Outcome, want.Attempt, gapStr(want.PK))
	}
	if d.Outcome == "in_progress" && (d.Retry == nil || *d.Retry <= 0) {
		t.Errorf("%s: in_progress with retry_after %v", where, d.Retry)
	}
	if d.Outcome != "claimed" {
		o, err := gapBegin(cctx, b, key, "other", "1 minute")
		if err != nil {
			t.Fatalf("%s: other request: %v", where, err)
		}
		if o.Outcome != "mismatch" || o.Attempt != d.Attempt || o.PK != nil {
			t.Errorf("%s: other request got %s attempt %d pk %s, want mismatch attempt %d, no pk", where, o.Outcome, o.Attempt, gapStr(o.PK), d.Attempt)
		}
	}
	var n int
	if err := b.QueryRow(cctx, `SELECT idem.idem_cleanup(1000)`).Scan(&n); err != nil || n != 0 {
		t.Errorf("%s: idem_cleanup deleted %d (%v), want 0", where, n, err)
	}
	return d
}

func gapApp(t *testing.T) (url, appURL string, admin *pgx.Conn) {
	t.Helper()
	url = pgtest.NewDB(t)
	admin = pgtest.Connect(t, url)
	appURL = pgtest.LoginRole(t, url, "idem_app")
	return url, appURL, admin
}

// TestLeaseGapsLeaseWalk: one key's lease life, with a duplicate, another request and a
// cleanup in every gap, as docs/sql-api.md's table "Who may do what to a lease claim" says.
func TestLeaseGapsLeaseWalk(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, appURL, admin := gapApp(t)
	a := pgtest.Connect(t, appURL)
	b := pgtest.Connect(t, appURL)
	const key = "walk"

	// Claimed, not committed yet: a duplicate and another request wait on the row and give up
	// with 55P03 past their lock timeout; cleanup does not wait.
	txa, err := a.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	c1 := gapMust(t, ctx, txa, key, "req", "1 minute")
	if c1.Outcome != "claimed" || c1.PK == nil || c1.Point != nil {
		t.Fatalf("claim: %+v", c1)
	}
	for _, body := range []string{"req", "other"} {
		if _, err := gapBegin(ctx, b, key, body, "1 minute"); sqlCode(err) != "55P03" {
			t.Errorf("%s while the claim is uncommitted: %v, want 55P03", body, err)
		}
	}
	var n int
	if err := b.QueryRow(ctx, `SELECT idem.idem_cleanup(1000)`).Scan(&n); err != nil || n != 0 {
		t.Errorf("cleanup during an uncommitted claim: %d %v", n, err)
	}
	if err := txa.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	T1, P1 := c1.Attempt, c1.PK
	d := gapAt(t, ctx, b, "after the claim", key, gapAnswer{Outcome: "in_progress", Attempt: T1, PK: P1})
	if d.Retry == nil || *d.Retry > 60 {
		t.Errorf("retry_after %v beyond the 1 minute lease", d.Retry)
	}

	// The heartbeat.
	var end time.Time
	if err := a.QueryRow(ctx, `SELECT idem.idem_extend('p', $1, $2, '2 minutes')`, key, T1).Scan(&end); err != nil {
		t.Fatal(err)
	}
	d = gapAt(t, ctx, b, "after extend", key, gapAnswer{Outcome: "in_progress", Attempt: T1, PK: P1})
	if d.Retry == nil || *d.Retry <= 60 || *d.Retry > 120 {
		t.Errorf("retry_after after extending to 2 minutes: %v", d.Retry)
	}

	// A step's transaction open: a duplicate, another request and cleanup answer at once.
	txa, err = a.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := txa.Exec(ctx, `SELECT idem.idem_step('p', $1, $2, 's1', '{"id": 1}')`, key, T1); err != nil {
		t.Fatal(err)
	}
	gapAt(t, ctx, b, "during step s1's transaction", key, gapAnswer{Outcome: "in_progress", Attempt: T1, PK: P1})
	if err := txa.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := a.Exec(ctx, `SELECT idem.idem_step('p', $1, $2, 's1', '2')`, key, T1); sqlCode(err) != "23505" {
		t.Errorf("step s1 again: %v, want 23505", err)
	}
	if _, err := a.Exec(ctx, `SELECT idem.idem_step('p', $1, $2, 's2', '"two"')`, key, T1); err != nil {
		t.Fatal(err)
	}
	gapAt(t, ctx, b, "after step s2", key, gapAnswer{Outcome: "in_progress", Attempt: T1, PK: P1})

	// The lease runs out (its end moved into the past; the key's TTL still runs).
	gapRunOut(t, admin, key)
	o := gapMust(t, ctx, b, key, "other", "1 minute")
	if o.Outcome != "mismatch" || o.Attempt != T1 {
		t.Errorf("other request once the lease ran out: %+v", o)
	}
	if err := b.QueryRow(ctx, `SELECT idem.idem_cleanup(1000)`).Scan(&n); err != nil || n != 0 {
		t.Errorf("cleanup of a lease run out: %d %v", n, err)
	}
	// The same request takes it over, in a transaction held open: the old holder's step waits,
	// and is refused once the takeover commits.
	txb, err := b.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	c2 := gapMust(t, ctx, txb, key, "req", "1 minute")
	if c2.Outcome != "claimed" || c2.Attempt == T1 || gapStr(c2.PK) != *P1 || gapStr(c2.Point) != "s2" ||
		gapStr(c2.Saved) != `{"s1": {"id": 1}, "s2": "two"}` {
		t.Fatalf("takeover: %+v point %s saved %s", c2, gapStr(c2.Point), gapStr(c2.Saved))
	}
	done := make(chan error, 1)
	go func() {
		_, err := a.Exec(ctx, `SELECT idem.idem_step('p', $1, $2, 's3', '3')`, key, T1)
		done <- err
	}()
	pgtest.WaitUntilBlocked(t, admin, a.PgConn().PID())
	if err := txb.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-done; sqlCode(err) != "55000" {
		t.Errorf("old holder's step after the takeover: %v, want 55000", err)
	}
	T2 := c2.Attempt
	for _, q := range []string{
		`SELECT idem.idem_extend('p', $1, $2, '1 minute')`,
		`SELECT idem.idem_complete('p', $1, $2, 200, '{}', 'stale')`,
		`SELECT idem.idem_step('p', $1, $2, 's3', '3')`,
		`SELECT * FROM idem.idem_recovery('p', $1, $2)`,
	} {
		if _, err := a.Exec(ctx, q, key, T1); sqlCode(err) != "55000" {
			t.Errorf("old holder: %s: %v, want 55000", q, err)
		}
	}
	for _, q := range []string{`SELECT idem.idem_release('p', $1, $2)`, `SELECT idem.idem_yield('p', $1, $2)`} {
		var ok bool
		if err := a.QueryRow(ctx, q, key, T1).Scan(&ok); err != nil || ok {
			t.Errorf("old holder: %s: %v %v, want false", q, ok, err)
		}
	}
	gapAt(t, ctx, a, "after the takeover", key, gapAnswer{Outcome: "in_progress", Attempt: T2, PK: P1})

	// The new holder gives its lease up: the same request takes over at once, same generation.
	var ok bool
	if err := b.QueryRow(ctx, `SELECT idem.idem_yield('p', $1, $2)`, key, T2).Scan(&ok); err != nil || !ok {
		t.Fatalf("yield: %v %v", ok, err)
	}
	if _, err := b.Exec(ctx, `SELECT idem.idem_complete('p', $1, $2, 200, '{}', 'x')`, key, T2); sqlCode(err) != "55000" {
		t.Errorf("complete after yield: %v", err)
	}
	o = gapMust(t, ctx, a, key, "other", "1 minute")
	if o.Outcome != "mismatch" {
		t.Errorf("other request after yield: %+v", o)
	}
	c3 := gapMust(t, ctx, a, key, "req", "1 minute")
	if c3.Outcome != "claimed" || c3.Attempt == T2 || gapStr(c3.PK) != *P1 || gapStr(c3.Point) != "s2" {
		t.Fatalf("retry after yield: %+v", c3)
	}
	T3 := c3.Attempt
	gapAt(t, ctx, b, "after the retry's takeover", key, gapAnswer{Outcome: "in_progress", Attempt: T3, PK: P1})

	// The answer, in a transaction held open: a duplicate still sees the lease.
	txa, err = a.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := txa.Exec(ctx, `SELECT idem.idem_complete('p', $1, $2, 201, '{}', 'done')`, key, T3); err != nil {
		t.Fatal(err)
	}
	gapAt(t, ctx, b, "during the completion's transaction", key, gapAnswer{Outcome: "in_progress", Attempt: T3, PK: P1})
	if err := txa.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	r := gapAt(t, ctx, b, "after the answer", key, gapAnswer{Outcome: "replay", Attempt: T3, PK: P1})
	if r.Point != nil || r.Saved != nil {
		t.Errorf("replay carries recovery columns: %s %s", gapStr(r.Point), gapStr(r.Saved))
	}
	for _, q := range []string{
		`SELECT idem.idem_extend('p', $1, $2, '1 minute')`,
		`SELECT idem.idem_complete('p', $1, $2, 200, '{}', 'again')`,
		`SELECT idem.idem_step('p', $1, $2, 's3', '3')`,
		`SELECT * FROM idem.idem_recovery('p', $1, $2)`,
	} {
		if _, err := a.Exec(ctx, q, key, T3); sqlCode(err) != "55000" {
			t.Errorf("holder after its answer: %s: %v, want 55000", q, err)
		}
	}
	// The answer is kept the TTL (1 hour) after it was given.
	var keptFor float64
	if err := admin.QueryRow(ctx, `SELECT extract(epoch FROM kept_until - clock_timestamp()) FROM idem.idem_key('p', $1)`, key).Scan(&keptFor); err != nil {
		t.Fatal(err)
	}
	if keptFor < 3500 || keptFor > 3600 {
		t.Errorf("answer kept %v s, want about 3600", keptFor)
	}

	// The answer's TTL runs out: cleanup deletes the key, and the next claim is a new generation.
	pgtest.Exec(t, admin, `UPDATE idem.idempotency_keys SET lease_expires_at = clock_timestamp() - interval '1 second',
		expires_at = clock_timestamp() - interval '1 second' WHERE key = $1`, key)
	if err := b.QueryRow(ctx, `SELECT idem.idem_cleanup(1000)`).Scan(&n); err != nil || n != 1 {
		t.Errorf("cleanup of the expired key: %d %v", n, err)
	}
	c4 := gapMust(t, ctx, a, key, "req", "1 minute")
	if c4.Outcome != "claimed" || gapStr(c4.PK) == *P1 || c4.Point != nil || c4.Attempt <= T3 {
		t.Fatalf("claim after cleanup: %+v", c4)
	}
	if _, err := a.Exec(ctx, `SELECT idem.idem_complete('p', $1, $2, 200, '{}', 'x')`, key, T3); sqlCode(err) != "55000" {
		t.Errorf("old token after a new generation: %v", err)
	}
	// Released: the next request, even the same one, starts a new generation.
	if err := a.QueryRow(ctx, `SELECT idem.idem_release('p', $1, $2)`, key, c4.Attempt).Scan(&ok); err != nil || !ok {
		t.Fatalf("release: %v %v", ok, err)
	}
	c5 := gapAt(t, ctx, b, "after release", key, gapAnswer{Outcome: "claimed"})
	if gapStr(c5.PK) == gapStr(c4.PK) || gapStr(c5.PK) == *P1 || c5.Attempt <= c4.Attempt {
		t.Errorf("claim after release: %+v (previous pk %s)", c5, gapStr(c4.PK))
	}
}

// gapRunOut lets time pass for key's row until its lease ended a second ago: every stored time
// of the row (claim, lease's end, expiry) moves back by the same amount, as if the clock had
// run on; the key's TTL still runs.
func gapRunOut(t *testing.T, admin *pgx.Conn, key string) {
	t.Helper()
	gapShift(t, admin, key, `lease_expires_at - clock_timestamp() + interval '1 second'`)
}

// gapShift moves every stored time of key's row back by the interval expression d (computed on
// the row), as if the clock had run on by d.
func gapShift(t *testing.T, admin *pgx.Conn, key, d string) {
	t.Helper()
	pgtest.Exec(t, admin, `UPDATE idem.idempotency_keys SET lease_expires_at = lease_expires_at - (`+d+`),
		expires_at = expires_at - (`+d+`), claimed_at = claimed_at - (`+d+`) WHERE key = $1`, key)
}

// TestLeaseGapsLateAnswerWhileATakeoverWaits: docs/sql-api.md, "Who may do what to a lease
// claim": a lease run out and not taken over still belongs to its token ("the same (the token
// still holds)"). The holder answers in a transaction held open; a duplicate that comes to take
// the lease over waits for that transaction and then replays the answer, with the generation's
// provider key, and the answer is kept the TTL after it was given (not after the lease's end).
func TestLeaseGapsLateAnswerWhileATakeoverWaits(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, appURL, admin := gapApp(t)
	a := pgtest.Connect(t, appURL)
	b := pgtest.Connect(t, appURL)
	const key = "late"
	c := gapMust(t, ctx, a, key, "req", "1 minute")
	gapRunOut(t, admin, key)
	txa, err := a.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := txa.Exec(ctx, `SELECT idem.idem_complete('p', $1, $2, 201, '{}', 'late answer')`, key, c.Attempt); err != nil {
		t.Fatalf("complete after the lease ran out: %v", err)
	}
	type res struct {
		a   gapAnswer
		err error
	}
	done := make(chan res, 1)
	go func() {
		var r res
		r.err = b.QueryRow(ctx, `SELECT outcome, attempt, provider_key FROM idem.idem_begin(p_principal => 'p', p_key => $1,
			p_action => 'POST /gaps', p_request_sha256 => sha256('req'::bytea), p_ttl => '1 hour', p_lease => '1 minute',
			p_lock_timeout => '20 s')`, key).Scan(&r.a.Outcome, &r.a.Attempt, &r.a.PK)
		done <- r
	}()
	pgtest.WaitUntilBlocked(t, admin, b.PgConn().PID())
	if err := txa.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	r := <-done
	if r.err != nil || r.a.Outcome != "replay" || r.a.Attempt != c.Attempt || gapStr(r.a.PK) != *c.PK {
		t.Fatalf("duplicate that waited on the late answer: %+v %v, want replay of attempt %d with pk %s", r.a, r.err, c.Attempt, *c.PK)
	}
	var keptFor float64
	if err := a.QueryRow(ctx, `SELECT extract(epoch FROM kept_until - clock_timestamp()) FROM idem.idem_key('p', $1)`, key).Scan(&keptFor); err != nil {
		t.Fatal(err)
	}
	if keptFor < 3500 || keptFor > 3600 {
		t.Errorf("late answer kept %v s, want about 3600 (the TTL after the answer)", keptFor)
	}
}

// TestLeaseGapsTransactionalTakeoverUnderIsolation: a transactional claim (p_lease NULL) that
// takes over a lease that ran out, inside REPEATABLE READ and SERIALIZABLE transactions
// (docs/sql-api.md, idem_begin, last item): 40001 when the key's row changed after the snapshot
// (the old holder recorded a step), else a takeover in the same generation that reads the steps;
// the old holder's step waits on it and gets 55000 once it commits with its answer; the answer
// replays with the generation's provider key.
func TestLeaseGapsTransactionalTakeoverUnderIsolation(t *testing.T) {
	t.Parallel()
	for _, iso := range []pgx.TxIsoLevel{pgx.RepeatableRead, pgx.Serializable} {
		iso := iso
		t.Run(string(iso), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			_, appURL, admin := gapApp(t)
			a := pgtest.Connect(t, appURL)
			b := pgtest.Connect(t, appURL)
			const key = "iso"
			c := gapMust(t, ctx, a, key, "req", "1 minute")
			if _, err := a.Exec(ctx, `SELECT idem.idem_step('p', $1, $2, 's1', '1')`, key, c.Attempt); err != nil {
				t.Fatal(err)
			}
			gapRunOut(t, admin, key)

			// The snapshot predates the old holder's second step: 40001.
			tx, err := b.BeginTx(ctx, pgx.TxOptions{IsoLevel: iso})
			if err != nil {
				t.Fatal(err)
			}
			pgtest.Exec(t, tx, `SELECT 1`)
			if _, err := a.Exec(ctx, `SELECT idem.idem_step('p', $1, $2, 's2', '2')`, key, c.Attempt); err != nil {
				t.Fatalf("step of a lease run out, not taken over: %v", err)
			}
			if _, err := gapBegin(ctx, tx, key, "req", ""); sqlCode(err) != "40001" {
				t.Errorf("takeover from a snapshot older than the row: %v, want 40001", err)
			}
			_ = tx.Rollback(ctx)

			// Retried: the takeover, the old holder fenced, the answer.
			tx, err = b.BeginTx(ctx, pgx.TxOptions{IsoLevel: iso})
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = tx.Rollback(ctx) }()
			tk := gapMust(t, ctx, tx, key, "req", "")
			if tk.Outcome != "claimed" || gapStr(tk.PK) != *c.PK || gapStr(tk.Point) != "s2" || gapStr(tk.Saved) != `{"s1": 1, "s2": 2}` {
				t.Fatalf("transactional takeover under %s: %+v %s %s", iso, tk, gapStr(tk.Point), gapStr(tk.Saved))
			}
			done := make(chan error, 1)
			go func() {
				_, err := a.Exec(ctx, `SELECT idem.idem_step('p', $1, $2, 's3', '3')`, key, c.Attempt)
				done <- err
			}()
			pgtest.WaitUntilBlocked(t, admin, a.PgConn().PID())
			if _, err := tx.Exec(ctx, `SELECT idem.idem_complete('p', $1, $2, 200, '{}', 'iso')`, key, tk.Attempt); err != nil {
				t.Fatal(err)
			}
			if err := tx.Commit(ctx); err != nil {
				t.Fatalf("commit of the takeover under %s: %v", iso, err)
			}
			if err := <-done; sqlCode(err) != "55000" {
				t.Errorf("old holder's step after a transactional takeover: %v, want 55000", err)
			}
			r := gapMust(t, ctx, a, key, "req", "1 minute")
			if r.Outcome != "replay" || r.Attempt != tk.Attempt || gapStr(r.PK) != *c.PK {
				t.Errorf("replay after the takeover: %+v", r)
			}
		})
	}
}

// TestLeaseGapsReadersDoNotWaitOnAStep: while the holder's step transaction holds the key's row
// (idem_step locks it until the transaction ends), the readers answer at once: idem_recovery
// ("It reads without a lock"), a duplicate and another request (their answers only read the
// row), idem_key, idem_summary and idem_health as the application, idem_stuck as an operator.
func TestLeaseGapsReadersDoNotWaitOnAStep(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url, appURL, _ := gapApp(t)
	a := pgtest.Connect(t, appURL)
	b := pgtest.Connect(t, appURL)
	ops := pgtest.Connect(t, pgtest.LoginRole(t, url, "idem_operator"))
	const key = "readers"
	c := gapMust(t, ctx, a, key, "req", "1 minute")
	tx, err := a.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, `SELECT idem.idem_step('p', $1, $2, 's1', '1')`, key, c.Attempt); err != nil {
		t.Fatal(err)
	}
	cctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	for _, q := range []struct {
		conn *pgx.Conn
		sql  string
	}{
		{b, `SELECT 1 FROM idem.idem_recovery('p', 'readers', ` + gapItoa(c.Attempt) + `)`},
		{b, `SELECT 1 FROM idem.idem_key('p', 'readers')`},
		{b, `SELECT 1 FROM idem.idem_summary()`},
		{b, `SELECT 1 FROM idem.idem_health()`},
		{ops, `SELECT 1 FROM idem.idem_stuck()`},
		{ops, `SELECT 1 FROM idem.idem_key('p', 'readers')`},
	} {
		if _, err := q.conn.Exec(cctx, q.sql); err != nil {
			t.Errorf("%s during a step's transaction: %v", q.sql, err)
		}
	}
	gapAt(t, cctx, b, "during a step's transaction", key, gapAnswer{Outcome: "in_progress", Attempt: c.Attempt, PK: c.PK})
}

func gapItoa(n int64) string { return strconv.FormatInt(n, 10) }

// TestLeaseGapsRoles: what the application role and the operator role may do to one lease
// claim (docs/sql-api.md, "For operators"; docs/operations.md, "Who may do what"): the operator
// lists the claim with its token and provider key, releases it as stuck (the stuck holder is
// fenced: 55000 for its step, its answer and its heartbeat), and the client's retry takes it
// over in the same generation; the operator may not call the application's API, and the
// application may not call idem_stuck, idem_release_stuck or idem_key_body (42501).
func TestLeaseGapsRoles(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url, appURL, _ := gapApp(t)
	a := pgtest.Connect(t, appURL)
	ops := pgtest.Connect(t, pgtest.LoginRole(t, url, "idem_operator"))
	const key = "roles"
	c := gapMust(t, ctx, a, key, "req", "1 minute")
	if _, err := a.Exec(ctx, `SELECT idem.idem_step('p', $1, $2, 's1', '1')`, key, c.Attempt); err != nil {
		t.Fatal(err)
	}
	var tok int64
	var pk string
	var runOut bool
	if err := ops.QueryRow(ctx, `SELECT attempt, provider_key, lease_run_out FROM idem.idem_stuck() WHERE key = $1`, key).Scan(&tok, &pk, &runOut); err != nil {
		t.Fatalf("idem_stuck: %v", err)
	}
	if tok != c.Attempt || pk != *c.PK || runOut {
		t.Errorf("idem_stuck: token %d pk %s run out %v, want %d %s false", tok, pk, runOut, c.Attempt, *c.PK)
	}
	for _, q := range []string{
		`SELECT idem.idem_stuck()`,
		`SELECT idem.idem_release_stuck('p', 'roles', ` + gapItoa(c.Attempt) + `, 'app')`,
		`SELECT idem.idem_key_body('p', 'roles')`,
	} {
		if _, err := a.Exec(ctx, q); sqlCode(err) != "42501" {
			t.Errorf("as the application: %s: %v, want 42501", q, err)
		}
	}
	for _, q := range []string{
		`SELECT idem.idem_begin('p', 'roles', 'POST /gaps', sha256('req'::bytea))`,
		`SELECT idem.idem_begin_steps('p', 'roles', 'POST /gaps', sha256('req'::bytea))`,
		`SELECT idem.idem_step('p', 'roles', ` + gapItoa(c.Attempt) + `, 'x')`,
		`SELECT idem.idem_recovery('p', 'roles', ` + gapItoa(c.Attempt) + `)`,
		`SELECT idem.idem_extend('p', 'roles', ` + gapItoa(c.Attempt) + `, '1 hour')`,
		`SELECT idem.idem_complete('p', 'roles', ` + gapItoa(c.Attempt) + `, 200, '{}', 'x')`,
		`SELECT idem.idem_yield('p', 'roles', ` + gapItoa(c.Attempt) + `)`,
		`SELECT idem.idem_release('p', 'roles', ` + gapItoa(c.Attempt) + `)`,
		`SELECT idem.idem_save_final('p', 'roles2', 'POST /gaps', sha256('req'::bytea), NULL, 404, '{}', 'x')`,
		`SELECT idem.idem_cleanup(1000)`,
		`SELECT * FROM idem.idem_cleanup_workers()`,
	} {
		if _, err := ops.Exec(ctx, q); sqlCode(err) != "42501" {
			t.Errorf("as an operator: %s: %v, want 42501", q, err)
		}
	}
	if _, err := ops.Exec(ctx, `CALL idem.idem_cleanup_all(10)`); sqlCode(err) != "42501" {
		t.Errorf("as an operator: idem_cleanup_all: %v, want 42501", err)
	}
	// The operator releases it as stuck: the holder is fenced, the retry takes over with the
	// same provider key and the steps.
	if _, err := ops.Exec(ctx, `SELECT idem.idem_release_stuck('p', $1, $2, 'test')`, key, c.Attempt); err != nil {
		t.Fatalf("idem_release_stuck: %v", err)
	}
	if n := pgtest.Count(t, ops, `SELECT count(*) FROM idem.idem_stuck() WHERE key = 'roles'`); n != 0 {
		t.Errorf("released claim still listed as stuck: %d", n)
	}
	for _, q := range []string{
		`SELECT idem.idem_step('p', $1, $2, 's2', '2')`,
		`SELECT idem.idem_complete('p', $1, $2, 200, '{}', 'stale')`,
		`SELECT idem.idem_extend('p', $1, $2, '1 minute')`,
	} {
		if _, err := a.Exec(ctx, q, key, c.Attempt); sqlCode(err) != "55000" {
			t.Errorf("stuck holder after idem_release_stuck: %s: %v, want 55000", q, err)
		}
	}
	if _, err := ops.Exec(ctx, `SELECT idem.idem_release_stuck('p', $1, $2, 'again')`, key, c.Attempt); sqlCode(err) != "55000" {
		t.Errorf("idem_release_stuck with the old token: %v, want 55000", err)
	}
	o := gapMust(t, ctx, a, key, "other", "1 minute")
	if o.Outcome != "mismatch" {
		t.Errorf("another request after idem_release_stuck: %+v, want mismatch", o)
	}
	r := gapMust(t, ctx, a, key, "req", "1 minute")
	if r.Outcome != "claimed" || gapStr(r.PK) != *c.PK || gapStr(r.Point) != "s1" {
		t.Errorf("retry after idem_release_stuck: %+v point %s", r, gapStr(r.Point))
	}
	if err := ops.QueryRow(ctx, `SELECT attempt, provider_key FROM idem.idem_stuck() WHERE key = $1`, key).Scan(&tok, &pk); err != nil || tok != r.Attempt || pk != *c.PK {
		t.Errorf("idem_stuck after the takeover: %d %s %v, want %d %s", tok, pk, err, r.Attempt, *c.PK)
	}
}

// TestLeaseGapsRecoveryUnderRepeatableReadReadsTheSnapshot: idem_recovery reads without a
// lock, from the caller's snapshot (docs/sql-api.md): in a transaction whose snapshot predates
// a takeover, it still answers the old token's steps (a review took that for a broken fence:
// the page now says so), and the old holder learns of the takeover from its next write, 40001
// in that transaction; at READ COMMITTED the same call raises 55000.
func TestLeaseGapsRecoveryUnderRepeatableReadReadsTheSnapshot(t *testing.T) {
	t.Parallel()
	for _, iso := range []pgx.TxIsoLevel{pgx.RepeatableRead, pgx.Serializable} {
		iso := iso
		t.Run(string(iso), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			_, appURL, admin := gapApp(t)
			a := pgtest.Connect(t, appURL)
			b := pgtest.Connect(t, appURL)
			const key = "rr"
			c := gapMust(t, ctx, a, key, "req", "1 minute")
			if _, err := a.Exec(ctx, `SELECT idem.idem_step('p', $1, $2, 's1', '1')`, key, c.Attempt); err != nil {
				t.Fatal(err)
			}
			gapRunOut(t, admin, key)
			tx, err := a.BeginTx(ctx, pgx.TxOptions{IsoLevel: iso})
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = tx.Rollback(ctx) }()
			pgtest.Exec(t, tx, `SELECT 1`) // the snapshot
			tk := gapMust(t, ctx, b, key, "req", "1 minute")
			if tk.Outcome != "claimed" {
				t.Fatalf("takeover: %+v", tk)
			}
			var point string
			err = tx.QueryRow(ctx, `SELECT recovery_point FROM idem.idem_recovery('p', $1, $2)`, key, c.Attempt).Scan(&point)
			if err != nil || point != "s1" {
				t.Errorf("idem_recovery of a token taken over after the snapshot (attempt %d, now %d) under %s: %q %v, want the snapshot's s1",
					c.Attempt, tk.Attempt, iso, point, err)
			}
			if _, err := tx.Exec(ctx, `SELECT idem.idem_step('p', $1, $2, 's2', '2')`, key, c.Attempt); sqlCode(err) != "40001" {
				t.Errorf("the old holder's next step in that transaction: %v, want 40001", err)
			}
			if _, err := b.Exec(ctx, `SELECT idem.idem_recovery('p', $1, $2)`, key, c.Attempt); sqlCode(err) != "55000" {
				t.Errorf("the same under READ COMMITTED: %v, want 55000", err)
			}
		})
	}
}

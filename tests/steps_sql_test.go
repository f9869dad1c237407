package tests

// Work in steps and leases from SQL, as a service in another language would use them: every
// call goes over pgx as a login role that is only a member of idem_app (docs/sql-api.md,
// "idem.idem_yield", "idem.idem_extend", "Who may do what to a lease claim", "Work in steps",
// "idem.idem_recovery", "idem.idem_begin_steps", "How long a key lives").

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/internal/pgtest"
)

func ssCode(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code
	}
	if err == nil {
		return "ok"
	}
	return "?" + err.Error()
}

type ssAns struct {
	Outcome string
	Attempt int64
	PK      *string
	Retry   *float64
	Point   *string
	Saved   *string
}

type ssQ interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

func ssNull(s string) any {
	if s == "" {
		return nil
	}
	return s
}

// ssBeginErr: idem_begin_steps for principal p, action POST /x, the body's sha256.
func ssBeginErr(q ssQ, key, body, lease, ttl string, extra ...string) (ssAns, error) {
	var a ssAns
	lt := ""
	if len(extra) > 0 {
		lt = extra[0]
	}
	err := q.QueryRow(context.Background(), `SELECT outcome, attempt, provider_key, extract(epoch FROM retry_after)::float8,
		recovery_point, recovery_saved::text
		FROM idem.idem_begin_steps('p', $1, 'POST /x', sha256($2::bytea), p_lease => $3::interval, p_ttl => $4::interval,
		                           p_lock_timeout => $5::interval)`,
		key, body, ssNull(lease), ssNull(ttl), ssNull(lt)).Scan(&a.Outcome, &a.Attempt, &a.PK, &a.Retry, &a.Point, &a.Saved)
	return a, err
}

func ssBegin(t *testing.T, q ssQ, key, body, lease, ttl string) ssAns {
	t.Helper()
	a, err := ssBeginErr(q, key, body, lease, ttl)
	if err != nil {
		t.Fatalf("idem_begin_steps(%s, %s): %v", key, body, err)
	}
	return a
}

func ssStr(p *string) string {
	if p == nil {
		return "<nil>"
	}
	return *p
}

// ssRow is the key's row as the superuser reads it.
func ssRow(t *testing.T, admin ssQ, key string) string {
	t.Helper()
	var s *string
	if err := admin.QueryRow(context.Background(), `SELECT row_to_json(k)::text FROM idem.idempotency_keys AS k WHERE principal_id = 'p' AND key = $1`, key).Scan(&s); err != nil && !errors.Is(err, pgx.ErrNoRows) {
		t.Fatal(err)
	}
	return ssStr(s)
}

type ssEnv struct {
	app    *pgxpool.Pool
	admin  *pgxpool.Pool
	url    string
	appURL string
}

func ssSetup(t *testing.T) ssEnv {
	t.Helper()
	url := pgtest.NewDB(t)
	appURL := pgtest.LoginRole(t, url, "idem_app")
	cfg, err := pgxpool.ParseConfig(appURL)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 12
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	var member bool
	if err := pool.QueryRow(context.Background(), `SELECT pg_has_role(current_user, 'idem_app', 'MEMBER') AND NOT (SELECT rolsuper FROM pg_roles WHERE rolname = current_user)`).Scan(&member); err != nil || !member {
		t.Fatalf("not a plain idem_app member: %v %v", member, err)
	}
	admin, err := pgxpool.New(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(admin.Close)
	return ssEnv{app: pool, admin: admin, url: url, appURL: appURL}
}

var ssKeys atomic.Int64

func ssKey(prefix string) string { return fmt.Sprintf("%s-%d", prefix, ssKeys.Add(1)) }

// ssRefused runs every holder operation with token tok and checks that each is refused
// (55000, or false) and changes nothing.
func ssRefused(t *testing.T, e ssEnv, key string, tok int64, who string) {
	t.Helper()
	ctx := context.Background()
	before := ssRow(t, e.admin, key)
	for _, q := range []string{
		`SELECT idem.idem_extend('p', $1, $2, '1 hour')::text`,
		`SELECT idem.idem_complete('p', $1, $2, 200, '{}', 'late')::text`,
		`SELECT idem.idem_step('p', $1, $2, 'late', '"x"')::text`,
		`SELECT recovery_point FROM idem.idem_recovery('p', $1, $2)`,
	} {
		var s *string
		if err := e.app.QueryRow(ctx, q, key, tok).Scan(&s); ssCode(err) != "55000" {
			t.Errorf("%s: %s: got %v (%v), want 55000", who, q, ssStr(s), err)
		}
	}
	for _, q := range []string{`SELECT idem.idem_yield('p', $1, $2)`, `SELECT idem.idem_release('p', $1, $2)`} {
		var ok bool
		if err := e.app.QueryRow(ctx, q, key, tok).Scan(&ok); err != nil || ok {
			t.Errorf("%s: %s: got %v %v, want false", who, q, ok, err)
		}
	}
	if after := ssRow(t, e.admin, key); after != before {
		t.Errorf("%s: a refused call changed the row:\n before %s\n after  %s", who, before, after)
	}
}

// ssAllowed checks that the holder with token tok may extend, step, read its recovery,
// complete, yield and release (each on a fresh copy of the state, made by build).
func ssAllowed(t *testing.T, e ssEnv, build func(*testing.T) (string, int64, int64, string), who string) {
	t.Helper()
	ctx := context.Background()
	key, tok, _, _ := build(t)
	var end time.Time
	if err := e.app.QueryRow(ctx, `SELECT idem.idem_extend('p', $1, $2, '1 hour')`, key, tok).Scan(&end); err != nil || time.Until(end) < 59*time.Minute {
		t.Errorf("%s: extend: %v %v", who, end, err)
	}
	if _, err := e.app.Exec(ctx, `SELECT idem.idem_step('p', $1, $2, 'mine', '1')`, key, tok); err != nil {
		t.Errorf("%s: step: %v", who, err)
	}
	var point *string
	if err := e.app.QueryRow(ctx, `SELECT recovery_point FROM idem.idem_recovery('p', $1, $2)`, key, tok).Scan(&point); err != nil || ssStr(point) != "mine" {
		t.Errorf("%s: recovery: %v %v", who, ssStr(point), err)
	}
	if _, err := e.app.Exec(ctx, `SELECT idem.idem_complete('p', $1, $2, 201, '{}', 'done')`, key, tok); err != nil {
		t.Errorf("%s: complete: %v", who, err)
	}
	for _, fn := range []string{"idem_yield", "idem_release"} {
		key, tok, _, _ := build(t)
		var ok bool
		if err := e.app.QueryRow(ctx, `SELECT idem.`+fn+`('p', $1, $2)`, key, tok).Scan(&ok); err != nil || !ok {
			t.Errorf("%s: %s: %v %v, want true", who, fn, ok, err)
		}
	}
}

// TestStepsSQLWhoMayDoWhat: every cell of "Who may do what to a lease claim".
func TestStepsSQLWhoMayDoWhat(t *testing.T) {
	t.Parallel()
	e := ssSetup(t)
	ctx := context.Background()
	const short = 150 * time.Millisecond // a lease of 100 ms has run out after it

	// Each builder returns the key, its holder's token, an older (stale) token, and the
	// generation's provider key.
	type state struct {
		name         string
		build        func(t *testing.T) (string, int64, int64, string)
		holderMay    bool   // the holder may do everything
		sameRequest  string // outcome of the same request again
		samePK       bool   // same provider key as the generation's
		otherRequest string
	}
	// staleThen: a first claim whose lease (100 ms) ran out, taken over by the same request
	// with lease; the first token is the stale holder's.
	staleThen := func(t *testing.T, key, lease, ttl string) (int64, int64, string) {
		first := ssBegin(t, e.app, key, "body", "100 ms", "1 hour")
		time.Sleep(short)
		second := ssBegin(t, e.app, key, "body", lease, ttl)
		if second.Outcome != "claimed" || second.Attempt == first.Attempt || ssStr(second.PK) != ssStr(first.PK) {
			t.Fatalf("takeover: %+v after %+v", second, first)
		}
		pgtest.Exec(t, e.app, `SELECT idem.idem_step('p', $1, $2, 'a', '{"id": 41}')`, key, second.Attempt)
		return second.Attempt, first.Attempt, ssStr(first.PK)
	}
	states := []state{
		{name: "running", holderMay: true, sameRequest: "in_progress", samePK: true, otherRequest: "mismatch",
			build: func(t *testing.T) (string, int64, int64, string) {
				key := ssKey("running")
				h, s, pk := staleThen(t, key, "1 minute", "1 hour")
				return key, h, s, pk
			}},
		{name: "given up", sameRequest: "claimed", samePK: true, otherRequest: "mismatch",
			build: func(t *testing.T) (string, int64, int64, string) {
				key := ssKey("yielded")
				h, s, pk := staleThen(t, key, "1 minute", "1 hour")
				var ok bool
				if err := e.app.QueryRow(ctx, `SELECT idem.idem_yield('p', $1, $2)`, key, h).Scan(&ok); err != nil || !ok {
					t.Fatalf("yield: %v %v", ok, err)
				}
				return key, h, s, pk
			}},
		{name: "run out", holderMay: true, sameRequest: "claimed", samePK: true, otherRequest: "mismatch",
			build: func(t *testing.T) (string, int64, int64, string) {
				key := ssKey("runout")
				h, s, pk := staleThen(t, key, "100 ms", "1 hour")
				time.Sleep(short)
				return key, h, s, pk
			}},
		{name: "completed", sameRequest: "replay", samePK: true, otherRequest: "mismatch",
			build: func(t *testing.T) (string, int64, int64, string) {
				key := ssKey("completed")
				h, s, pk := staleThen(t, key, "1 minute", "1 hour")
				pgtest.Exec(t, e.app, `SELECT idem.idem_complete('p', $1, $2, 201, '{}', 'done')`, key, h)
				return key, h, s, pk
			}},
		{name: "released", sameRequest: "claimed", otherRequest: "claimed",
			build: func(t *testing.T) (string, int64, int64, string) {
				key := ssKey("released")
				h, s, pk := staleThen(t, key, "1 minute", "1 hour")
				var ok bool
				if err := e.app.QueryRow(ctx, `SELECT idem.idem_release('p', $1, $2)`, key, h).Scan(&ok); err != nil || !ok {
					t.Fatalf("release: %v %v", ok, err)
				}
				return key, h, s, pk
			}},
		{name: "expired past the lease", sameRequest: "claimed", otherRequest: "claimed",
			build: func(t *testing.T) (string, int64, int64, string) {
				key := ssKey("expired")
				h, s, pk := staleThen(t, key, "100 ms", "100 ms")
				time.Sleep(2 * short)
				return key, h, s, pk
			}},
		{name: "expired past the answer", sameRequest: "claimed", otherRequest: "claimed",
			build: func(t *testing.T) (string, int64, int64, string) {
				key := ssKey("expiredanswer")
				h, s, pk := staleThen(t, key, "1 hour", "100 ms")
				pgtest.Exec(t, e.app, `SELECT idem.idem_complete('p', $1, $2, 201, '{}', 'done')`, key, h)
				time.Sleep(short)
				return key, h, s, pk
			}},
	}
	for _, st := range states {
		st := st
		t.Run(st.name, func(t *testing.T) {
			t.Parallel()
			// The holder.
			if st.holderMay {
				ssAllowed(t, e, st.build, "holder")
			} else {
				key, h, _, _ := st.build(t)
				ssRefused(t, e, key, h, "holder")
			}
			// A stale holder.
			key, _, s, _ := st.build(t)
			ssRefused(t, e, key, s, "stale holder")
			// The same request again.
			key, h, _, pk := st.build(t)
			a := ssBegin(t, e.app, key, "body", "1 minute", "1 hour")
			if a.Outcome != st.sameRequest {
				t.Errorf("same request: %+v, want %s", a, st.sameRequest)
			}
			if a.Outcome != "mismatch" && (ssStr(a.PK) == pk) != st.samePK {
				t.Errorf("same request: provider key %s, generation's %s, want the same: %v", ssStr(a.PK), pk, st.samePK)
			}
			if a.Outcome != "claimed" && (a.Point != nil || a.Saved != nil) {
				t.Errorf("same request, %s: recovery columns %s %s, want NULL", a.Outcome, ssStr(a.Point), ssStr(a.Saved))
			}
			switch a.Outcome {
			case "claimed":
				if a.Attempt == h {
					t.Errorf("same request: claimed with the holder's token")
				}
				if st.samePK && ssStr(a.Point) != "a" {
					t.Errorf("same request, same generation: recovery_point %s, want a", ssStr(a.Point))
				}
				if !st.samePK && (a.Point != nil || a.Saved != nil) {
					t.Errorf("same request, new generation: recovery %s %s, want none", ssStr(a.Point), ssStr(a.Saved))
				}
			case "in_progress":
				if a.Retry == nil || *a.Retry <= 0 || *a.Retry > 60 || a.Attempt != h {
					t.Errorf("same request in progress: retry_after %v attempt %d (holder %d)", a.Retry, a.Attempt, h)
				}
			}
			// Another request.
			key, _, _, pk = st.build(t)
			o := ssBegin(t, e.app, key, "other body", "1 minute", "1 hour")
			if o.Outcome != st.otherRequest {
				t.Errorf("another request: %+v, want %s", o, st.otherRequest)
			}
			if o.Outcome == "mismatch" && (o.Point != nil || o.Saved != nil || o.PK != nil) {
				t.Errorf("another request, mismatch: recovery columns or provider key set: %+v", o)
			}
			if o.Outcome == "claimed" && (ssStr(o.PK) == pk || o.Point != nil || o.Saved != nil) {
				t.Errorf("another request claimed with the old generation's provider key or steps: %+v", o)
			}
		})
	}
}

// TestStepsSQLErrorsLeaveTheTransactionAborted: a step recorded twice (23505) and a step
// after a takeover (55000) abort the caller's transaction; its writes never commit.
func TestStepsSQLErrorsLeaveTheTransactionAborted(t *testing.T) {
	t.Parallel()
	e := ssSetup(t)
	ctx := context.Background()
	conn := pgtest.Connect(t, e.appURL)
	pgtest.Exec(t, conn, `CREATE TEMP TABLE steps_work (id int)`)
	check := func(name, key string, tok int64, step, want string) {
		t.Helper()
		tx, err := conn.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		pgtest.Exec(t, tx, `INSERT INTO steps_work VALUES (1)`)
		_, err = tx.Exec(ctx, `SELECT idem.idem_step('p', $1, $2, $3, '"again"')`, key, tok, step)
		if ssCode(err) != want {
			t.Errorf("%s: %v, want %s", name, err, want)
		}
		if _, err := tx.Exec(ctx, `SELECT 1`); ssCode(err) != "25P02" {
			t.Errorf("%s: next statement in the transaction: %v, want 25P02 (aborted)", name, err)
		}
		if err := tx.Commit(ctx); !errors.Is(err, pgx.ErrTxCommitRollback) {
			t.Errorf("%s: COMMIT: %v, want a rollback", name, err)
		}
		if n := pgtest.Count(t, conn, `SELECT count(*) FROM steps_work`); n != 0 {
			t.Errorf("%s: %d writes of the step's transaction committed", name, n)
		}
	}
	key := ssKey("twice")
	a := ssBegin(t, e.app, key, "body", "100 ms", "1 hour")
	pgtest.Exec(t, e.app, `SELECT idem.idem_step('p', $1, $2, 'one', '1')`, key, a.Attempt)
	before := ssRow(t, e.admin, key)
	check("step twice", key, a.Attempt, "one", "23505")
	if ssRow(t, e.admin, key) != before {
		t.Errorf("a refused step changed the row")
	}
	// After a takeover in the same generation the step is still recorded: 23505 for the new holder.
	time.Sleep(150 * time.Millisecond)
	b := ssBegin(t, e.app, key, "body", "1 minute", "1 hour")
	if b.Outcome != "claimed" || ssStr(b.Saved) != `{"one": 1}` {
		t.Fatalf("takeover: %+v", b)
	}
	check("step of the same name by the new holder", key, b.Attempt, "one", "23505")
	check("step by the taken-over holder", key, a.Attempt, "two", "55000")
	var saved string
	if err := e.app.QueryRow(ctx, `SELECT recovery_saved::text FROM idem.idem_recovery('p', $1, $2)`, key, b.Attempt).Scan(&saved); err != nil || saved != `{"one": 1}` {
		t.Errorf("recovery after the refused steps: %s %v", saved, err)
	}
}

// TestStepsSQLSavedLimit: 8192 bytes of recovery_saved::text pass, one byte more is 22023.
func TestStepsSQLSavedLimit(t *testing.T) {
	t.Parallel()
	e := ssSetup(t)
	ctx := context.Background()
	size := func(key string, tok int64) int {
		return pgtest.Count(t, e.app, `SELECT octet_length(recovery_saved::text) FROM idem.idem_recovery('p', $1, $2)`, key, tok)
	}
	// One step: {"a": "xxx"} is 9 bytes plus the string.
	for _, tc := range []struct {
		n    int
		want string
	}{{8183, "ok"}, {8184, "22023"}} {
		key := ssKey("one")
		a := ssBegin(t, e.app, key, "body", "1 minute", "1 hour")
		_, err := e.app.Exec(ctx, `SELECT idem.idem_step('p', $1, $2, 'a', to_jsonb(repeat('x', $3)))`, key, a.Attempt, tc.n)
		if ssCode(err) != tc.want {
			t.Errorf("one step of %d bytes: %v, want %s", tc.n+9, err, tc.want)
		}
		if tc.want == "ok" && size(key, a.Attempt) != 8192 {
			t.Errorf("size %d", size(key, a.Attempt))
		}
	}
	// Two steps: {"a": 1, "b": "x..."}: the comma and colons with their spaces count.
	for _, tc := range []struct {
		n    int
		want string
	}{{8192 - len(`{"a": 1, "b": ""}`), "ok"}, {8193 - len(`{"a": 1, "b": ""}`), "22023"}} {
		key := ssKey("two")
		a := ssBegin(t, e.app, key, "body", "1 minute", "1 hour")
		pgtest.Exec(t, e.app, `SELECT idem.idem_step('p', $1, $2, 'a', '1')`, key, a.Attempt)
		_, err := e.app.Exec(ctx, `SELECT idem.idem_step('p', $1, $2, 'b', to_jsonb(repeat('x', $3)))`, key, a.Attempt, tc.n)
		if ssCode(err) != tc.want {
			t.Errorf("second step to %d bytes: %v, want %s", tc.n+len(`{"a": 1, "b": ""}`), err, tc.want)
		}
		if tc.want == "22023" {
			// The transaction (autocommit) rolled back; the first step stays, the next small one fits.
			if s := size(key, a.Attempt); s != len(`{"a": 1}`) {
				t.Errorf("after the refused step: %d bytes", s)
			}
		}
	}
	// Bytes, not characters: 2730 euro signs (3 bytes) and 2 x's; escapes count as written.
	key := ssKey("bytes")
	a := ssBegin(t, e.app, key, "body", "1 minute", "1 hour")
	if _, err := e.app.Exec(ctx, `SELECT idem.idem_step('p', $1, $2, 'a', to_jsonb(repeat('€', 2727) || 'xx'))`, key, a.Attempt); err != nil {
		t.Errorf("9 + 8183 bytes with euro signs: %v", err)
	}
	key = ssKey("bytes")
	a = ssBegin(t, e.app, key, "body", "1 minute", "1 hour")
	if _, err := e.app.Exec(ctx, `SELECT idem.idem_step('p', $1, $2, 'a', to_jsonb(repeat('€', 2728)))`, key, a.Attempt); ssCode(err) != "22023" {
		t.Errorf("9 + 8184 bytes with euro signs: %v, want 22023", err)
	}
	key = ssKey("escapes")
	a = ssBegin(t, e.app, key, "body", "1 minute", "1 hour")
	// Quotes are written \" : 4092 of them are 8184 bytes of string, 8193 in all.
	if _, err := e.app.Exec(ctx, `SELECT idem.idem_step('p', $1, $2, 'a', to_jsonb(repeat('"', 4092)))`, key, a.Attempt); ssCode(err) != "22023" {
		t.Errorf("4092 quotes (8184 bytes escaped + 9): %v, want 22023", err)
	}
	// SQL NULL is stored as JSON null.
	pgtest.Exec(t, e.app, `SELECT idem.idem_step('p', $1, $2, 'n')`, key, a.Attempt)
	var saved string
	if err := e.app.QueryRow(ctx, `SELECT recovery_saved::text FROM idem.idem_recovery('p', $1, $2)`, key, a.Attempt).Scan(&saved); err != nil || saved != `{"n": null}` {
		t.Errorf("SQL NULL saved: %s %v", saved, err)
	}
	// Bad names and arguments.
	for q, want := range map[string]string{
		`SELECT idem.idem_step('p', $1, $2, repeat('s', 256))`: "22023",
		`SELECT idem.idem_step('p', $1, $2, '')`:               "22023",
		`SELECT idem.idem_step('p', $1, $2, NULL)`:             "22004",
		`SELECT idem.idem_step('p', $1, NULL::bigint, 's')`:    "22004",
		`SELECT idem.idem_step('p', $1 || ' ', $2, 's')`:       "22023",
		`SELECT * FROM idem.idem_recovery('p', $1, NULL)`:      "22004",
		`SELECT * FROM idem.idem_recovery('', $1, $2)`:         "22023",
	} {
		args := []any{key, a.Attempt}
		if !strings.Contains(q, "$2") {
			args = args[:1]
		}
		if _, err := e.app.Exec(ctx, q, args...); ssCode(err) != want {
			t.Errorf("%s: %v, want %s", q, err, want)
		}
	}
	if _, err := e.app.Exec(ctx, `SELECT idem.idem_step('p', $1, $2, repeat('é', 255))`, key, a.Attempt); err != nil {
		t.Errorf("255 characters of name (510 bytes): %v", err)
	}
}

// TestStepsSQLTakeoverWaitsOnTheStep: a takeover that comes while the holder's step is
// uncommitted waits for it (bounded by its lock timeout) and reads the step; the holder whose
// takeover committed first gets 55000.
func TestStepsSQLTakeoverWaitsOnTheStep(t *testing.T) {
	t.Parallel()
	e := ssSetup(t)
	ctx := context.Background()
	holder := pgtest.Connect(t, e.appURL)
	other := pgtest.Connect(t, e.appURL)
	for _, commit := range []bool{true, false} {
		key := ssKey("wait")
		a := ssBegin(t, e.app, key, "body", "100 ms", "1 hour")
		tx, err := holder.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(ctx, `SELECT idem.idem_step('p', $1, $2, 'charge', '"ch_7"')`, key, a.Attempt); err != nil {
			t.Fatal(err)
		}
		time.Sleep(150 * time.Millisecond) // the lease runs out while the step is uncommitted
		// Bounded by the takeover's lock timeout.
		if _, err := ssBeginErr(e.app, key, "body", "1 minute", "1 hour", "100 ms"); ssCode(err) != "55P03" {
			t.Errorf("takeover with a lock timeout of 100 ms under an uncommitted step: %v, want 55P03", err)
		}
		done := make(chan ssAns, 1)
		errs := make(chan error, 1)
		go func() {
			b, err := ssBeginErr(other, key, "body", "1 minute", "1 hour", "10 s")
			done <- b
			errs <- err
		}()
		pgtest.WaitUntilBlocked(t, e.admin, other.PgConn().PID())
		if commit {
			if err := tx.Commit(ctx); err != nil {
				t.Fatal(err)
			}
		} else {
			_ = tx.Rollback(ctx)
		}
		b, err := <-done, <-errs
		if err != nil || b.Outcome != "claimed" {
			t.Fatalf("takeover after the step's transaction ended (commit %v): %+v %v", commit, b, err)
		}
		if commit && ssStr(b.Point) != "charge" {
			t.Errorf("takeover after the step committed: recovery %s %s, want charge", ssStr(b.Point), ssStr(b.Saved))
		}
		if !commit && (b.Point != nil || b.Saved != nil) {
			t.Errorf("takeover after the step rolled back: recovery %s %s, want none", ssStr(b.Point), ssStr(b.Saved))
		}
	}
	// The other order: the takeover holds the row uncommitted; the holder's step waits for it.
	for _, commit := range []bool{true, false} {
		key := ssKey("order")
		a := ssBegin(t, e.app, key, "body", "100 ms", "1 hour")
		time.Sleep(150 * time.Millisecond)
		tx, err := other.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		b := ssBegin(t, tx, key, "body", "1 minute", "1 hour")
		if b.Outcome != "claimed" {
			t.Fatalf("takeover: %+v", b)
		}
		errs := make(chan error, 1)
		go func() {
			_, err := holder.Exec(ctx, `SELECT idem.idem_step('p', $1, $2, 'charge', '"ch_7"')`, key, a.Attempt)
			errs <- err
		}()
		pgtest.WaitUntilBlocked(t, e.admin, holder.PgConn().PID())
		if commit {
			if err := tx.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			if err := <-errs; ssCode(err) != "55000" {
				t.Errorf("holder's step after the takeover committed: %v, want 55000", err)
			}
		} else {
			_ = tx.Rollback(ctx)
			if err := <-errs; err != nil {
				t.Errorf("holder's step after the takeover rolled back: %v, want it recorded", err)
			}
		}
	}
	// The holder's heartbeat waits for its own step's transaction too, and then extends.
	key := ssKey("beat")
	a := ssBegin(t, e.app, key, "body", "1 minute", "1 hour")
	tx, err := holder.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `SELECT idem.idem_step('p', $1, $2, 's', '1')`, key, a.Attempt); err != nil {
		t.Fatal(err)
	}
	errs := make(chan error, 1)
	go func() {
		var end time.Time
		errs <- other.QueryRow(ctx, `SELECT idem.idem_extend('p', $1, $2, '1 hour')`, key, a.Attempt).Scan(&end)
	}()
	pgtest.WaitUntilBlocked(t, e.admin, other.PgConn().PID())
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-errs; err != nil {
		t.Errorf("extend after the step committed: %v", err)
	}
}

// TestStepsSQLExtend: bounds, return value, never shortens, the key's expiry moves by as much.
func TestStepsSQLExtend(t *testing.T) {
	t.Parallel()
	e := ssSetup(t)
	ctx := context.Background()
	key := ssKey("extend")
	a := ssBegin(t, e.app, key, "body", "1 minute", "1 hour")
	for lease, want := range map[string]string{
		"0":                 "22023",
		"-1 second":         "22023",
		"1 day -1 hour":     "22023",
		"1 mon -29 days":    "22023",
		"3601 days":         "22023",
		"10 years 1 second": "22023",
		"120 mons 1 second": "22023",
		"-1 year 400 days":  "22023",
		"1 microsecond":     "ok",
		"10 years":          "ok",
		"3600 days":         "ok",
		"1 day":             "ok",
	} {
		before := ssRow(t, e.admin, key)
		var end time.Time
		err := e.app.QueryRow(ctx, `SELECT idem.idem_extend('p', $1, $2, $3::interval)`, key, a.Attempt, lease).Scan(&end)
		if ssCode(err) != want {
			t.Errorf("extend by %s: %v, want %s", lease, err, want)
		}
		if want != "ok" && ssRow(t, e.admin, key) != before {
			t.Errorf("extend by %s changed the row", lease)
		}
	}
	if _, err := e.app.Exec(ctx, `SELECT idem.idem_extend('p', $1, $2, NULL)`, key, a.Attempt); ssCode(err) != "22004" {
		t.Errorf("NULL lease: %v", err)
	}

	// Return value and never shortening, on a fresh key.
	key = ssKey("extend")
	a = ssBegin(t, e.app, key, "body", "1 minute", "1 hour")
	var gap0 time.Duration
	readRow := func() (lease, expires time.Time) {
		if err := e.admin.QueryRow(ctx, `SELECT lease_expires_at, expires_at FROM idem.idempotency_keys WHERE principal_id = 'p' AND key = $1`, key).Scan(&lease, &expires); err != nil {
			t.Fatal(err)
		}
		return
	}
	l0, x0 := readRow()
	gap0 = x0.Sub(l0)
	if gap0 != time.Hour {
		t.Errorf("a lease claim's expiry is %v past its lease, want the TTL (1h)", gap0)
	}
	var now, end time.Time
	if err := e.app.QueryRow(ctx, `SELECT clock_timestamp(), idem.idem_extend('p', $1, $2, '2 hours')`, key, a.Attempt).Scan(&now, &end); err != nil {
		t.Fatal(err)
	}
	l1, x1 := readRow()
	if !end.Equal(l1) || end.Sub(now) < 2*time.Hour || end.Sub(now) > 2*time.Hour+time.Second {
		t.Errorf("extend returned %v, lease in the row %v, asked at %v", end, l1, now)
	}
	if x1.Sub(l1) != time.Hour {
		t.Errorf("after extend the key lives %v past the lease, want the TTL", x1.Sub(l1))
	}
	var end2 time.Time
	if err := e.app.QueryRow(ctx, `SELECT idem.idem_extend('p', $1, $2, '1 minute')`, key, a.Attempt).Scan(&end2); err != nil || !end2.Equal(l1) {
		t.Errorf("a shorter extend returned %v (%v), want the current end %v", end2, err, l1)
	}
	if l2, x2 := readRow(); !l2.Equal(l1) || !x2.Equal(x1) {
		t.Errorf("a shorter extend moved the lease %v -> %v, expiry %v -> %v", l1, l2, x1, x2)
	}
	// A duplicate is told the new lease.
	d := ssBegin(t, e.app, key, "body", "1 minute", "1 hour")
	if d.Outcome != "in_progress" || d.Retry == nil || *d.Retry < 7100 {
		t.Errorf("duplicate after extend: %+v retry %v", d, d.Retry)
	}
	// A transactional claim cannot be extended.
	tx, err := e.app.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	tk := ssKey("tx")
	c := ssBegin(t, tx, tk, "body", "", "")
	if _, err := tx.Exec(ctx, `SELECT idem.idem_extend('p', $1, $2, '1 hour')`, tk, c.Attempt); ssCode(err) != "55000" {
		t.Errorf("extend of a transactional claim: %v", err)
	}
}

// TestStepsSQLYield: the same request takes over at once in the same generation, with the
// steps; another request gets mismatch until the key expires (the TTL past the lease's end).
func TestStepsSQLYield(t *testing.T) {
	t.Parallel()
	e := ssSetup(t)
	ctx := context.Background()
	key := ssKey("yield")
	a := ssBegin(t, e.app, key, "body", "1 hour", "1 hour")
	pgtest.Exec(t, e.app, `SELECT idem.idem_step('p', $1, $2, 'reserve', '{"id": 41}')`, key, a.Attempt)
	var ok bool
	if err := e.app.QueryRow(ctx, `SELECT idem.idem_yield('p', $1, $2)`, key, a.Attempt).Scan(&ok); err != nil || !ok {
		t.Fatalf("yield: %v %v", ok, err)
	}
	var claimedAt *time.Time
	if err := e.admin.QueryRow(ctx, `SELECT claimed_at FROM idem.idempotency_keys WHERE principal_id = 'p' AND key = $1`, key).Scan(&claimedAt); err != nil || claimedAt != nil {
		t.Errorf("claim time after yield: %v %v, want NULL", claimedAt, err)
	}
	if o := ssBegin(t, e.app, key, "other", "1 minute", "1 hour"); o.Outcome != "mismatch" {
		t.Errorf("another request after yield: %+v", o)
	}
	b := ssBegin(t, e.app, key, "body", "1 minute", "1 hour")
	if b.Outcome != "claimed" || b.Attempt == a.Attempt || ssStr(b.PK) != ssStr(a.PK) || ssStr(b.Point) != "reserve" || ssStr(b.Saved) != `{"reserve": {"id": 41}}` {
		t.Fatalf("the same request after yield: %+v (first %+v)", b, a)
	}
	ssRefused(t, e, key, a.Attempt, "the holder that yielded")
	if _, err := e.app.Exec(ctx, `SELECT idem.idem_step('p', $1, $2, 'reserve', '1')`, key, b.Attempt); ssCode(err) != "23505" {
		t.Errorf("the step again after yield: %v, want 23505", err)
	}
	pgtest.Exec(t, e.app, `SELECT idem.idem_step('p', $1, $2, 'pay', '"po_7"')`, key, b.Attempt)
	pgtest.Exec(t, e.app, `SELECT idem.idem_complete('p', $1, $2, 201, '{}', 'paid')`, key, b.Attempt)
	r := ssBegin(t, e.app, key, "body", "1 minute", "1 hour")
	if r.Outcome != "replay" || ssStr(r.PK) != ssStr(a.PK) || r.Point != nil {
		t.Errorf("replay: %+v", r)
	}
	if n := pgtest.Count(t, e.admin, `SELECT count(*) FROM idem.idempotency_keys WHERE principal_id = 'p' AND key = $1 AND recovery_saved IS NULL AND recovery_point IS NULL`, key); n != 1 {
		t.Errorf("the answer did not clear the steps")
	}
	// A transactional claim is not yielded: false, its transaction goes on.
	tx, err := e.app.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	tk := ssKey("tx")
	c := ssBegin(t, tx, tk, "body", "", "")
	if err := tx.QueryRow(ctx, `SELECT idem.idem_yield('p', $1, $2)`, tk, c.Attempt).Scan(&ok); err != nil || ok {
		t.Errorf("yield of a transactional claim: %v %v, want false", ok, err)
	}
}

// TestStepsSQLYieldExpiry: after idem_yield the lease ends now, and another request gets
// mismatch until the key expires: "the TTL past the end the lease had before it was given up"
// (docs/sql-api.md, idem.idem_yield). The page had said the TTL past the lease's end, which a
// reader takes for the yield; the key keeps the request's generation as long as the lease would
// have.
func TestStepsSQLYieldExpiry(t *testing.T) {
	t.Parallel()
	e := ssSetup(t)
	ctx := context.Background()
	key := ssKey("yieldttl")
	a := ssBegin(t, e.app, key, "body", "2 seconds", "300 ms")
	var ok bool
	if err := e.app.QueryRow(ctx, `SELECT idem.idem_yield('p', $1, $2)`, key, a.Attempt).Scan(&ok); err != nil || !ok {
		t.Fatalf("yield: %v %v", ok, err)
	}
	time.Sleep(600 * time.Millisecond)
	if o := ssBegin(t, e.app, key, "other", "1 minute", "1 hour"); o.Outcome != "mismatch" {
		t.Fatalf("another request 600 ms after a yield (TTL 300 ms, the lease's end 2 s away): %+v, want mismatch", o)
	}
	time.Sleep(2 * time.Second)
	if o := ssBegin(t, e.app, key, "other", "1 minute", "1 hour"); o.Outcome != "claimed" {
		t.Errorf("another request past the lease's former end plus the TTL: %s, want claimed; row %s", o.Outcome, ssRow(t, e.admin, key))
	}
}

// TestStepsSQLExpiry: a lease claim expires the TTL past its lease's end; then every holder
// function refuses, and the same request starts a new generation without the steps.
func TestStepsSQLExpiry(t *testing.T) {
	t.Parallel()
	e := ssSetup(t)
	ctx := context.Background()
	key := ssKey("exp")
	key2 := ssKey("exp")
	// The TTL leaves room for a loaded machine between the lease's end and the key's expiry
	// (200 ms did not, with four test packages at once).
	began := time.Now()
	a := ssBegin(t, e.app, key, "body", "100 ms", "1500 ms")
	a2 := ssBegin(t, e.app, key2, "body", "100 ms", "1500 ms")
	// Both claims' now() is before this: both keys expire by claimed + 1.6 s. (The checks past
	// the expiry are timed from here, not from began: a claim slowed by a loaded machine ends
	// later than began + 100 ms, and its key expires later than began + 1.6 s.)
	claimed := time.Now()
	pgtest.Exec(t, e.app, `SELECT idem.idem_step('p', $1, $2, 'one', '1')`, key, a.Attempt)
	pgtest.Exec(t, e.app, `SELECT idem.idem_step('p', $1, $2, 'one', '1')`, key2, a2.Attempt)
	time.Sleep(time.Until(began.Add(200 * time.Millisecond)))
	// Past the lease, within the TTL: the holder still holds.
	var rp *string
	if err := e.app.QueryRow(ctx, `SELECT recovery_point FROM idem.idem_recovery('p', $1, $2)`, key, a.Attempt).Scan(&rp); err != nil || ssStr(rp) != "one" {
		t.Errorf("recovery past the lease, within the TTL: %v %v", ssStr(rp), err)
	}
	time.Sleep(time.Until(claimed.Add(1700 * time.Millisecond)))
	ssRefused(t, e, key, a.Attempt, "holder of an expired lease claim")
	var ok bool
	if err := e.app.QueryRow(ctx, `SELECT idem.idem_save_final('p', $1, 'POST /x', sha256('x'::bytea), '1 hour', 404, '{}', 'gone')`, key2).Scan(&ok); err != nil || !ok {
		t.Errorf("save_final on an expired lease claim: %v %v, want true", ok, err)
	}
	if n := pgtest.Count(t, e.admin, `SELECT count(*) FROM idem.idempotency_keys WHERE principal_id = 'p' AND key = $1 AND recovery_saved IS NULL`, key2); n != 1 {
		t.Errorf("save_final kept the steps")
	}
	b := ssBegin(t, e.app, key, "body", "1 minute", "1 hour")
	if b.Outcome != "claimed" || ssStr(b.PK) == ssStr(a.PK) || b.Point != nil || b.Saved != nil {
		t.Errorf("the same request after expiry: %+v (first %+v)", b, a)
	}
	if _, err := e.app.Exec(ctx, `SELECT idem.idem_step('p', $1, $2, 'one', '2')`, key, b.Attempt); err != nil {
		t.Errorf("the step again in the new generation: %v", err)
	}
}

// TestStepsSQLAnswerTTL: a lease claim's answer is kept the TTL after the answer (D200),
// whether it came early (long before the lease's end) or late (after it ran out).
func TestStepsSQLAnswerTTL(t *testing.T) {
	t.Parallel()
	e := ssSetup(t)
	ctx := context.Background()
	// Early: a lease of an hour, a TTL of 1 s, answered at once. (A TTL of 300 ms left the
	// replay right after, two round trips after the answer, too little room on a loaded
	// machine.)
	early := ssKey("early")
	earlyOther := ssKey("early")
	a := ssBegin(t, e.app, early, "body", "1 hour", "1 second")
	ao := ssBegin(t, e.app, earlyOther, "body", "1 hour", "1 second")
	earlySF := ssKey("early")
	sf := ssBegin(t, e.app, earlySF, "body", "1 hour", "1 second")
	pgtest.Exec(t, e.app, `SELECT idem.idem_complete('p', $1, $2, 201, '{}', 'done')`, earlySF, sf.Attempt)
	pgtest.Exec(t, e.app, `SELECT idem.idem_complete('p', $1, $2, 201, '{}', 'done')`, early, a.Attempt)
	pgtest.Exec(t, e.app, `SELECT idem.idem_complete('p', $1, $2, 201, '{}', 'done')`, earlyOther, ao.Attempt)
	if r := ssBegin(t, e.app, early, "body", "1 minute", "300 ms"); r.Outcome != "replay" {
		t.Fatalf("replay right after: %+v", r)
	}
	time.Sleep(1200 * time.Millisecond)
	if r := ssBegin(t, e.app, early, "body", "1 minute", "1 hour"); r.Outcome != "claimed" || ssStr(r.PK) == ssStr(a.PK) {
		t.Errorf("the same request past the answer's TTL: %+v, want claimed with a new provider key", r)
	}
	if o := ssBegin(t, e.app, earlyOther, "other", "1 minute", "1 hour"); o.Outcome != "claimed" {
		t.Errorf("another request past the answer's TTL: %+v, want claimed", o)
	}
	var ok bool
	if err := e.app.QueryRow(ctx, `SELECT idem.idem_save_final('p', $1, 'POST /x', sha256('x'::bytea), '1 hour', 404, '{}', 'gone')`, earlySF).Scan(&ok); err != nil || !ok {
		t.Errorf("save_final past the early answer's TTL: %v %v, want true", ok, err)
	}
	// Late: a lease of 100 ms, a TTL of 2.5 s; answered 1.2 s after the claim (after the lease
	// ran out, not taken over). The claim's expiry is at 2.6 s; the answer's at 3.7 s; the
	// look at 2.8 s is past the one and before the other, with room on both sides for a loaded
	// machine (the claim's expiry at 800 ms and the answer's at 1100 ms, looked at at 950 ms,
	// left 150 ms for two round trips). The times are taken after the claim returned (its
	// expiry is at most that + 2.6 s) and before the answer was sent (its expiry is at least
	// that + 2.5 s).
	late := ssKey("late")
	l := ssBegin(t, e.app, late, "body", "100 ms", "2500 ms")
	claimedAt := time.Now()
	time.Sleep(time.Until(claimedAt.Add(1200 * time.Millisecond)))
	answeredAt := time.Now()
	pgtest.Exec(t, e.app, `SELECT idem.idem_complete('p', $1, $2, 201, '{}', 'done')`, late, l.Attempt)
	time.Sleep(time.Until(claimedAt.Add(2800 * time.Millisecond)))
	if r := ssBegin(t, e.app, late, "body", "1 minute", "1 hour"); r.Outcome != "replay" || ssStr(r.PK) != ssStr(l.PK) {
		t.Errorf("%v after the claim (its expiry 2.6 s after it), %v after the late answer (TTL 2.5 s): %+v, want replay",
			time.Since(claimedAt).Round(time.Millisecond), time.Since(answeredAt).Round(time.Millisecond), r)
	}
	if o := ssBegin(t, e.app, late, "other", "1 minute", "1 hour"); o.Outcome != "mismatch" {
		t.Errorf("another request within the answer's TTL: %+v, want mismatch", o)
	}
	var exp time.Time
	if err := e.admin.QueryRow(ctx, `SELECT lease_expires_at FROM idem.idempotency_keys WHERE principal_id = 'p' AND key = $1`, late).Scan(&exp); err != nil {
		t.Fatal(err)
	}
	time.Sleep(time.Until(exp.Add(100 * time.Millisecond)))
	if o := ssBegin(t, e.app, late, "other", "1 minute", "1 hour"); o.Outcome != "claimed" {
		t.Errorf("another request past the late answer's TTL: %+v, want claimed", o)
	}
}

// TestStepsSQLBeginStepsSameErrors: idem_begin_steps answers and fails as idem_begin does.
func TestStepsSQLBeginStepsSameErrors(t *testing.T) {
	t.Parallel()
	e := ssSetup(t)
	ctx := context.Background()
	for _, args := range []string{
		`'p', 'k', 'POST /x', sha256('b'::bytea), p_lease => '0'`,
		`'p', 'k', 'POST /x', sha256('b'::bytea), p_lease => '3601 days'`,
		`'p', 'k', 'POST /x', sha256('b'::bytea), p_ttl => '-1 s'`,
		`'p', 'k k', 'POST /x', sha256('b'::bytea)`,
		`'p', NULL, 'POST /x', sha256('b'::bytea)`,
		`'p', 'k', 'POST /x', 'short'::bytea`,
		`'p', 'k', 'POST /x', sha256('b'::bytea), p_lock_timeout => '0'`,
		`'p', 'k', 'POST /x', sha256('b'::bytea), p_request_fields => '{"a": "zz"}'`,
	} {
		_, e1 := e.app.Exec(ctx, `SELECT * FROM idem.idem_begin(`+args+`)`)
		_, e2 := e.app.Exec(ctx, `SELECT * FROM idem.idem_begin_steps(`+args+`)`)
		if ssCode(e1) != ssCode(e2) || ssCode(e1) == "ok" {
			t.Errorf("%s: idem_begin %v, idem_begin_steps %v", args, e1, e2)
		}
	}
}

// TestStepsSQLRecoveryOfATransactionalClaim: idem_recovery answers a transactional claim in its
// own transaction (its recovery columns NULL), as its section says ("no claim with this token"
// raises 55000); the SQLSTATE table had said "no lease claim".
func TestStepsSQLRecoveryOfATransactionalClaim(t *testing.T) {
	t.Parallel()
	e := ssSetup(t)
	ctx := context.Background()
	tx, err := e.app.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	key := ssKey("txrec")
	c := ssBegin(t, tx, key, "body", "", "")
	var rp *string
	err = tx.QueryRow(ctx, `SELECT recovery_point FROM idem.idem_recovery('p', $1, $2)`, key, c.Attempt).Scan(&rp)
	if err != nil || rp != nil {
		t.Errorf("idem_recovery of a transactional claim in its transaction: %v (point %s), want a row without steps", err, ssStr(rp))
	}
	err = tx.QueryRow(ctx, `SELECT recovery_point FROM idem.idem_recovery('p', $1, $2)`, key, c.Attempt+1).Scan(&rp)
	if ssCode(err) != "55000" {
		t.Errorf("idem_recovery with another token: %v, want 55000", err)
	}
}

// TestStepsSQLExtendAgainstTakeover: the holder's heartbeat and a takeover of its lease that
// ran out, in both orders, with the first one's transaction held open: one of them wins.
func TestStepsSQLExtendAgainstTakeover(t *testing.T) {
	t.Parallel()
	e := ssSetup(t)
	ctx := context.Background()
	holder := pgtest.Connect(t, e.appURL)
	other := pgtest.Connect(t, e.appURL)
	// The heartbeat first (uncommitted), the takeover waits, then is told in_progress.
	key := ssKey("beatfirst")
	a := ssBegin(t, e.app, key, "body", "100 ms", "1 hour")
	time.Sleep(150 * time.Millisecond)
	tx, err := holder.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var end time.Time
	if err := tx.QueryRow(ctx, `SELECT idem.idem_extend('p', $1, $2, '1 hour')`, key, a.Attempt).Scan(&end); err != nil {
		t.Fatal(err)
	}
	done := make(chan ssAns, 1)
	errs := make(chan error, 1)
	go func() {
		b, err := ssBeginErr(other, key, "body", "1 minute", "1 hour", "10 s")
		done <- b
		errs <- err
	}()
	pgtest.WaitUntilBlocked(t, e.admin, other.PgConn().PID())
	// Meanwhile the holder's own reads do not wait: recovery reads without a lock.
	var rp *string
	rctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	if err := e.app.QueryRow(rctx, `SELECT recovery_point FROM idem.idem_recovery('p', $1, $2)`, key, a.Attempt).Scan(&rp); err != nil {
		t.Errorf("recovery while the row is locked: %v", err)
	}
	cancel()
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	b, err := <-done, <-errs
	if err != nil || b.Outcome != "in_progress" || b.Attempt != a.Attempt || b.Retry == nil || *b.Retry < 3500 {
		t.Errorf("takeover after the heartbeat committed: %+v %v, want in_progress for the extended lease", b, err)
	}
	// The takeover first (uncommitted), the heartbeat waits, then gets 55000.
	key = ssKey("takeoverfirst")
	a = ssBegin(t, e.app, key, "body", "100 ms", "1 hour")
	time.Sleep(150 * time.Millisecond)
	tx, err = other.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if c := ssBegin(t, tx, key, "body", "1 minute", "1 hour"); c.Outcome != "claimed" {
		t.Fatalf("takeover: %+v", c)
	}
	go func() {
		var end time.Time
		errs <- holder.QueryRow(ctx, `SELECT idem.idem_extend('p', $1, $2, '1 hour')`, key, a.Attempt).Scan(&end)
	}()
	pgtest.WaitUntilBlocked(t, e.admin, holder.PgConn().PID())
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-errs; ssCode(err) != "55000" {
		t.Errorf("heartbeat after the takeover committed: %v, want 55000", err)
	}
}

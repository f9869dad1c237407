package tests

// The lock timeout bounds each wait for one holder, not the whole call (docs/sql-api.md,
// idem_begin's behaviour): from a review that lined calls up behind claims that roll back.

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgidem/pgidem/internal/pgtest"
)

type lineCall struct {
	outcome string
	err     error
	waited  time.Duration
}

// waitInLine: a claim held for hold and rolled back; two calls (with the default 2 s lock
// timeout, each in a session with statementTimeout) wait for it; a call that claims holds its
// claim for hold and rolls back too. The sessions connect before the line forms, so that the
// first call's wait is the hold and little more.
func waitInLine(t *testing.T, hold time.Duration, statementTimeout string) []lineCall {
	t.Helper()
	ctx := context.Background()
	_, admin, _, appURL := appSession(t, false)
	first := pgtest.Connect(t, appURL)
	conns := []*pgx.Conn{pgtest.Connect(t, appURL), pgtest.Connect(t, appURL)}
	pids := make([]uint32, len(conns))
	for i, c := range conns {
		if err := c.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pids[i]); err != nil {
			t.Fatal(err)
		}
		pgtest.Exec(t, c, `SELECT set_config('statement_timeout', $1, false)`, statementTimeout)
	}
	tx, err := first.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if a, err := beginAs(ctx, tx, "p", "line", "POST /x", sum256("r"), ""); err != nil || a.Outcome != "claimed" {
		t.Fatalf("the first claim: %+v %v", a, err)
	}
	calls := make([]lineCall, len(conns))
	var wg sync.WaitGroup
	for i, c := range conns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			tx, err := c.Begin(ctx)
			if err != nil {
				calls[i].err = err
				return
			}
			defer func() { _ = tx.Rollback(ctx) }()
			began := time.Now()
			a, err := beginAs(ctx, tx, "p", "line", "POST /x", sum256("r"), "")
			calls[i] = lineCall{outcome: a.Outcome, err: err, waited: time.Since(began)}
			if err == nil && a.Outcome == "claimed" {
				time.Sleep(hold)
			}
		}()
		pgtest.WaitUntilBlocked(t, admin, pids[i])
	}
	time.Sleep(hold)
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	wg.Wait()
	return calls
}

// TestLockTimeoutBoundsEachHolder: a claim held 1.2 s and rolled back, two calls waiting for it
// with the default 2 s lock timeout. One of them claims when it rolls back, holds its claim 1.2 s
// and rolls back too; the other waits for both, past its lock timeout in all (about 2.4 s), and
// claims without 55P03.
func TestLockTimeoutBoundsEachHolder(t *testing.T) {
	t.Parallel()
	calls := waitInLine(t, 1200*time.Millisecond, "0")
	late := 0
	for i, c := range calls {
		if c.err != nil || c.outcome != "claimed" {
			t.Fatalf("call %d: %q %v after %v, want a claim (each wait is under the lock timeout)", i, c.outcome, c.err, c.waited)
		}
		if c.waited > 2*time.Second {
			late++
		}
	}
	if late != 1 {
		t.Fatalf("%+v: want one call to claim after more than its 2 s lock timeout in all", calls)
	}
}

// TestStatementTimeoutBoundsTheLine: the same line with a statement_timeout of 2 s on the
// waiting sessions: the call that waits for the second holder ends with 57014 at 2 s, under its
// 2 s lock timeout for that holder: the bound of a whole call that docs/sql-api.md names.
func TestStatementTimeoutBoundsTheLine(t *testing.T) {
	t.Parallel()
	calls := waitInLine(t, 1200*time.Millisecond, "2s")
	var claimed, canceled int
	for i, c := range calls {
		var pgErr *pgconn.PgError
		switch {
		case c.err == nil && c.outcome == "claimed":
			claimed++
		case errors.As(c.err, &pgErr) && pgErr.Code == "57014":
			canceled++
		default:
			t.Fatalf("call %d: %q %v after %v", i, c.outcome, c.err, c.waited)
		}
	}
	if claimed != 1 || canceled != 1 {
		t.Fatalf("%+v: want one claim and one 57014", calls)
	}
}

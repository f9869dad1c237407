package tests

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/internal/pgtest"
)

// The gaps of idem_begin's probe (DECISIONS D131), each held open by a real row lock of a
// second session: idem_begin reads the key's row without a lock, and decides on it unless it
// must write.

// fieldsJSON is a request's field hashes as the SQL API takes them.
const fieldsJSON = `{"to": "0011223344556677aabb", "amount": "8899aabbccddeeff0011"}`

// waitBlocked waits until a session of the database waits on a lock, or fails.
func waitBlocked(t *testing.T, conn *pgx.Conn) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		var n int
		if err := conn.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock'`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n > 0 {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatal("no session waited on a lock")
}

// TestProbeGapExpiredRowVanishes: the probe finds an expired row, the claim locks it to write,
// and while it waits the cleanup deletes it: the claim inserts the key anew, with the field
// hashes it checked on the earlier pass stored, so that a later request under the key with
// other fields is told which changed.
func TestProbeGapExpiredRowVanishes(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	ctx := context.Background()
	cleaner, claimer := pgtest.Connect(t, db), pgtest.Connect(t, db)
	if _, err := cleaner.Exec(ctx, `
		SELECT idem.idem_complete('p', 'gone', attempt, 201, '{}', NULL)
		  FROM idem.idem_begin('p', 'gone', 'POST /x', sha256('old'));
		UPDATE idem.idempotency_keys SET expires_at = now() - interval '1 minute', lease_expires_at = now() - interval '1 minute'
		 WHERE key = 'gone'`); err != nil {
		t.Fatal(err)
	}
	// The cleanup's DELETE holds the row; the row stays visible to the probe until it commits.
	tx, err := cleaner.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `DELETE FROM idem.idempotency_keys WHERE key = 'gone'`); err != nil {
		t.Fatal(err)
	}
	type answer struct {
		outcome string
		attempt int64
		stored  bool // the claim's row holds the field hashes
		err     error
	}
	done := make(chan answer, 1)
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	go func() { // the claim commits only with its completion: a transaction of its own
		var a answer
		defer func() { done <- a }()
		tx, err := claimer.Begin(ctx)
		if a.err = err; err != nil {
			return
		}
		defer func() { _ = tx.Rollback(ctx) }()
		if a.err = tx.QueryRow(ctx, `SELECT outcome, attempt FROM idem.idem_begin('p', 'gone', 'POST /x', sha256('new'),
			p_request_fields => $1::jsonb)`, fieldsJSON).Scan(&a.outcome, &a.attempt); a.err != nil || a.outcome != "claimed" {
			return
		}
		if a.err = tx.QueryRow(ctx, `SELECT request_fields IS NOT NULL FROM idem.idempotency_keys WHERE key = 'gone'`).Scan(&a.stored); a.err != nil {
			return
		}
		if _, a.err = tx.Exec(ctx, `SELECT idem.idem_complete('p', 'gone', $1, 201, '{}', NULL)`, a.attempt); a.err != nil {
			return
		}
		a.err = tx.Commit(ctx)
	}()
	select {
	case a := <-done:
		t.Fatalf("the claim did not wait for the cleanup: %q, %v", a.outcome, a.err)
	case <-time.After(100 * time.Millisecond):
	}
	waitBlocked(t, pgtest.Connect(t, db)) // the claim waits on the row the cleanup deletes
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	a := <-done
	if a.err != nil || a.outcome != "claimed" {
		t.Fatalf("%q, %v; want claimed", a.outcome, a.err)
	}
	if !a.stored {
		t.Fatal("the field hashes were not stored: a mismatch could not name what changed")
	}
	var changed []string
	if err := cleaner.QueryRow(ctx, `SELECT changed_fields FROM idem.idem_begin('p', 'gone', 'POST /x', sha256('other'),
		p_request_fields => '{"to": "0011223344556677aabb", "amount": "ffffffffffffffff0011"}')`).Scan(&changed); err != nil {
		t.Fatal(err)
	}
	if len(changed) != 1 || changed[0] != "amount" {
		t.Fatalf("changed fields %v; want [amount]", changed)
	}
}

// TestProbeGapUncommittedHolder: the probe cannot see a claim that is not committed yet; the
// INSERT finds it and waits for it, and answers from what it committed (a replay of its answer),
// or claims when it rolled back.
func TestProbeGapUncommittedHolder(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	ctx := context.Background()
	holder, dup := pgtest.Connect(t, db), pgtest.Connect(t, db)
	for _, commit := range []bool{true, false} {
		key := map[bool]string{true: "held-commit", false: "held-rollback"}[commit]
		tx, err := holder.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(ctx, `SELECT idem.idem_complete('p', $1, attempt, 201, '{}', 'first')
			FROM idem.idem_begin('p', $1, 'POST /x', sha256('body'))`, key); err != nil {
			t.Fatal(err)
		}
		type answer struct {
			outcome string
			body    []byte
			err     error
		}
		done := make(chan answer, 1)
		dtx, err := dup.Begin(ctx) // a claim commits only with its completion
		if err != nil {
			t.Fatal(err)
		}
		go func() {
			var a answer
			a.err = dtx.QueryRow(ctx, `SELECT outcome, response_body FROM idem.idem_begin('p', $1, 'POST /x', sha256('body'))`,
				key).Scan(&a.outcome, &a.body)
			done <- a
		}()
		waitBlocked(t, pgtest.Connect(t, db))
		if commit {
			err = tx.Commit(ctx)
		} else {
			err = tx.Rollback(ctx)
		}
		if err != nil {
			t.Fatal(err)
		}
		a := <-done
		want := map[bool]string{true: "replay", false: "claimed"}[commit]
		if a.err != nil || a.outcome != want || (commit && string(a.body) != "first") {
			t.Fatalf("holder committed %v: %q %q, %v; want %s", commit, a.outcome, a.body, a.err, want)
		}
		if err := dtx.Rollback(ctx); err != nil {
			t.Fatal(err)
		}
	}
}

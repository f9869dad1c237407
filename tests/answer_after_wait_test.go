package tests

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/pgidem/pgidem/internal/pgtest"
)

// An answer is kept at least the TTL after it is stored (docs/sql-api.md, "How long a key
// lives"), also when the statement that stores it first waits on the key's row. idem_complete
// and idem_save_final counted the TTL from the call's start, before that wait: an answer stored
// after a wait of a lock timeout was kept that much less, and with a short TTL it had expired
// by the time it committed, and the retry claimed the key afresh (a new generation, a new
// provider key: the work ran again). Each case holds the row with a real lock in another
// transaction for 1.5 s, and checks the answer's expiry against the moment that transaction
// let the row go (the answer could not be stored before it).
func TestAnswerAfterAWaitKeepsItsTTL(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	app := pgtest.LoginRole(t, db, "idem_app")
	owner := pgtest.Connect(t, db)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	// hold runs the statements of the holder in a transaction of its own, then, 1.5 s after
	// the stored answer's statement started waiting, reads the clock and ends the transaction
	// (commit or rollback); store runs that statement on another connection. It returns the
	// moment the row was let go.
	run := func(t *testing.T, key string, holder []string, commit bool, store string) time.Time {
		t.Helper()
		a := pgtest.Connect(t, app)
		b := pgtest.Connect(t, app)
		tx, err := a.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		for _, q := range holder {
			if _, err := tx.Exec(ctx, q); err != nil {
				t.Fatalf("holder: %s: %v", q, err)
			}
		}
		var pid uint32
		if err := b.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
			t.Fatal(err)
		}
		stored := make(chan error, 1)
		go func() {
			_, err := b.Exec(ctx, store)
			stored <- err
		}()
		pgtest.WaitUntilBlocked(t, owner, pid)
		time.Sleep(1500 * time.Millisecond)
		var let time.Time
		if err := tx.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&let); err != nil {
			t.Fatal(err)
		}
		end := tx.Rollback
		if commit {
			end = tx.Commit
		}
		if err := end(ctx); err != nil {
			t.Fatal(err)
		}
		if err := <-stored; err != nil {
			t.Fatalf("%s: %v", store, err)
		}
		return let
	}
	check := func(t *testing.T, key string, let time.Time) {
		t.Helper()
		var kept time.Time
		var state string
		if err := owner.QueryRow(ctx, `SELECT state, coalesce(lease_expires_at, expires_at) FROM idem.idempotency_keys
			WHERE principal_id = 'p' AND key = $1`, key).Scan(&state, &kept); err != nil {
			t.Fatal(err)
		}
		if state != "c" || kept.Before(let.Add(time.Hour)) {
			t.Fatalf("%s: state %s, kept until %s: %s before the TTL (1 hour) after the row was let go (%s)",
				key, state, kept.Format(time.RFC3339Nano), let.Add(time.Hour).Sub(kept), let.Format(time.RFC3339Nano))
		}
		// And the identical retry replays it.
		var outcome string
		if err := owner.QueryRow(ctx, `SELECT outcome FROM idem.idem_begin('p', $1, 'a', sha256('req'), p_lease => '1 minute')`, key).
			Scan(&outcome); err != nil || outcome != "replay" {
			t.Fatalf("%s: the retry: %s %v; want replay", key, outcome, err)
		}
	}

	t.Run("save_final/insert-after-a-rollback", func(t *testing.T) {
		let := run(t, "sf-insert",
			[]string{`SELECT idem.idem_begin('p', 'sf-insert', 'a', sha256('other'))`}, false,
			`SELECT idem.idem_save_final('p', 'sf-insert', 'a', sha256('req'), '1 hour', 422, '{}', 'final')`)
		check(t, "sf-insert", let)
	})
	t.Run("save_final/update-of-an-expired-key", func(t *testing.T) {
		pgtest.Exec(t, owner, `SELECT idem.idem_save_final('p', 'sf-expired', 'a', sha256('old'), '1 hour', 422, '{}', 'old')`)
		pgtest.Exec(t, owner, `UPDATE idem.idempotency_keys SET expires_at = now() - interval '2 hours',
			lease_expires_at = now() - interval '2 hours' WHERE key = 'sf-expired'`)
		let := run(t, "sf-expired",
			[]string{`SELECT idem.idem_begin('p', 'sf-expired', 'a', sha256('other'))`}, false,
			`SELECT idem.idem_save_final('p', 'sf-expired', 'a', sha256('req'), '1 hour', 422, '{}', 'final')`)
		check(t, "sf-expired", let)
	})
	t.Run("complete/behind-the-holder's-heartbeat", func(t *testing.T) {
		var attempt int64
		if err := owner.QueryRow(ctx, `SELECT attempt FROM idem.idem_begin('p', 'c-extend', 'a', sha256('req'),
			p_ttl => '1 hour', p_lease => '1 minute')`).Scan(&attempt); err != nil {
			t.Fatal(err)
		}
		let := run(t, "c-extend",
			[]string{`SELECT idem.idem_extend('p', 'c-extend', ` + strconv.FormatInt(attempt, 10) + `, '1 minute')`}, true,
			`SELECT idem.idem_complete('p', 'c-extend', `+strconv.FormatInt(attempt, 10)+`, 200, '{}', 'answer')`)
		check(t, "c-extend", let)
	})
}

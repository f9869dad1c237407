package tests

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestAnswerAfterARacedWriteHoldsNoLock (D275): a duplicate that finds the key due for a write
// (a lease that ran out, an expired key) while another transaction takes it over waits for that
// transaction, then answers from the version it committed (in_progress, mismatch) and holds no
// lock on the key's row. idem_begin read the row again FOR UPDATE before each write and kept
// that lock after deciding not to write, until the caller's transaction ended: a caller in
// another language that kept its transaction open after the answer (polling in it) made the
// new holder's idem_extend and idem_complete fail with 55P03 after their 2 s lock timeout. A
// review of the SQL API as a DBA (three psql sessions).
func TestAnswerAfterARacedWriteHoldsNoLock(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.NewDB(t)
	admin := pgtest.Connect(t, url)
	session := func() *pgx.Conn {
		c := pgtest.Connect(t, url)
		pgtest.Exec(t, c, `SET ROLE idem_app`)
		return c
	}
	for _, c := range []struct {
		name string
		due  string // makes the stored key due for a write
		dup  string // the duplicate's request: 'x' the same, 'y' another
		want string // the duplicate's answer
	}{
		{"lease run out, the same request", `UPDATE idem.idempotency_keys SET lease_expires_at = clock_timestamp() - interval '1 second' WHERE key = $1`, "x", "in_progress"},
		{"expired, another request", `UPDATE idem.idempotency_keys SET lease_expires_at = clock_timestamp() - interval '1 second',
			expires_at = clock_timestamp() - interval '1 second' WHERE key = $1`, "y", "mismatch"},
	} {
		t.Run(c.name, func(t *testing.T) {
			key := "raced-" + c.dup
			holder, dup := session(), session()
			claim := func(conn *pgx.Conn, body string) (string, int64) {
				t.Helper()
				var outcome string
				var attempt int64
				if err := conn.QueryRow(ctx, `SELECT outcome, attempt FROM idem.idem_begin('p', $1, 'POST /x', sha256($2::bytea),
					p_lease => '1 minute')`, key, body).Scan(&outcome, &attempt); err != nil {
					t.Fatalf("claim: %v", err)
				}
				return outcome, attempt
			}
			if o, _ := claim(holder, "x"); o != "claimed" {
				t.Fatalf("the first claim: %s", o)
			}
			pgtest.Exec(t, admin, c.due, key)

			// The retry takes the key over in a transaction it keeps open.
			pgtest.Exec(t, holder, `BEGIN`)
			o, token := claim(holder, "x")
			if o != "claimed" {
				t.Fatalf("the takeover: %s", o)
			}
			// The duplicate finds the key due and waits for the takeover's transaction.
			pgtest.Exec(t, dup, `BEGIN`)
			answer := make(chan string, 1)
			go func() {
				var outcome string
				err := dup.QueryRow(ctx, `SELECT outcome FROM idem.idem_begin('p', $1, 'POST /x', sha256($2::bytea),
					p_lease => '1 minute')`, key, c.dup).Scan(&outcome)
				if err != nil {
					outcome = err.Error()
				}
				answer <- outcome
			}()
			pgtest.WaitFor(t, admin, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%idem_begin%'`)
			pgtest.Exec(t, holder, `COMMIT`)
			if got := <-answer; got != c.want {
				t.Fatalf("the duplicate answered %q, want %s", got, c.want)
			}
			// The duplicate's transaction stays open (a caller polling in it); the holder
			// extends its lease and completes at once.
			start := time.Now()
			if _, err := holder.Exec(ctx, `SELECT idem.idem_extend('p', $1, $2, '1 minute')`, key, token); err != nil {
				t.Fatalf("the holder's extension while the duplicate's transaction is open: %v after %v", err, time.Since(start))
			}
			if _, err := holder.Exec(ctx, `SELECT idem.idem_complete('p', $1, $2, 201, '{}', 'done')`, key, token); err != nil {
				t.Fatalf("the holder's completion while the duplicate's transaction is open: %v after %v", err, time.Since(start))
			}
			// The 2 s lock timeout against a write that waits for nothing.
			if took := time.Since(start); took > time.Second {
				t.Errorf("the holder's extension and completion took %v: they waited on the duplicate's lock", took)
			}
			pgtest.Exec(t, dup, `ROLLBACK`)
		})
	}
}

// TestSnapshotClaimOfADeletedKeyIs40001 (D275): under REPEATABLE READ and SERIALIZABLE, a key
// whose expired row cleanup deleted after the transaction's snapshot is not claimed: the
// claim raises 40001, as docs/sql-api.md says for a row that changed after the snapshot. The
// first build of D275 claimed it with the INSERT that waits for a writer (ON CONFLICT sees only
// live rows), and the transaction then saw two rows for one key and failed at its completion
// instead, after the work (a review of the change).
func TestSnapshotClaimOfADeletedKeyIs40001(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.NewDB(t)
	admin := pgtest.Connect(t, url)
	for _, iso := range []string{"REPEATABLE READ", "SERIALIZABLE"} {
		for _, lease := range []string{"NULL", "'1 minute'"} {
			key := strings.NewReplacer(" ", "-", "'", "").Replace(fmt.Sprintf("snap-%s-%s", iso, lease))
			pgtest.Exec(t, admin, `SELECT idem.idem_begin('p', $1, 'POST /x', sha256('x'), p_lease => '1 minute')`, key)
			pgtest.Exec(t, admin, `UPDATE idem.idempotency_keys SET lease_expires_at = clock_timestamp() - interval '2 seconds',
				expires_at = clock_timestamp() - interval '1 second' WHERE key = $1`, key)
			app := pgtest.Connect(t, url)
			pgtest.Exec(t, app, `SET ROLE idem_app`)
			pgtest.Exec(t, app, `BEGIN ISOLATION LEVEL `+iso)
			pgtest.Exec(t, app, `SELECT idem.idem_version()`) // the snapshot
			if n := pgtest.Count(t, admin, `SELECT idem.idem_cleanup(1000)`); n < 1 {
				t.Fatalf("cleanup deleted %d rows, want the expired key's", n)
			}
			_, err := app.Exec(ctx, `SELECT idem.idem_begin('p', $1, 'POST /x', sha256('y'), p_lease => `+lease+`)`, key)
			if err == nil || !strings.Contains(err.Error(), "40001") {
				t.Errorf("%s, lease %s: the claim of a key deleted after the snapshot: %v; want 40001", iso, lease, err)
			}
			_, _ = app.Exec(ctx, `ROLLBACK`)
		}
	}
}

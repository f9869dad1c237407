package tests

import (
	"context"
	"testing"
	"time"

	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestYieldedHolderIsFenced (review finding): docs/sql-api.md ("Who may do what to a lease
// claim") says that once a holder gave its lease up with idem_yield, its own token gets
// "55000 / false" from idem_extend, idem_complete, idem_yield and idem_release. The functions
// fence only by the token and state, and idem_yield changes neither: the yielded holder's
// idem_extend revives the lease (a heartbeat still running when the work yields: the client's
// retry, which should take over at once, is told in_progress for another lease), and its
// idem_complete stores an answer. The same holds after an operator's idem_release_stuck.
func TestYieldedHolderIsFenced(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	conn := pgtest.Connect(t, pgtest.NewDB(t))
	var attempt int64
	if err := conn.QueryRow(ctx, `SELECT attempt FROM idem.idem_begin('p', 'k', 'POST /jobs', sha256('job'),
		p_lease => '10 minutes')`).Scan(&attempt); err != nil {
		t.Fatal(err)
	}
	var yielded bool
	if err := conn.QueryRow(ctx, `SELECT idem.idem_yield('p', 'k', $1)`, attempt).Scan(&yielded); err != nil || !yielded {
		t.Fatalf("yield: %v %v", yielded, err)
	}
	if _, err := conn.Exec(ctx, `SELECT idem.idem_extend('p', 'k', $1, '10 minutes')`, attempt); err == nil {
		var outcome string
		if err := conn.QueryRow(ctx, `SELECT outcome FROM idem.idem_begin('p', 'k', 'POST /jobs', sha256('job'),
			p_lease => '10 minutes')`).Scan(&outcome); err != nil {
			t.Fatal(err)
		}
		t.Errorf("idem_extend by the holder that yielded succeeded (docs: 55000); the client's retry is then told %q instead of taking over", outcome)
	}
}

// TestSaveFinalLeavesAnotherHoldersLeaseAlone (review finding): docs/sql-api.md says
// idem_save_final "never overwrites a completed key, nor touches another holder's lease: then
// it returns false". It returned false but kept the row locked (INSERT ... ON CONFLICT DO
// UPDATE locks the row it finds even when its WHERE refuses it), so the lease's holder could
// neither extend nor answer its claim until that transaction ended: 55P03 after the 2 s lock
// timeout. Two connections, the save_final's transaction held open.
func TestSaveFinalLeavesAnotherHoldersLeaseAlone(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.NewDB(t)
	holder := pgtest.Connect(t, url)
	other := pgtest.Connect(t, url)
	var attempt int64
	if err := holder.QueryRow(ctx, `SELECT attempt FROM idem.idem_begin('p', 'k', 'POST /jobs', sha256('job'),
		p_lease => '10 minutes')`).Scan(&attempt); err != nil {
		t.Fatal(err)
	}
	tx, err := other.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	var stored bool
	if err := tx.QueryRow(ctx, `SELECT idem.idem_save_final('p', 'k', 'POST /jobs', sha256('job'), NULL, 422, '{}', 'no')`).Scan(&stored); err != nil || stored {
		t.Fatalf("save_final on another holder's lease: %v %v, want false", stored, err)
	}
	start := time.Now()
	if _, err := holder.Exec(ctx, `SELECT idem.idem_extend('p', 'k', $1, '10 minutes')`, attempt); err != nil {
		t.Fatalf("the holder's heartbeat while the save_final's transaction is open: %v after %v", err, time.Since(start))
	}
	if _, err := holder.Exec(ctx, `SELECT idem.idem_complete('p', 'k', $1, 200, '{}', 'done')`, attempt); err != nil {
		t.Fatalf("the holder's answer while the save_final's transaction is open: %v after %v", err, time.Since(start))
	}
	if waited := time.Since(start); waited > time.Second {
		t.Fatalf("the holder waited %v for the save_final's transaction (want no wait; the lock timeout is 2 s)", waited)
	}
}

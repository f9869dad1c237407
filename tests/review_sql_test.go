package tests

import (
	"context"
	"testing"

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

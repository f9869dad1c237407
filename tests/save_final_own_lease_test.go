package tests

import (
	"context"
	"testing"

	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestSaveFinalLeavesTheTransactionsOwnLeaseClaim (D275): docs/sql-api.md says idem_save_final
// finalizes a transactional claim of its own transaction and never touches a lease claim in
// progress, one this transaction made included; that claim's final answer is stored with
// idem_complete. A review read "this transaction's own claim" as any claim it made.
func TestSaveFinalLeavesTheTransactionsOwnLeaseClaim(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.NewDB(t)
	app := pgtest.Connect(t, url)
	pgtest.Exec(t, app, `SET ROLE idem_app`)
	pgtest.Exec(t, app, `BEGIN`)
	var token int64
	if err := app.QueryRow(ctx, `SELECT attempt FROM idem.idem_begin('p', 'own-lease', 'POST /x', sha256('x'),
		p_lease => '1 minute')`).Scan(&token); err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, app, `SAVEPOINT work`)
	pgtest.Exec(t, app, `ROLLBACK TO SAVEPOINT work`)
	var stored bool
	if err := app.QueryRow(ctx, `SELECT idem.idem_save_final('p', 'own-lease', 'POST /x', sha256('x'), NULL, 422, '{}', 'no')`).Scan(&stored); err != nil || stored {
		t.Fatalf("idem_save_final on the transaction's own lease claim: %v %v; want false", stored, err)
	}
	pgtest.Exec(t, app, `SELECT idem.idem_complete('p', 'own-lease', $1, 422, '{}', 'no')`, token)
	pgtest.Exec(t, app, `COMMIT`)
	var outcome string
	var status int
	if err := app.QueryRow(ctx, `SELECT outcome, response_status FROM idem.idem_begin('p', 'own-lease', 'POST /x', sha256('x'),
		p_lease => '1 minute')`).Scan(&outcome, &status); err != nil || outcome != "replay" || status != 422 {
		t.Errorf("a repeat: %s %d %v; want the 422 replayed", outcome, status, err)
	}
}

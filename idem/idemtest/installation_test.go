package idemtest_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/idem/idemtest"
)

// TestEachDatabaseIsAnInstallation: the databases idemtest makes are copies of one migrated
// template, and a copy carries its original's installation secret: the same claim in two
// tests' databases got the same provider key, and a fake provider shared by the tests took
// the second test's call for a repeat of the first's. Each database now has a secret of its
// own, as two databases in production do.
func TestEachDatabaseIsAnInstallation(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	keyIn := func(q interface {
		QueryRow(context.Context, string, ...any) pgx.Row
	}) string {
		t.Helper()
		var pk string
		if err := q.QueryRow(ctx, `SELECT provider_key FROM idem.idem_begin('alice', 'welcome/1', 'POST /x', sha256('x'),
			p_lease => interval '1 minute')`).Scan(&pk); err != nil || pk == "" {
			t.Fatalf("claim: %q %v", pk, err)
		}
		return pk
	}
	a, b := idemtest.NewPool(t), idemtest.NewPool(t)
	conn, err := pgx.Connect(ctx, idemtest.NewDB(t))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	ka, kb, kc := keyIn(a), keyIn(b), keyIn(conn)
	if ka == kb || ka == kc || kb == kc {
		t.Errorf("provider keys of one claim in three test databases: %s %s %s, want three", ka, kb, kc)
	}
}

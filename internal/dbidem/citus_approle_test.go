//go:build citus

package dbidem_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/internal/dbidem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// citusAppPool: a Citus database with the API installed and distributed (docs/scale-out.md),
// and a pool logged in as a member of idem_app, the documented application role.
func citusAppPool(t *testing.T) *pgxpool.Pool {
	db := pgtest.CitusDB(t)
	pgtest.CitusInstall(t, db)
	pgtest.CitusDistribute(t, db)
	pool, err := pgxpool.New(context.Background(), pgtest.LoginRole(t, db, "idem_app"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// TestCitusRunTxAsTheApplicationRole: RunTx's claim as the application role on a Citus
// coordinator. docs/scale-out.md: "the Go driver, the middleware and the reference server need
// no change"; the application logs in as a member of idem_app and never needs more. The claim's
// statement read current_setting('citus.node_conninfo', true) (sql.go, standbyWaitColumn), a
// superuser-only setting: 42501 for every role without pg_read_all_settings, so every RunTx
// claim (DoLease, Do, the HTTP middleware) failed. It reads citus.version now.
func TestCitusRunTxAsTheApplicationRole(t *testing.T) {
	pool := citusAppPool(t)
	ctx := context.Background()
	err := dbidem.RunTx(ctx, pool, dbidem.TxOptions{}, func(tx *dbidem.Tx) error {
		if _, err := tx.Claim(ctx, claim("citus-app-runtx", `{}`)); err != nil {
			return err
		}
		tx.CompleteOnCommit(dbidem.Response{Status: 201})
		return nil
	})
	if err != nil {
		t.Fatalf("RunTx claim + complete on Citus as a login of idem_app: %v", err)
	}
}

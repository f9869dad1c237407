package dbidem_test

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgidem/pgidem/internal/dbidem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestEndedWaitCancelsNoLaterStatement: when a claim's wait context ends (the client left, a
// shutdown began), the gate cancels the claim's statement with a cancel request, which the
// server acts on whenever it arrives. The gate must not let the connection go on before that
// request is through: otherwise it lands on whatever the connection runs next, the work's next
// statement or, once the connection is back in the pool, another request's. Here the wait has
// ended before each claim (the request that comes in after a shutdown), the pool has one
// connection, and the statement run on it right after the unit of work must not be cancelled.
func TestEndedWaitCancelsNoLaterStatement(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 1)
	ctx := context.Background()
	gate := dbidem.NewGate(dbidem.GateOptions{})
	ended, cancel := context.WithCancel(ctx)
	cancel()
	for i := range 60 {
		_ = gate.RunDetached(ended, ctx, pool, dbidem.TxOptions{}, claim(fmt.Sprintf("k%d", i), `{}`), 0,
			func(*dbidem.Tx, dbidem.Decision) error { return nil })
		if _, err := pool.Exec(ctx, `SELECT pg_sleep(0.005)`); err != nil {
			var pgErr *pgconn.PgError
			if errors.As(err, &pgErr) && pgErr.Code == "57014" {
				t.Fatalf("round %d: the statement after a unit of work whose wait had ended was cancelled: %v", i, err)
			}
			t.Fatalf("round %d: %v", i, err)
		}
	}
}

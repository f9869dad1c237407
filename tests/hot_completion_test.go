package tests

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestCompletionIsHOT: docs/sql-api.md, idem_complete: "It updates no indexed column", so the
// update stays HOT, and "Storage and autovacuum": fillfactor 95 "keeps
// that update HOT (no index write) for responses of a few hundred bytes". Both kinds of
// claim, as the application role, each completion in its own transaction; the table's
// statistics count the HOT updates.
func TestCompletionIsHOT(t *testing.T) {
	t.Parallel()
	url := pgtest.NewDB(t)
	admin := pgtest.Connect(t, url)
	ctx := context.Background()
	body := strings.Repeat("x", 200)
	const n = 500
	for _, lease := range []bool{false, true} {
		app := pgtest.Connect(t, pgtest.LoginRole(t, url, "idem_app"))
		pgtest.Exec(t, admin, `SELECT pg_stat_reset()`)
		leaseArg := "NULL"
		if lease {
			leaseArg = "'1 minute'"
		}
		for i := 0; i < n; i++ {
			key := fmt.Sprintf("k-%v-%05d", lease, i)
			tx, err := app.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			var tok int64
			if err := tx.QueryRow(ctx, `SELECT attempt FROM idem.idem_begin(p_principal => 'alice', p_key => $1, p_action => 'POST /x',
				p_request_sha256 => sha256('b'), p_lease => `+leaseArg+`::interval)`, key).Scan(&tok); err != nil {
				t.Fatal(err)
			}
			if lease { // the lease claim commits on its own; the answer comes in a transaction of its own
				if err := tx.Commit(ctx); err != nil {
					t.Fatal(err)
				}
				if tx, err = app.Begin(ctx); err != nil {
					t.Fatal(err)
				}
			}
			if _, err := tx.Exec(ctx, `SELECT idem.idem_complete(p_principal => 'alice', p_key => $1, p_attempt => $2, p_status => 201,
				p_headers => '{"Content-Type":"application/json","Location":"/v1/transfers/123456"}', p_body => convert_to($3, 'UTF8'))`, key, tok, body); err != nil {
				t.Fatal(err)
			}
			if err := tx.Commit(ctx); err != nil {
				t.Fatal(err)
			}
		}
		pgtest.Exec(t, app, `SELECT pg_stat_force_next_flush()`)
		_ = app.Close(ctx) // a session flushes its statistics when it ends
		var upd, hot int
		pgtest.WaitFor(t, admin, `SELECT (n_tup_upd >= $1)::int FROM pg_stat_user_tables WHERE relid = 'idem.idempotency_keys'::regclass`, n)
		pgtest.Exec(t, admin, `SELECT pg_stat_clear_snapshot()`)
		if err := admin.QueryRow(ctx, `SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relid = 'idem.idempotency_keys'::regclass`).Scan(&upd, &hot); err != nil {
			t.Fatal(err)
		}
		if hot < upd*9/10 {
			t.Errorf("lease=%v: %d of %d completions were HOT updates, want (nearly) all", lease, hot, upd)
		}
	}
}

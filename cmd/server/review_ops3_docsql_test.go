package main

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestReviewOps3DocumentedSQLSessions runs docs/operations.md's SQL as the roles it names.
func TestReviewOps3DocumentedSQLSessions(t *testing.T) {
	t.Parallel()
	s := startServer(t, map[string]string{"PAYOUT_PROVIDER_DELAY": "0"})
	ctx := context.Background()
	app := pgtest.Connect(t, loginRole(t, s.db))
	op := pgtest.Connect(t, loginRoleIn(t, s.db, "idem_operator"))
	// "Check the mode with idem_replication() (any of the API's roles may call it)"
	for name, conn := range map[string]*struct{ q func(string) error }{
		"idem_app":      {func(q string) error { _, err := app.Exec(ctx, q); return err }},
		"idem_operator": {func(q string) error { _, err := op.Exec(ctx, q); return err }},
	} {
		for _, q := range []string{
			`SELECT replication, standbys, replication_warning FROM idem.idem_replication()`,
			`SELECT n_tup_hot_upd::float8 / nullif(n_tup_upd, 0) AS hot_share FROM pg_stat_user_tables WHERE relid = 'idem.idempotency_keys'::regclass`,
			`BEGIN; SELECT pg_advisory_xact_lock(29665259344325742); COMMIT`,
			`SELECT * FROM idem.idem_summary()`, `SELECT * FROM idem.idem_health()`, `SELECT idem.idem_version()`,
		} {
			if err := conn.q(q); err != nil {
				t.Errorf("as %s: %s: %v", name, q, err)
			}
		}
	}
	// "Principals and tokens": deleting a principal takes its tokens, accounts, transfers and
	// idempotency keys with it, whatever it did.
	id, token := s.principal("busy")
	a := int(s.call("POST", "/v1/accounts", token, "", `{"name":"a","currency":"EUR"}`).json(t)["id"].(float64))
	b := int(s.call("POST", "/v1/accounts", token, "", `{"name":"b","currency":"EUR"}`).json(t)["id"].(float64))
	for _, c := range []struct{ path, key, body string }{
		{fmt.Sprintf("/v1/accounts/%d/deposits", a), "d", `{"amount":1000}`},
		{"/v1/transfers", "t", fmt.Sprintf(`{"from":%d,"to":%d,"amount":10}`, a, b)},
		{"/v1/payouts", "p", fmt.Sprintf(`{"account":%d,"amount":10}`, a)},
		{"/v1/stepped-payouts", "sp", fmt.Sprintf(`{"account":%d,"amount":10}`, a)},
		{"/v1/api-tokens", "tok", `{"name":"ci"}`},
	} {
		if r := s.call("POST", c.path, token, c.key, c.body); r.status != 201 {
			t.Fatalf("%s: %+v", c.path, r)
		}
	}
	time.Sleep(100 * time.Millisecond)
	if _, err := s.pool.Exec(ctx, `DELETE FROM ledger.principals WHERE id = $1`, id); err != nil {
		t.Fatalf("DELETE FROM ledger.principals (docs: its tokens, accounts, transfers and keys go with it): %v", err)
	}
	if n := s.count(`SELECT count(*) FROM idem.idempotency_keys WHERE principal_id = $1`, id); n != 0 {
		t.Errorf("%d keys left", n)
	}
}

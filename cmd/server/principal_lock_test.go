package main

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestLockedPrincipalRowIs503NotMaintenance (D275): a keyed request whose claim's INSERT waits
// on the principal's row (the key table's foreign key to ledger.principals; another transaction
// holds that row FOR UPDATE) is a locked store, 503 store_unavailable with Retry-After, as
// before; its detail said "locked for maintenance", which sent an operator looking for a
// migration. It now names the other cause too. A review of the HTTP behaviour.
func TestLockedPrincipalRowIs503NotMaintenance(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	id, token := s.principal("locked-row")
	account := int(s.call("POST", "/v1/accounts", token, "", `{"name":"a","currency":"EUR"}`).json(t)["id"].(float64))
	locker := pgtest.Connect(t, s.db)
	tx, err := locker.Begin(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(context.Background()) }()
	pgtest.Exec(t, tx, `SELECT 1 FROM ledger.principals WHERE id = $1 FOR UPDATE`, id)
	r := s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", account), token, "locked-row-1", `{"amount":5}`)
	detail, _ := r.json(t)["detail"].(string)
	if r.status != 503 || r.header.Get("Retry-After") == "" || r.json(t)["code"] != "store_unavailable" ||
		!strings.Contains(detail, "a row the claim checks") {
		t.Errorf("a deposit while the principal's row is locked: %d Retry-After %q %s; want 503 store_unavailable naming a locked row",
			r.status, r.header.Get("Retry-After"), r.body)
	}
}

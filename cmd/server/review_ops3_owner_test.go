package main

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestReviewOps3MigrateAsNonSuperuserOwner: docs/operations.md "Roles": "Run migrations as the owner
// role of the schemas (not a superuser in production)"; docs/sql-api.md: the owner installs
// "without any other privilege ... or idemmigrate.Migrate, or server migrate". Then the
// server runs as a login role that is only a member of idem_app, with the cleaner.
func TestReviewOps3MigrateAsNonSuperuserOwner(t *testing.T) {
	t.Parallel()
	db := pgtest.NewEmptyDB(t)
	owner := pgtest.OwnerRole(t, db)
	for i := 0; i < 2; i++ {
		out, log, err := runMain(t, []string{"migrate"}, serverEnv(owner, nil))
		if err != nil {
			t.Fatalf("server migrate #%d as the database's owner (no superuser): %v\n%s%s", i+1, err, out, log)
		}
	}
	app := loginRole(t, db)
	log := &logBuffer{}
	s := serveWith(t, app, db, map[string]string{"CLEANUP_INTERVAL": "1s"}, log)
	_, token := s.principal("own")
	id := int(s.call("POST", "/v1/accounts", token, "", `{"name":"a","currency":"EUR"}`).json(t)["id"].(float64))
	if r := s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", id), token, "k1", `{"amount":1}`); r.status != 201 {
		t.Fatalf("deposit as the app role: %+v", r)
	}
	if r := s.call("POST", "/v1/payouts", token, "p1", fmt.Sprintf(`{"account":%d,"amount":1}`, id)); r.status >= 500 {
		t.Fatalf("payout as the app role: %+v", r)
	}
	pid, _ := s.principal("exp")
	pgtest.InsertExpired(t, s.pool, pid, 100)
	pgtest.WaitFor(t, s.pool, `SELECT (count(*) = 0)::int FROM idem.idempotency_keys WHERE principal_id = $1`, pid)
	time.Sleep(500 * time.Millisecond)
	if strings.Contains(log.String(), `"level":"ERROR"`) {
		t.Fatalf("errors:\n%s", log.String())
	}
	// server cleanup as the owner: it may vacuum. The server stops first, or
	// its cleaner (every second) may take these keys before the command does.
	if err := s.shutdown(); err != nil {
		t.Fatalf("shutdown: %v", err)
	}
	pgtest.InsertExpired(t, s.pool, pid, 100)
	out, l, err := runMain(t, []string{"cleanup"}, serverEnv(owner, nil))
	if err != nil || !strings.Contains(out, "deleted 100") {
		t.Fatalf("server cleanup as the owner: %v %q %s", err, out, l)
	}
	op := loginRoleIn(t, db, "idem_operator")
	for _, c := range [][]string{{"keys"}, {"keys", "by-principal"}, {"keys", "stuck", "0s"}} {
		out, l, err := runMain(t, c, serverEnv(op, nil))
		if err != nil {
			t.Errorf("%v as an operator: %v %q %s", c, err, out, l)
		}
	}
}

package main

import (
	"io"
	"strings"
	"testing"

	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestReviewOps3AppRoleReservedNames: docs/operations.md "Configuration": "A bad value stops the start
// with a message that names the variable". IDEM_APP_ROLE is the role `migrate` grants the SQL
// API and the ledger's tables to, "created NOLOGIN when it does not exist". "public" is no
// role (PostgreSQL reserves it; GRANT ... TO "public" would mean every role), and the pg_*
// names are PostgreSQL's predefined roles (pg_read_all_data is given to backup and reporting
// users: with IDEM_APP_ROLE=pg_read_all_data they get write access to the ledger and the SQL
// API). Both passed the start check: "public" failed only inside migrate, with PostgreSQL's
// message that does not name the variable, and pg_read_all_data was granted everything (D171).
func TestReviewOps3AppRoleReservedNames(t *testing.T) {
	t.Parallel()
	for _, role := range []string{"public", "pg_read_all_data", "pg_monitor"} {
		m := NewMain(io.Discard, io.Discard)
		err := m.ParseFlags([]string{"migrate"}, func(k string) string {
			if k == "IDEM_APP_ROLE" {
				return role
			}
			return ""
		})
		if err == nil || !strings.Contains(err.Error(), "IDEM_APP_ROLE") {
			t.Errorf("IDEM_APP_ROLE=%s: start check %v, want an error naming IDEM_APP_ROLE", role, err)
		}
	}
	// What migrate does with them.
	db := pgtest.NewEmptyDB(t)
	_, _, err := runMain(t, []string{"migrate"}, serverEnv(db, map[string]string{"IDEM_APP_ROLE": "public"}))
	t.Logf("migrate with IDEM_APP_ROLE=public: %v", err)
	db2 := pgtest.NewEmptyDB(t)
	_, _, err = runMain(t, []string{"migrate"}, serverEnv(db2, map[string]string{"IDEM_APP_ROLE": "pg_read_all_data"}))
	reader := pgtest.LoginRole(t, db2, "pg_read_all_data")
	n := pgtest.Count(t, pgtest.Connect(t, reader), `SELECT count(*) FROM information_schema.role_table_grants
		WHERE grantee = 'pg_read_all_data' AND table_schema = 'ledger' AND privilege_type IN ('INSERT','UPDATE')`)
	t.Logf("migrate with IDEM_APP_ROLE=pg_read_all_data: %v; INSERT/UPDATE grants on ledger tables to pg_read_all_data: %d", err, n)
}

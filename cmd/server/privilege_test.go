package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"regexp"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgidem/pgidem/internal/pgtest"
)

// loginRole creates a login role that is only a member of the application role idem_app (not
// the owner of anything, not a superuser), as docs/operations.md recommends, and returns the
// connection string of db as that role. The role is dropped when the test ends.
func loginRole(t *testing.T, db string) string {
	t.Helper()
	return pgtest.LoginRole(t, db, "idem_app")
}

// docLedgerAppRole creates the login role of docs/operations.md ("Roles", the block between
// the ledger-app-role markers) on db's server, under a name of this test's and a password of
// its own, and returns db's connection string as that role; it checks the settings the block
// gives the role, and drops the role when the test ends.
func docLedgerAppRole(t *testing.T, db string) string {
	t.Helper()
	raw, err := os.ReadFile("../../docs/operations.md")
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile("(?s)<!-- ledger-app-role:begin[^\n]*-->\n```sql\n(.*?)```\n<!-- ledger-app-role:end -->").FindSubmatch(raw)
	if m == nil {
		t.Fatal("docs/operations.md: no sql block between the ledger-app-role markers")
	}
	name := fmt.Sprintf("ledger_app_%d_%d", os.Getpid(), docRoles.Add(1))
	block := strings.ReplaceAll(strings.ReplaceAll(string(m[1]), "ledger_app", name), "'...'", "'app-secret'")
	admin := pgtest.Connect(t, db)
	pgtest.Exec(t, admin, block)
	pgtest.DropRoleAtEnd(t, db, name)
	var settings []string
	if err := admin.QueryRow(context.Background(), `SELECT coalesce(rolconfig, '{}') FROM pg_roles WHERE rolname = $1`, name).Scan(&settings); err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(settings, ","); got != "idle_in_transaction_session_timeout=60s,tcp_user_timeout=30s" {
		t.Fatalf("the documented role's settings: %s", got)
	}
	return pgtest.AsRole(t, db, name, "app-secret")
}

var docRoles atomic.Int64

// migratedAsOwner is a new database on which `server migrate` ran as its owner.
func migratedAsOwner(t *testing.T) string {
	t.Helper()
	db := pgtest.NewEmptyDB(t)
	mig := NewMain(&bytes.Buffer{}, &bytes.Buffer{})
	if err := mig.ParseFlags([]string{"migrate"}, serverEnv(db, nil)); err != nil {
		t.Fatal(err)
	}
	if err := mig.Run(context.Background()); err != nil {
		t.Fatalf("migrate as the owner: %v", err)
	}
	_ = mig.Close()
	return db
}

// loginRoleIn is loginRole for a login role that is only a member of group (idem_app or
// idem_operator).
func loginRoleIn(t *testing.T, db, group string) string {
	t.Helper()
	return pgtest.LoginRole(t, db, group)
}

// TestLeastPrivilegeRole: the server, the README quickstart (with its transfer's receipt, sent
// by River) and the cleaner run as a login role that is only a member of idem_app, after
// `server migrate` ran as the owner. The
// cleaner deletes expired keys but cannot vacuum the key table (PostgreSQL 15 lets only its
// owner): it says so once, and the documented alternative (the pg_cron vacuum job, run as
// the owner: TestPgCronCleanup) takes over.
func TestLeastPrivilegeRole(t *testing.T) {
	t.Parallel()
	db := migratedAsOwner(t)
	app := docLedgerAppRole(t, db) // the role docs/operations.md creates, as it creates it

	var log logBuffer
	rcv := newReceiver(t, false)
	s := serveWith(t, app, db, map[string]string{"CLEANUP_INTERVAL": "1s", "RECEIPT_URL": rcv.url}, &log)
	if r := s.call("GET", "/healthz", "", "", ""); r.status != 200 {
		t.Fatalf("/healthz as the application role: %d %s", r.status, r.body)
	}
	out := runQuickstart(t, s, app) // principal create, too, as the application role
	if n := s.count(`SELECT count(*) FROM ledger.transfers`); n != 1 {
		t.Fatalf("%d transfers after the quickstart, want 1:\n%s", n, out)
	}
	// The transfer's receipt, enqueued and sent by River as the application role (schema
	// river's grants).
	waitForCount(t, s, 30*time.Second, `SELECT count(*) FROM river.river_job WHERE kind = 'receipt' AND state = 'completed'`)
	if effects, _ := rcv.figures(); len(effects) != 1 {
		t.Fatalf("the receiver has %d receipts, want the quickstart transfer's", len(effects))
	}

	// The scheduled cleaner, as the application role.
	id, _ := s.principal("expired")
	pgtest.InsertExpired(t, s.pool, id, 200)
	pgtest.WaitFor(t, s.pool, `SELECT (count(*) = 0)::int FROM idem.idempotency_keys WHERE principal_id = $1`, id)
	deadline := time.Now().Add(5 * time.Second)
	for !strings.Contains(log.String(), "does not vacuum") && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	if n := strings.Count(log.String(), "does not vacuum the key table"); n != 1 {
		t.Fatalf("the cleaner's refusal to vacuum was logged %d times, want once:\n%s", n, log.String())
	}
	if strings.Contains(log.String(), `"level":"ERROR"`) {
		t.Fatalf("the server logged an error as the application role:\n%s", log.String())
	}

	// `server cleanup`, as the application role.
	pgtest.InsertExpired(t, s.pool, id, 50)
	var stdout bytes.Buffer
	c := NewMain(&stdout, &bytes.Buffer{})
	if err := c.ParseFlags([]string{"cleanup"}, serverEnv(app, nil)); err != nil {
		t.Fatal(err)
	}
	if err := c.Run(context.Background()); err != nil {
		t.Fatalf("server cleanup as the application role: %v", err)
	}
	_ = c.Close()
	if !strings.Contains(stdout.String(), "deleted 50 expired keys") {
		t.Fatalf("server cleanup printed %q", stdout.String())
	}
}

// TestHealthzNamesAMissingGrant (operator review): the application role lost its grant on the
// ledger's version table (a REVOKE by hand, a role the migrations did not grant). /healthz
// answered 503 "the database does not answer", sending the operator to the network; it names
// the grant now, and keyed requests are untouched.
func TestHealthzNamesAMissingGrant(t *testing.T) {
	t.Parallel()
	db := migratedAsOwner(t)
	s := serveWith(t, loginRole(t, db), db, nil, io.Discard)
	if r := s.call("GET", "/healthz", "", "", ""); r.status != 200 {
		t.Fatalf("/healthz before the REVOKE: %d %s", r.status, r.body)
	}
	owner := pgtest.Connect(t, db)
	pgtest.Exec(t, owner, `REVOKE SELECT ON ledger.schema_version FROM idem_app`)
	r := s.call("GET", "/healthz", "", "", "")
	t.Logf("/healthz without the grant: %d %s", r.status, r.body)
	if r.status != 503 || !strings.Contains(r.body, "GRANT") || !strings.Contains(r.body, "ledger.schema_version") ||
		strings.Contains(r.body, "does not answer") {
		t.Errorf("/healthz without the grant on ledger.schema_version: %d %s, want 503 naming the grant", r.status, r.body)
	}
}

package main

import (
	"context"
	"errors"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestCleanupWaitsForAMaintenanceWindow: docs/operations.md says a `server cleanup` waits for
// a maintenance window that holds the cleanup lock, as `CALL idem.idem_cleanup_all(...)` does,
// whatever lock_timeout the session has. With a DBA's ALTER ROLE ... SET lock_timeout = '1s'
// on the login role that runs it, the command failed after a second ("request in progress")
// while the procedure waited.
func TestCleanupWaitsForAMaintenanceWindow(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	id, _ := s.principal("maint")
	admin := pgtest.Connect(t, s.db)
	pgtest.InsertExpired(t, admin, id, 20)
	app := loginRole(t, s.db)
	var role string
	if err := pgtest.Connect(t, app).QueryRow(context.Background(), `SELECT current_user`).Scan(&role); err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, admin, `ALTER ROLE `+role+` SET lock_timeout = '1s'`)

	// The maintenance window as docs/operations.md writes it ("as the table's owner or any
	// role": here the application's login role), held for 3 s.
	doc, err := os.ReadFile("../../docs/operations.md")
	if err != nil {
		t.Fatal(err)
	}
	window := regexp.MustCompile("(?s)```sql\nBEGIN;\n" + `(SELECT pg_advisory_xact_lock\(\d+\);)[^\n]*\n-- \.\.\. the maintenance \.\.\.\nCOMMIT;\n` + "```").FindSubmatch(doc)
	if window == nil {
		t.Fatal("docs/operations.md shows no maintenance window (BEGIN; SELECT pg_advisory_xact_lock(...); ... COMMIT;)")
	}
	holder := pgtest.Connect(t, app)
	pgtest.Exec(t, holder, `BEGIN`)
	pgtest.Exec(t, holder, string(window[1]))
	ended := make(chan struct{})
	go func() {
		defer close(ended)
		time.Sleep(3 * time.Second)
		_, _ = holder.Exec(context.Background(), `COMMIT`)
	}()
	began := time.Now()
	out, _, err := runMain(t, []string{"cleanup"}, serverEnv(app, nil))
	took := time.Since(began)
	<-ended
	if err != nil || !strings.HasPrefix(out, "deleted 20 expired keys") || took < 2500*time.Millisecond {
		t.Fatalf("server cleanup in a maintenance window of 3 s, as a role with lock_timeout 1s: %v after %v, printed %q; "+
			"want the 20 keys deleted after the window", err, took, out)
	}
}

// TestKeysAnswerBehindALockedTable: docs/operations.md tells operators to look at a key with
// `server keys` when something is wrong, and the maintenance of the key table (VACUUM FULL,
// a LOCK TABLE) is such a moment. Behind ACCESS EXCLUSIVE the reads waited without a bound
// and without a word; the operator functions wait 2 s (their lock_timeout) now, and the command
// says why it read nothing.
func TestKeysAnswerBehindALockedTable(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	holder := pgtest.Connect(t, s.db)
	pgtest.Exec(t, holder, `BEGIN`)
	pgtest.Exec(t, holder, `LOCK TABLE idem.idempotency_keys IN ACCESS EXCLUSIVE MODE`) // VACUUM FULL's lock
	ops := loginRoleIn(t, s.db, "idem_operator")
	for _, args := range [][]string{{"keys"}, {"keys", "by-principal"}, {"keys", "p_x", "k"}, {"keys", "stuck"}} {
		began := time.Now()
		_, _, err := runMain(t, args, serverEnv(ops, nil))
		took := time.Since(began)
		if err == nil || !errors.Is(err, idem.ErrStoreBusy) || !strings.Contains(err.Error(), "the key table is locked") || took > 10*time.Second {
			t.Errorf("server %s behind a lock on the key table: %v after %v; want the table's lock named within seconds",
				strings.Join(args, " "), err, took)
		}
	}
	pgtest.Exec(t, holder, `ROLLBACK`)
	if out, _, err := runMain(t, []string{"keys"}, serverEnv(ops, nil)); err != nil || !strings.Contains(out, "(all)") {
		t.Fatalf("server keys once the lock is gone: %v, %q", err, out)
	}
}

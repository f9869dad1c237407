package main

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"
)

// TestReviewOps3ShutdownPastTimeoutIsClean: docs/operations.md "Shutdown": on SIGTERM the server lets
// in-flight requests finish for up to SHUTDOWN_TIMEOUT, "ends the keyed work still running past
// it (its context ends with cause idem.ErrShutdown: a transfer or deposit rolls back and stores
// nothing ...) ... closes the database pool ..., logs "stopped"". A keyed deposit that outlasts
// the timeout (it waits on a row lock) must be ended, answered, leave nothing claimed, and the
// shutdown must still be a clean one (Run returns nil, so main exits 0, and "stopped" is logged).
// Run returned "shutdown: context deadline exceeded" (exit 1, no "stopped"), and the deposit
// was answered 500 internal_error; D171.
func TestReviewOps3ShutdownPastTimeoutIsClean(t *testing.T) {
	t.Parallel()
	log := &logBuffer{}
	base := startServer(t, nil) // migrated database
	s := serveWith(t, base.db, base.db, map[string]string{"SHUTDOWN_TIMEOUT": "700ms"}, log)
	_, token := s.principal("sd")
	id := int(s.call("POST", "/v1/accounts", token, "", `{"name":"a","currency":"EUR"}`).json(t)["id"].(float64))
	ctx := context.Background()
	holder, err := s.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Rollback(ctx)
	if _, err := holder.Exec(ctx, `SELECT 1 FROM ledger.accounts WHERE id = $1 FOR UPDATE`, id); err != nil {
		t.Fatal(err)
	}
	inflight := make(chan resp, 1)
	go func() {
		inflight <- s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", id), token, "dep-sd", `{"amount":5}`)
	}()
	for i := 0; i < 500 && s.count(`SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()`) == 0; i++ {
		time.Sleep(10 * time.Millisecond)
	}
	began := time.Now()
	runErr := s.shutdown() // what SIGTERM does: the context of Run ends
	took := time.Since(began)
	var r resp
	select {
	case r = <-inflight:
	case <-time.After(10 * time.Second):
		t.Fatal("the in-flight request got no answer")
	}
	_ = holder.Rollback(ctx)
	claimed := s.count(`SELECT count(*) FROM idem.idempotency_keys WHERE key = 'dep-sd' AND state <> 'c'`)
	t.Logf("shutdown took %v; Run returned %v; in-flight answer %d %s; keys left claimed %d", took, runErr, r.status, r.body, claimed)
	if runErr != nil {
		t.Errorf("Run returned %q after a SIGTERM whose in-flight keyed work outlasted SHUTDOWN_TIMEOUT: main exits 1 with \"server: %v\"; want the documented clean stop (exit 0)", runErr, runErr)
	}
	if !strings.Contains(log.String(), `"msg":"stopped"`) {
		t.Errorf("\"stopped\" was not logged:\n%s", log.String())
	}
	if r.status != 503 || !strings.Contains(r.body, `"code":"shutting_down"`) || r.header.Get("Retry-After") == "" {
		t.Errorf("the ended deposit was answered %d %s; want 503 shutting_down with Retry-After (it was 500 internal_error)", r.status, r.body)
	}
	if claimed != 0 {
		t.Errorf("%d keys left claimed", claimed)
	}
	if n := s.count(`SELECT balance FROM ledger.accounts WHERE id = $1`, id); n != 0 {
		t.Errorf("balance %d, want 0: the ended deposit stored something", n)
	}
}

package main

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"github.com/pgidem/pgidem/internal/pgtest"
)

// logLinesOf returns the server's JSON log lines that carry request_id id.
func logLinesOf(t *testing.T, log string, id string) []map[string]any {
	t.Helper()
	var out []map[string]any
	for _, l := range strings.Split(log, "\n") {
		var m map[string]any
		if json.Unmarshal([]byte(l), &m) == nil && m["request_id"] == id {
			out = append(out, m)
		}
	}
	return out
}

// TestRetriedDeadlockLogsNoError: a transfer chosen as a deadlock's victim runs again and answers
// 201; its failed run logs at warn level ("the request's work failed and ran again", with the
// error), not the error level that says a request failed (D279). A handler's failure that is its
// answer (a 500) still logs "request failed" at error level.
func TestRetriedDeadlockLogsNoError(t *testing.T) {
	t.Parallel()
	db := migratedDB(t, nil)
	log := &toBuf{}
	s := serveWith(t, db, db, nil, log)
	_, token := s.principal("dead")
	acct := func(n string) int64 {
		return int64(s.call("POST", "/v1/accounts", token, "", `{"name":"`+n+`","currency":"EUR"}`).json(t)["id"].(float64))
	}
	a, b := acct("a"), acct("b")
	s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", a), token, "", `{"amount":100}`)
	if r := transferInADeadlock(t, s, token, "dead-1", a, b, "X-Request-Id", "deadlock-victim"); r.status != 201 {
		t.Fatalf("the transfer after a deadlock: %d %s, want 201", r.status, r.body)
	}
	lines := logLinesOf(t, log.String(), "deadlock-victim")
	var warned bool
	for _, l := range lines {
		if l["level"] == "ERROR" {
			t.Errorf("a request answered 201 logged an error: %v", l)
		}
		if l["level"] == "WARN" && l["msg"] == "the request's work failed and ran again" &&
			strings.Contains(fmt.Sprint(l["error"]), "40P01") && l["failures"] == float64(1) {
			warned = true
		}
	}
	if !warned {
		t.Errorf("no warning of the run that failed: %v", lines)
	}

	// A failure that is the answer: a 500, logged at error level.
	pgtest.Exec(t, s.pool, `CREATE FUNCTION ledger.boom() RETURNS trigger LANGUAGE plpgsql AS $$BEGIN RAISE EXCEPTION 'boom'; END$$`)
	pgtest.Exec(t, s.pool, `CREATE TRIGGER boom BEFORE INSERT ON ledger.transfers FOR EACH ROW EXECUTE FUNCTION ledger.boom()`)
	if r := s.call("POST", "/v1/transfers", token, "boom-1", fmt.Sprintf(`{"from":%d,"to":%d,"amount":1}`, a, b),
		"X-Request-Id", "boom-victim"); r.status != 500 {
		t.Fatalf("a transfer whose insert fails: %d %s, want 500", r.status, r.body)
	}
	var logged bool
	for _, l := range logLinesOf(t, log.String(), "boom-victim") {
		if l["level"] == "ERROR" && l["msg"] == "request failed" && strings.Contains(fmt.Sprint(l["error"]), "boom") {
			logged = true
		}
	}
	if !logged {
		t.Errorf("a 500 logged no error: %s", log.String())
	}
}

// TestHealthzStaysUpWhileTheKeyTableIsLocked: docs/operations.md, "Maintenance of the key
// table": while the key table is locked, keyed requests get 503 store_unavailable and /healthz
// stays 200.
func TestHealthzStaysUpWhileTheKeyTableIsLocked(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	_, token := s.principal("maint")
	ctx := context.Background()
	tx, err := s.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, `LOCK TABLE idem.idempotency_keys IN ACCESS EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	if r := s.call("POST", "/v1/accounts", token, "maint-1", `{"name":"a","currency":"EUR"}`); r.status != 503 ||
		!strings.Contains(r.body, "store_unavailable") {
		t.Fatalf("a keyed request while the key table is locked: %d %s, want 503 store_unavailable", r.status, r.body)
	}
	if r := s.call("GET", "/healthz", "", "", ""); r.status != 200 {
		t.Fatalf("/healthz while the key table is locked: %d %s, want 200", r.status, r.body)
	}
}

package main

import (
	"context"
	"fmt"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestServerUnderALegacyDatabasesSettings: a database whose settings a legacy application
// chose (ALTER DATABASE ... SET DateStyle = 'SQL, DMY', bytea_output = 'escape' and more), and
// the server in QueryExecModeExec (as behind PgBouncer), which reads every result as text in
// those settings. The ledger's answers carry their times, keyed requests replay and a payout's
// lease holds (D231): pgx parses timestamps in the ISO DateStyle only, so the server asks for it
// when it connects, and the library reads no timestamp and no bytea in the session's format.
// The database's client_encoding is LATIN1 too: the server asks for UTF8, which pgx speaks
// (D232), and a name outside ASCII comes back as it was sent.
func TestServerUnderALegacyDatabasesSettings(t *testing.T) {
	t.Parallel()
	db := pgtest.NewEmptyDB(t)
	mig := NewMain(io.Discard, io.Discard)
	if err := mig.ParseFlags([]string{"migrate"}, serverEnv(db, nil)); err != nil {
		t.Fatal(err)
	}
	if err := mig.Run(context.Background()); err != nil {
		t.Fatalf("migrate: %v", err)
	}
	_ = mig.Close()
	admin := pgtest.Connect(t, db)
	var name string
	if err := admin.QueryRow(context.Background(), `SELECT current_database()`).Scan(&name); err != nil {
		t.Fatal(err)
	}
	for _, set := range []string{"DateStyle = 'SQL, DMY'", "bytea_output = 'escape'", "IntervalStyle = 'sql_standard'",
		"TimeZone = 'Asia/Kathmandu'", "standard_conforming_strings = off", "client_encoding = 'LATIN1'"} {
		pgtest.Exec(t, admin, `ALTER DATABASE "`+name+`" SET `+set)
	}
	s := serveOn(t, db, map[string]string{"DATABASE_URL": db + " default_query_exec_mode=exec"})
	_, token := s.principal("legacy")

	r := s.call("POST", "/v1/accounts", token, "acc-1", `{"name":"café ü","currency":"EUR"}`, "Content-Type", "application/json")
	again := s.call("POST", "/v1/accounts", token, "acc-1", `{"name":"café ü","currency":"EUR"}`, "Content-Type", "application/json")
	if r.status != 201 || again.status != 201 || again.body != r.body || again.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("an account and its replay: %d %s / %d %s", r.status, r.body, again.status, again.body)
	}
	created, err := time.Parse(time.RFC3339Nano, fmt.Sprint(r.json(t)["created_at"]))
	if err != nil || time.Since(created).Abs() > time.Minute {
		t.Errorf("the account's created_at %v (%v): want now", r.json(t)["created_at"], err)
	}
	account := int(r.json(t)["id"].(float64))
	if d := s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", account), token, "dep-1", `{"amount":1000}`); d.status != 201 {
		t.Fatalf("a deposit: %d %s", d.status, d.body)
	}
	if g := s.call("GET", fmt.Sprintf("/v1/accounts/%d", account), token, "", ""); g.status != 200 ||
		!strings.Contains(g.body, `"balance":1000`) || !strings.Contains(g.body, `"name":"café ü"`) {
		t.Errorf("the account: %d %s", g.status, g.body)
	}
	body := fmt.Sprintf(`{"account":%d,"amount":900}`, account)
	p := s.call("POST", "/v1/payouts", token, "pay-1", body, "Content-Type", "application/json")
	p2 := s.call("POST", "/v1/payouts", token, "pay-1", body, "Content-Type", "application/json")
	if p.status != 201 || p2.body != p.body || p2.header.Get("Idempotent-Replayed") != "true" {
		t.Errorf("a payout and its replay: %d %s / %d %s", p.status, p.body, p2.status, p2.body)
	}
}

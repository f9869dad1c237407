package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgidem/pgidem/internal/pgtest"
)

const jsonCT = "application/json"

// TestBadInput: every bad input gets its documented answer, and a refused request leaves
// nothing behind: no key, no money moved. docs/http.md lists the same table.
func TestBadInput(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	_, token := s.principal("bad")
	acct := func(name string) int {
		r := s.call("POST", "/v1/accounts", token, "", `{"name":"`+name+`","currency":"EUR"}`)
		if r.status != 201 {
			t.Fatalf("account: %+v", r)
		}
		return int(r.json(t)["id"].(float64))
	}
	a, b := acct("a"), acct("b")
	if r := s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", a), token, "", `{"amount":1000}`); r.status != 201 {
		t.Fatalf("seed: %+v", r)
	}
	deposits := fmt.Sprintf("/v1/accounts/%d/deposits", a)
	transfers := "/v1/transfers"
	tr := func(amount string) string { return fmt.Sprintf(`{"from":%d,"to":%d,"amount":%s}`, a, b, amount) }

	for _, c := range []struct {
		name, path, body, contentType string
		keyless                       bool
		status                        int
		code                          string
		stored                        bool // a repeat replays it
	}{
		{name: "member names that differ only in case", path: deposits, body: `{"amount":1,"Amount":500}`, status: 400, code: "malformed_body"},
		{name: "the same, in the other order", path: deposits, body: `{"Amount":500,"amount":1}`, status: 400, code: "malformed_body"},
		{name: "a wrong-case member alone", path: deposits, body: `{"Amount":500}`, status: 400, code: "malformed_body", stored: true},
		{name: "duplicate members", path: deposits, body: `{"amount":1,"amount":2}`, status: 400, code: "malformed_body"},
		{name: "data after the value", path: deposits, body: `{"amount":1}}`, status: 400, code: "malformed_body"},
		{name: "two values", path: deposits, body: `{"amount":1} {"amount":2}`, status: 400, code: "malformed_body"},
		{name: "an unknown member", path: transfers, body: `{"from":1,"to":2,"amount":1,"memo":"x"}`, status: 400, code: "malformed_body", stored: true},
		{name: "a missing member", path: transfers, body: fmt.Sprintf(`{"from":%d,"amount":1}`, a), status: 400, code: "malformed_body", stored: true},
		{name: "a string amount", path: deposits, body: `{"amount":"1"}`, status: 400, code: "malformed_body", stored: true},
		{name: "an empty body", path: deposits, body: ``, status: 400, code: "malformed_body", stored: true},
		{name: "a body of whitespace only", path: deposits, body: " \n\t", status: 400, code: "malformed_body"},
		{name: "NUL in a string value", path: "/v1/accounts", body: `{"name":"a\u0000b","currency":"EUR"}`, status: 400, code: "malformed_body"},
		{name: "NUL in a member name", path: deposits, body: `{"amount":1,"a\u0000":1}`, status: 400, code: "malformed_body"},
		{name: "NUL in an account name, without a key", path: "/v1/accounts", body: `{"name":"a\u0000b","currency":"EUR"}`, keyless: true, status: 422, code: "validation_failed"},
		{name: "a control character in a name", path: "/v1/accounts", body: `{"name":"a\tb","currency":"EUR"}`, status: 422, code: "validation_failed", stored: true},
		{name: "a fractional amount", path: deposits, body: `{"amount":1.5}`, status: 422, code: "validation_failed", stored: true},
		{name: "a deposit past the largest balance", path: deposits, body: `{"amount":9223372036854775000}`, status: 422, code: "balance_limit", stored: true},
		{name: "a transfer past the largest balance", path: transfers, body: tr("9223372036854775807"), status: 422, code: "insufficient_funds", stored: true},
		{name: "a deposit of 2^63", path: deposits, body: `{"amount":9223372036854775808}`, status: 422, code: "balance_limit", stored: true},
		{name: "a transfer of 1e30", path: transfers, body: tr("1e30"), status: 422, code: "insufficient_funds", stored: true},
		{name: "an exponent of 20 digits", path: deposits, body: `{"amount":1e99999999999999999999}`, status: 400, code: "malformed_body"},
		{name: "an exponent of 20 digits, without a key", path: deposits, body: `{"amount":1e99999999999999999999}`, keyless: true, status: 400, code: "malformed_body"},
		{name: "nesting 129 levels deep, without a key", path: deposits, body: `{"amount":1,"x":` + strings.Repeat("[", 128) + strings.Repeat("]", 128) + `}`, keyless: true, status: 400, code: "malformed_body"},
		{name: "a non-JSON content type", path: deposits, body: `{"amount":1}`, contentType: "text/plain", status: 415, code: "unsupported_media_type", stored: true},
		{name: "a form content type (curl -d without -H)", path: deposits, body: `{"amount":1}`, contentType: "application/x-www-form-urlencoded", status: 415, code: "unsupported_media_type", stored: true},
		{name: "a malformed key", path: deposits, body: `{"amount":1}`, status: 400, code: "idempotency_key_invalid"},
	} {
		t.Run(c.name, func(t *testing.T) {
			key := "bad-" + strings.ReplaceAll(c.name, " ", "-")
			if c.code == "idempotency_key_invalid" {
				key = `"a b"`
			}
			if c.keyless {
				key = ""
			}
			ct := c.contentType
			if ct == "" {
				ct = jsonCT
			}
			keysBefore := s.count(`SELECT count(*) FROM idem.idempotency_keys`)
			r := s.call("POST", c.path, token, key, c.body, "Content-Type", ct)
			if r.status != c.status || !strings.Contains(r.body, `"code":"`+c.code+`"`) {
				t.Fatalf("%d %s, want %d %s", r.status, r.body, c.status, c.code)
			}
			stored := s.count(`SELECT count(*) FROM idem.idempotency_keys`) - keysBefore
			switch {
			case c.stored && stored != 1:
				t.Fatalf("%d keys stored, want the final answer stored", stored)
			case !c.stored && stored != 0:
				t.Fatalf("%d keys stored, want none", stored)
			}
			if c.stored {
				again := s.call("POST", c.path, token, key, c.body, "Content-Type", ct)
				if again.header.Get("Idempotent-Replayed") != "true" {
					t.Fatalf("the repeat was not a replay: %+v", again)
				}
				if again.status != r.status || again.body != r.body {
					t.Fatalf("the repeat: %+v, want the first answer", again)
				}
			}
		})
	}
	if n := s.count(`SELECT balance FROM ledger.accounts WHERE id = $1`, a); n != 1000 {
		t.Fatalf("balance %d, want 1000: a refused request moved money", n)
	}
	if n := s.count(`SELECT count(*) FROM ledger.transfers`) + s.count(`SELECT count(*) FROM ledger.deposits`); n != 1 {
		t.Fatalf("%d effects, want the seed deposit only", n)
	}
}

// TestOversizedFinalError: a final error larger than the storage limit is stored without its
// body, like an oversized success: a repeat gets 409 response_not_replayable, not an empty 422.
func TestOversizedFinalError(t *testing.T) {
	t.Parallel()
	s := startServer(t, map[string]string{"MAX_STORED_RESPONSE_BYTES": "64"})
	_, token := s.principal("big")
	a := int(s.call("POST", "/v1/accounts", token, "", `{"name":"a","currency":"EUR"}`).json(t)["id"].(float64))
	b := int(s.call("POST", "/v1/accounts", token, "", `{"name":"b","currency":"EUR"}`).json(t)["id"].(float64))
	body := fmt.Sprintf(`{"from":%d,"to":%d,"amount":5}`, a, b)
	first := s.call("POST", "/v1/transfers", token, "big", body)
	if first.status != 422 || len(first.body) <= 64 {
		t.Fatalf("first: %+v", first)
	}
	if n := s.count(`SELECT count(*) FROM idem.idempotency_keys WHERE key = 'big' AND withheld = 'too_large' AND response_body IS NULL`); n != 1 {
		t.Fatal("the oversized final error was not stored as withheld")
	}
	again := s.call("POST", "/v1/transfers", token, "big", body)
	if again.status != 409 || !strings.Contains(again.body, `"code":"response_not_replayable"`) || again.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("the repeat: %+v, want 409 response_not_replayable", again)
	}
}

// TestProtocolEdges: 405 with Allow, a case-insensitive Bearer scheme, the new GET routes.
func TestProtocolEdges(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	_, token := s.principal("edges")
	r := s.call("DELETE", "/v1/accounts", token, "", "")
	if r.status != 405 || r.header.Get("Allow") != "POST" || !strings.Contains(r.body, `"code":"method_not_allowed"`) {
		t.Fatalf("DELETE /v1/accounts: %+v", r)
	}
	if r := s.call("PUT", "/v1/transfers/1", token, "", ""); r.status != 405 || r.header.Get("Allow") != "GET, HEAD" {
		t.Fatalf("PUT /v1/transfers/1: %+v", r)
	}
	if r := s.call("POST", "/healthz", "", "", ""); r.status != 405 || r.header.Get("Allow") != "GET, HEAD" {
		t.Fatalf("POST /healthz: %+v", r)
	}
	if r := s.call("GET", "/v1/nothing", token, "", ""); r.status != 404 {
		t.Fatalf("GET /v1/nothing: %+v", r)
	}
	req, _ := http.NewRequest("POST", s.url+"/v1/accounts", strings.NewReader(`{"name":"a","currency":"EUR"}`))
	req.Header.Set("Authorization", "bearer "+token)
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	res.Body.Close()
	if res.StatusCode != 201 {
		t.Fatalf("a lower-case bearer scheme: %d", res.StatusCode)
	}
	acct := s.call("POST", "/v1/accounts", token, "", `{"name":"b","currency":"EUR"}`)
	id := int(acct.json(t)["id"].(float64))
	dep := s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", id), token, "", `{"amount":5}`)
	if g := s.call("GET", dep.header.Get("Location"), token, "", ""); g.status != 200 || !strings.Contains(g.body, `"amount":5`) {
		t.Fatalf("GET %s: %+v", dep.header.Get("Location"), g)
	}
	other := s.call("POST", "/v1/accounts", token, "", `{"name":"c","currency":"EUR"}`)
	tr := s.call("POST", "/v1/transfers", token, "t1", fmt.Sprintf(`{"from":%d,"to":%d,"amount":2}`, id, int(other.json(t)["id"].(float64))))
	if g := s.call("GET", tr.header.Get("Location"), token, "", ""); g.status != 200 || !strings.Contains(g.body, `"amount":2`) {
		t.Fatalf("GET %s: %+v", tr.header.Get("Location"), g)
	}
	_, stranger := s.principal("stranger")
	if g := s.call("GET", tr.header.Get("Location"), stranger, "", ""); g.status != 404 {
		t.Fatalf("another principal reads the transfer: %+v", g)
	}
}

// TestFinalErrorHoldsTheKey reproduces the race of a final error: a transfer R1 from an
// empty account waits on the account's row; a deposit to that account and R2 (the same
// transfer, same key, through a second server process on the same database) queue behind
// it. When the row is released, R1 answers 422 insufficient_funds, and R2 must get that
// same stored answer: were the key free between R1's rollback and the storing of its
// answer, R2 would claim it, see the deposit's money and move it (201).
func TestFinalErrorHoldsTheKey(t *testing.T) {
	t.Parallel()
	env := map[string]string{"IDEMPOTENCY_LOCK_TIMEOUT": "20s"}
	s := startServer(t, env)
	s2 := serveOn(t, s.db, env)
	_, token := s.principal("race")
	ids := make([]int, 2)
	for i := range ids {
		ids[i] = int(s.call("POST", "/v1/accounts", token, "", `{"name":"x","currency":"EUR"}`).json(t)["id"].(float64))
	}
	ctx := context.Background()
	holder, err := s.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = holder.Rollback(ctx) }()
	pgtest.Exec(t, holder, `SELECT 1 FROM ledger.accounts WHERE id = $1 FOR UPDATE`, ids[0])
	waiting := func(n int) {
		pgtest.WaitFor(t, s.pool, `SELECT count(*) - $1 + 1 FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock'`, n)
	}
	body := fmt.Sprintf(`{"from":%d,"to":%d,"amount":100}`, ids[0], ids[1])
	r1, r2, dep := make(chan resp, 1), make(chan resp, 1), make(chan resp, 1)
	go func() { r1 <- s.call("POST", "/v1/transfers", token, "race-key", body) }()
	waiting(1)
	go func() {
		dep <- s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", ids[0]), token, "", `{"amount":1000}`)
	}()
	waiting(2)
	go func() { r2 <- s2.call("POST", "/v1/transfers", token, "race-key", body) }()
	waiting(3) // R2 waits on the key's row, held by R1's transaction
	_ = holder.Rollback(ctx)
	first, second, d := <-r1, <-r2, <-dep
	if first.status != 422 || !strings.Contains(first.body, "insufficient_funds") {
		t.Fatalf("R1: %+v", first)
	}
	if d.status != 201 {
		t.Fatalf("the deposit: %+v", d)
	}
	if second.status != 422 || second.body != first.body || second.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("R2: %d %s, want R1's stored 422", second.status, second.body)
	}
	if n := s.count(`SELECT count(*) FROM ledger.transfers`); n != 0 {
		t.Fatalf("%d transfers: a client told 'insufficient funds' had its money moved", n)
	}
}

// TestNotMigrated: serve, cleanup and principal create stop at start on a database without
// this version's migrations, saying what to run; /healthz reports a database that falls
// behind while the server runs. A database with the idem API and no ledger (the API installed
// alone) got a raw 42P01 instead: the check named the ledger's version table in a statement
// that fails to parse where it does not exist, whatever its CASE would have skipped.
func TestNotMigrated(t *testing.T) {
	t.Parallel()
	for name, db := range map[string]string{"an empty database": pgtest.NewEmptyDB(t), "the idem API without the ledger": pgtest.NewDB(t)} {
		for _, args := range [][]string{nil, {"cleanup"}, {"principal", "create", "x"}} {
			m := NewMain(io.Discard, io.Discard)
			if err := m.ParseFlags(args, serverEnv(db, nil)); err != nil {
				t.Fatal(err)
			}
			err := m.Run(context.Background())
			_ = m.Close()
			if err == nil || !strings.Contains(err.Error(), "database not migrated: run `server migrate`") {
				t.Errorf("%v on %s: %v", args, name, err)
			}
		}
	}
	s := startServer(t, nil)
	if r := s.call("GET", "/healthz", "", "", ""); r.status != 200 {
		t.Fatalf("healthz: %+v", r)
	}
	pgtest.Exec(t, s.pool, `UPDATE ledger.schema_version SET version = 1`)
	r := s.call("GET", "/healthz", "", "", "")
	if r.status != 503 || !strings.Contains(r.body, "database not migrated") {
		t.Fatalf("healthz on a database behind this server: %+v", r)
	}
	pgtest.Exec(t, s.pool, `DROP TABLE ledger.schema_version`)
	r = s.call("GET", "/healthz", "", "", "")
	if r.status != 503 || !strings.Contains(r.body, "database not migrated") {
		t.Fatalf("healthz on a database without the ledger's version table: %+v", r)
	}
}

// TestConnectErrorIsTheServersAnswer: when PostgreSQL refuses the connection (here: a role
// that does not exist, with sslmode left to its default, prefer), the error is the server's
// answer and where it came from, not the list of pgx's attempts with a TLS error first.
func TestConnectErrorIsTheServersAnswer(t *testing.T) {
	t.Parallel()
	cfg, err := pgconn.ParseConfig(pgtest.NewEmptyDB(t))
	if err != nil {
		t.Fatal(err)
	}
	url := fmt.Sprintf("host=%s port=%d user=no_such_role dbname=%s", cfg.Host, cfg.Port, cfg.Database)
	m := NewMain(io.Discard, io.Discard)
	if err := m.ParseFlags([]string{"migrate"}, func(k string) string { return map[string]string{"DATABASE_URL": url}[k] }); err != nil {
		t.Fatal(err)
	}
	err = m.Run(context.Background())
	_ = m.Close()
	want := fmt.Sprintf(`connect to PostgreSQL at %s:%d as "no_such_role", database %q: role "no_such_role" does not exist (SQLSTATE 28000)`,
		cfg.Host, cfg.Port, cfg.Database)
	if err == nil || err.Error() != want {
		t.Fatalf("got  %v\nwant %s", err, want)
	}
}

package idem_test

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/idem/idemmigrate"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestDocProblemExampleIsWhatTheMiddlewareWrites: docs/http.md,
// "Problems", shows the problem a key reused for another request gets, with its
// correlation_id "req-7" and changed_fields ["amount"]. This test takes the JSON block from
// the doc at test time and compares it, member for member and in the same order, with what
// the middleware (default Options, a login role in idem_app) writes for that case; and checks
// the header the same paragraph names.
func TestDocProblemExampleIsWhatTheMiddlewareWrites(t *testing.T) {
	t.Parallel()
	raw, err := os.ReadFile("../docs/http.md")
	if err != nil {
		t.Fatal(err)
	}
	_, rest, ok := strings.Cut(string(raw), "## Problems\n")
	if !ok {
		t.Fatal("docs/http.md has no Problems section")
	}
	_, rest, ok = strings.Cut(rest, "```json\n")
	block, _, ok2 := strings.Cut(rest, "```\n")
	if !ok || !ok2 {
		t.Fatal("docs/http.md's Problems section has no json block")
	}
	var want bytes.Buffer
	if err := json.Compact(&want, []byte(block)); err != nil {
		t.Fatalf("the doc's json block is not JSON: %v\n%s", err, block)
	}

	owner, _ := pgtest.NewPool(t, 4)
	app := newPool(t, pgtest.LoginRole(t, owner.Config().ConnString(), "idem_app"))
	srv, _ := auditServer(t, idem.Options{DB: app}, idem.Route{}, func(w http.ResponseWriter, r *http.Request) {
		var v struct {
			Amount int `json:"amount"`
		}
		if !idem.DecodeJSON(w, r, &v) {
			return
		}
		w.WriteHeader(http.StatusCreated)
	})
	if s, _, b := auditPost(t, srv.URL, "k-doc", `{"amount":100}`, "X-Request-Id", "req-6"); s != 201 {
		t.Fatalf("the first request: %d %s", s, b)
	}
	s, h, body := auditPost(t, srv.URL, "k-doc", `{"amount":250}`, "X-Request-Id", "req-7")
	var got bytes.Buffer
	if err := json.Compact(&got, []byte(body)); err != nil {
		t.Fatalf("%d, not JSON: %s", s, body)
	}
	if s != 422 || got.String() != want.String() {
		t.Errorf("the reuse of a key as docs/http.md shows it:\n got %d %s\nwant 422 %s", s, got.String(), want.String())
	}
	if ct := h.Get("Content-Type"); ct != "application/problem+json" || h.Get("X-Content-Type-Options") != "nosniff" {
		t.Errorf("headers: Content-Type %q, X-Content-Type-Options %q", ct, h.Get("X-Content-Type-Options"))
	}
}

// TestDocLedgerForeignKeyPatternAsTheOwner: docs/ledger.md shows the
// foreign key from the key table to the principals, "the pattern an application may copy to
// tie keys to its own users", and says "A deleted principal's keys go with it, and a claim for
// an unknown principal fails with 23503 on the key table, which the middleware answers 401
// `principal_unknown`." The reference server's tests run it as the test server's superuser.
// Here an application copies it as the docs' two roles have it: schema idem installed by an
// owner that is no superuser (idemmigrate.Migrate), the owner's table ledger.principals, the
// doc's block verbatim (taken from the doc) as that owner; the service a login role in
// idem_app granted its own table; an upgrade's re-install afterwards keeps the constraint.
func TestDocLedgerForeignKeyPatternAsTheOwner(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	raw, err := os.ReadFile("../docs/ledger.md")
	if err != nil {
		t.Fatal(err)
	}
	_, rest, ok := strings.Cut(string(raw), "```sql\n")
	block, _, ok2 := strings.Cut(rest, "```\n")
	if !ok || !ok2 || !strings.Contains(block, "idempotency_keys_principal_fkey") {
		t.Fatalf("docs/ledger.md has no foreign key block:\n%s", block)
	}
	db := pgtest.NewEmptyDB(t)
	ownerURL := pgtest.OwnerRole(t, db)
	owner := pgtest.Connect(t, ownerURL)
	if err := idemmigrate.Migrate(ctx, owner, idemmigrate.Options{}); err != nil {
		t.Fatal(err)
	}
	appURL := pgtest.LoginRole(t, db, "idem_app")
	cfg, err := pgx.ParseConfig(appURL)
	if err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, owner, `CREATE SCHEMA ledger; CREATE TABLE ledger.principals (id text PRIMARY KEY);
		INSERT INTO ledger.principals VALUES ('alice'), ('bob');
		GRANT USAGE ON SCHEMA ledger TO `+cfg.User+`; GRANT SELECT, DELETE ON ledger.principals TO `+cfg.User)
	pgtest.Exec(t, owner, block)
	// An upgrade's install runs again over it.
	if err := idemmigrate.Migrate(ctx, owner, idemmigrate.Options{}); err != nil {
		t.Fatalf("the install again, over the doc's constraint: %v", err)
	}
	if n := pgtest.Count(t, owner, `SELECT count(*) FROM pg_constraint WHERE conname = 'idempotency_keys_principal_fkey'`); n != 1 {
		t.Fatalf("%d constraints after the install again", n)
	}

	app := newPool(t, appURL)
	m, err := idem.New(ctx, idem.Options{DB: app, Logger: auditQuiet, Principal: func(r *http.Request) (string, bool) {
		return r.Header.Get("X-User"), true
	}})
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	ok201 := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusCreated) })
	mux.Handle("POST /tx", m.Route(idem.Route{Required: true})(ok201))
	mux.Handle("POST /lease", m.Route(idem.Route{Required: true, Lease: 10 * time.Second})(ok201))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	send := func(path, user, key string) (int, string) {
		s, _, b := pgtest.Send(t, ctx, "POST", srv.URL+path, `{}`, "Idempotency-Key", key, "Content-Type", "application/json", "X-User", user)
		return s, b
	}
	for _, path := range []string{"/tx", "/lease"} {
		if s, b := send(path, "alice", "k"+path); s != 201 {
			t.Errorf("%s as a known principal: %d %s", path, s, b)
		}
		s, b := send(path, "mallory", "k"+path)
		var p idem.Problem
		if err := json.Unmarshal([]byte(b), &p); err != nil || s != 401 || p.Code != "principal_unknown" {
			t.Errorf("%s as an unknown principal: %d %s; want 401 principal_unknown", path, s, b)
		}
	}
	if _, err := app.Exec(ctx, `DELETE FROM ledger.principals WHERE id = 'alice'`); err != nil {
		t.Fatalf("the service deletes its principal: %v", err)
	}
	if n := pgtest.Count(t, owner, `SELECT count(*) FROM idem.idempotency_keys WHERE principal_id = 'alice'`); n != 0 {
		t.Errorf("%d keys of a deleted principal", n)
	}
}

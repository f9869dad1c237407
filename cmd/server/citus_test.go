//go:build citus

package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestCitusReferenceServer: the reference server on a real Citus cluster (make test-citus,
// CITUS_URL), set up as docs/scale-out.md says: `server migrate` at the coordinator, then the
// page's own SQL (the ledger's tables made reference tables, then distribute.sql), run as it
// stands. Every ledger table is then a reference table (none left to Citus' automatic "local
// table", which it may undo); the API answers and replays; the key gauges appear in /metrics
// with the whole cluster's figures; `server keys` works as the operator role; the in-process
// cleaner and `server cleanup` empty the workers of expired keys.
func TestCitusReferenceServer(t *testing.T) {
	db := pgtest.CitusDB(t)
	mig := NewMain(io.Discard, io.Discard)
	if err := mig.ParseFlags([]string{"migrate"}, serverEnv(db, nil)); err != nil {
		t.Fatal(err)
	}
	if err := mig.Run(context.Background()); err != nil {
		t.Fatalf("migrate: %v", err)
	}
	_ = mig.Close()
	doc, err := os.ReadFile("../../docs/scale-out.md")
	if err != nil {
		t.Fatal(err)
	}
	block := regexp.MustCompile("(?s)```sql\n(SELECT create_reference_table\\(t\\).*?)```").FindSubmatch(doc)
	if block == nil {
		t.Fatal("docs/scale-out.md has no block that makes the ledger's tables reference tables")
	}
	pgtest.Psql(t, db, "-q", "-f", writeTemp(t, string(block[1])))

	s := serveOn(t, db, map[string]string{"PAYOUT_PROVIDER_DELAY": "0"})
	ledger := s.count(`SELECT count(*) FROM pg_class c WHERE c.relnamespace = 'ledger'::regnamespace AND c.relkind = 'r' AND c.relname <> 'schema_version'`)
	if n := s.count(`SELECT count(*) FROM pg_dist_partition p JOIN pg_class c ON c.oid = p.logicalrelid
		WHERE c.relnamespace = 'ledger'::regnamespace AND p.partmethod = 'n' AND p.repmodel = 't' AND NOT p.autoconverted`); n != ledger {
		t.Fatalf("%d of the ledger's %d tables are reference tables", n, ledger)
	}

	// The API through the coordinator: an account, a payout (a lease route), their replays.
	var ids []string
	for i := range 8 {
		id, token := s.principal(fmt.Sprint("p", i))
		ids = append(ids, id)
		r := s.call("POST", "/v1/accounts", token, "acc-1", `{"name":"main","currency":"EUR"}`, "Content-Type", "application/json")
		again := s.call("POST", "/v1/accounts", token, "acc-1", `{"name":"main","currency":"EUR"}`, "Content-Type", "application/json")
		if r.status != 201 || again.status != 201 || again.body != r.body || again.header.Get("Idempotent-Replayed") != "true" {
			t.Fatalf("an account and its replay: %+v / %+v", r, again)
		}
		if i == 0 {
			account := int(r.json(t)["id"].(float64))
			body := fmt.Sprintf(`{"account":%d,"amount":900}`, account)
			p := s.call("POST", "/v1/payouts", token, "pay-1", body, "Content-Type", "application/json")
			p2 := s.call("POST", "/v1/payouts", token, "pay-1", body, "Content-Type", "application/json")
			if p.status != 201 || p2.body != p.body || p2.header.Get("Idempotent-Replayed") != "true" {
				t.Fatalf("a payout and its replay: %+v / %+v", p, p2)
			}
		}
	}

	// Expired keys of every principal, so on every worker.
	for _, id := range ids {
		pgtest.InsertExpired(t, s.pool, id, 250)
	}
	metrics := s.call("GET", "/metrics", "", "", "").body
	for _, want := range []string{"idempotency_keys_in_progress 0\n", "idempotency_leases_run_out 0\n", "idempotency_cleanup_backlog 2000\n"} {
		if !strings.Contains(metrics, want) {
			t.Fatalf("/metrics on a coordinator lacks %q:\n%s", want, grepLines(metrics, "idempotency_"))
		}
	}
	bytes := s.count(`SELECT citus_total_relation_size('idem.idempotency_keys')::int`)
	if !strings.Contains(metrics, fmt.Sprintf("idempotency_key_table_bytes %d\n", bytes)) && !strings.Contains(metrics, fmt.Sprintf("idempotency_key_table_bytes %.6e\n", float64(bytes))) {
		t.Fatalf("/metrics on a coordinator: the key table's size is not Citus' %d bytes:\n%s", bytes, grepLines(metrics, "idempotency_"))
	}
	ops := loginRoleIn(t, db, "idem_operator")
	out, err := runCommand(t, ops, "keys")
	if err != nil || !strings.Contains(out, "cleanup backlog: 2000") || !regexp.MustCompile(`\(all\)\s+2009\s`).MatchString(out) {
		t.Fatalf("server keys on a coordinator: %v\n%s", err, out)
	}
	if out, err := runCommand(t, ops, "keys", "by-principal"); err != nil || len(regexp.MustCompile(`(?m)^p_\w+\s+25[12]\s`).FindAllString(out, -1)) != 8 {
		t.Fatalf("server keys by-principal on a coordinator: %v\n%s", err, out)
	}

	c := newCleaner(s.pool, 0, true, 0.4, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if n, ran, err := c.pass(context.Background()); err != nil || !ran || n != 2000 {
		t.Fatalf("the cleaner on a coordinator: %d deleted, ran %v, %v; want 2000", n, ran, err)
	}
	for _, id := range ids {
		pgtest.InsertExpired(t, s.pool, id, 10)
	}
	if out, err := runCommand(t, db, "cleanup"); err != nil || !strings.Contains(out, "deleted 80 expired keys") {
		t.Fatalf("server cleanup on a coordinator: %v\n%s", err, out)
	}
	if n := s.count(`SELECT count(*) FROM idem.idempotency_keys WHERE expires_at <= now()`); n != 0 {
		t.Fatalf("%d expired keys left", n)
	}
}

// writeTemp writes s to a file of the test's temporary directory and returns its path.
func writeTemp(t *testing.T, s string) string {
	t.Helper()
	f := t.TempDir() + "/block.sql"
	if err := os.WriteFile(f, []byte(s), 0o644); err != nil {
		t.Fatal(err)
	}
	return f
}

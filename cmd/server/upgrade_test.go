package main

import (
	"context"
	"crypto/sha256"
	"embed"
	"encoding/hex"
	"errors"
	"io"
	"io/fs"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/tern/v2/migrate"

	"github.com/pgidem/pgidem/internal/pgtest"
)

//go:embed testdata/release-0.1.0
var release010 embed.FS

// install010 installs release 0.1.0's SQL as that release's `server migrate` did.
func install010(t *testing.T, conn *pgx.Conn) {
	t.Helper()
	ctx := context.Background()
	sub := func(dir string) fs.FS {
		f, err := fs.Sub(release010, "testdata/release-0.1.0/"+dir)
		if err != nil {
			t.Fatal(err)
		}
		return f
	}
	data := map[string]any{"app_role": "idem_app"}
	pgtest.Exec(t, conn, `CREATE SCHEMA IF NOT EXISTS idem`)
	for _, step := range []struct{ table, dir string }{{"idem.schema_version", "idem/migrations"}, {"public.ledger_schema_version", "ledger"}} {
		m, err := migrate.NewMigrator(ctx, conn, step.table)
		if err != nil {
			t.Fatal(err)
		}
		m.Data = data
		if err := m.LoadMigrations(sub(step.dir)); err != nil {
			t.Fatal(err)
		}
		if err := m.Migrate(ctx); err != nil {
			t.Fatalf("0.1.0 %s: %v", step.dir, err)
		}
		if step.dir == "idem/migrations" {
			code, err := migrate.LoadCodePackage(sub("idem/functions"))
			if err != nil {
				t.Fatal(err)
			}
			if err := migrate.InstallCodePackage(ctx, conn, data, code); err != nil {
				t.Fatalf("0.1.0 functions: %v", err)
			}
		}
	}
}

// TestUpgradeFrom010: a database filled by release 0.1.0 (through its own functions) is
// migrated by this version; every key it stored still answers as it did.
func TestUpgradeFrom010(t *testing.T) {
	t.Parallel()
	url := pgtest.NewEmptyDB(t)
	conn := pgtest.Connect(t, url)
	ctx := context.Background()
	install010(t, conn)

	fields := `{"amount": "` + hexSum("100") + `", "to": "` + hexSum("2") + `"}`
	pgtest.Exec(t, conn, `INSERT INTO principals VALUES ('p_alice', 'alice');
		INSERT INTO accounts (principal_id, name, currency, balance) VALUES ('p_alice', 'main', 'EUR', 500)`)
	for _, sql := range []string{
		// a completed transfer, with field hashes and a resource id
		`BEGIN;
		 SELECT idem.idem_begin('p_alice', 'k-done', 'POST /v1/transfers', sha256('done'), p_request_fields => '` + fields + `');
		 SELECT idem.idem_complete('p_alice', 'k-done', 1, 201, '{"Content-Type": "application/json", "Location": "/v1/transfers/1", "Vary": ["Accept", "Origin"]}',
		                           '{"id":1}', '1');
		 COMMIT`,
		// a final error stored on its own
		`SELECT idem.idem_save_final('p_alice', 'k-final', 'POST /v1/transfers', sha256('final'), '24 hours', 422,
		                             '{"Content-Type": "application/problem+json"}', '{"code":"insufficient_funds"}')`,
		// a one-time secret
		`BEGIN;
		 SELECT idem.idem_begin('p_alice', 'k-secret', 'POST /v1/api-tokens', sha256('secret'));
		 SELECT idem.idem_complete('p_alice', 'k-secret', 1, 201, '{}', NULL, '9', 'one_time_secret');
		 COMMIT`,
		// a lease still running, taken over once (attempt 2)
		`SELECT idem.idem_begin('p_alice', 'k-lease', 'POST /v1/jobs', sha256('job'), p_lease => '10 minutes')`,
		`UPDATE idem.idempotency_keys SET lease_expires_at = now() - interval '1 s' WHERE key = 'k-lease'`,
		`SELECT idem.idem_begin('p_alice', 'k-lease', 'POST /v1/jobs', sha256('job'), p_lease => '10 minutes')`,
	} {
		pgtest.Exec(t, conn, sql)
	}

	// This version's migrate.
	m := NewMain(io.Discard, io.Discard)
	if err := m.ParseFlags([]string{"migrate"}, func(k string) string {
		if k == "DATABASE_URL" {
			return url
		}
		return ""
	}); err != nil {
		t.Fatal(err)
	}
	if err := m.Run(ctx); err != nil {
		t.Fatalf("migrate over 0.1.0: %v", err)
	}
	_ = m.Close()
	if err := checkMigrated(ctx, conn); err != nil {
		t.Fatalf("after migrate: %v", err)
	}

	type row struct {
		outcome  string
		attempt  int64
		status   *int32
		headers  map[string]any
		body     *string
		resource *string
		withheld *string
		changed  []string
	}
	begin := func(key, action, body string, fields *string) row {
		t.Helper()
		var r row
		if err := conn.QueryRow(ctx, `SELECT outcome, attempt, response_status, response_headers, convert_from(response_body, 'UTF8'),
			resource_id, withheld, changed_fields
			FROM idem.idem_begin('p_alice', $1, $2, sha256($3::bytea), p_request_fields => $4::jsonb)`, key, action, body, fields).
			Scan(&r.outcome, &r.attempt, &r.status, &r.headers, &r.body, &r.resource, &r.withheld, &r.changed); err != nil {
			t.Fatalf("idem_begin %s: %v", key, err)
		}
		return r
	}
	r := begin("k-done", "POST /v1/transfers", "done", nil)
	if r.outcome != "replay" || *r.status != 201 || *r.body != `{"id":1}` || *r.resource != "1" ||
		r.headers["Location"] != "/v1/transfers/1" || r.headers["Vary"] != "Accept, Origin" {
		t.Fatalf("the completed key after the upgrade: %+v", r)
	}
	other := `{"amount": "` + hexSum("999") + `", "to": "` + hexSum("2") + `"}`
	if r := begin("k-done", "POST /v1/transfers", "other", &other); r.outcome != "mismatch" || len(r.changed) != 1 || r.changed[0] != "amount" {
		t.Fatalf("a mismatch on an upgraded key: %+v", r)
	}
	if r := begin("k-final", "POST /v1/transfers", "final", nil); r.outcome != "replay" || *r.status != 422 || *r.body != `{"code":"insufficient_funds"}` {
		t.Fatalf("the final error after the upgrade: %+v", r)
	}
	if r := begin("k-secret", "POST /v1/api-tokens", "secret", nil); r.outcome != "replay" || *r.withheld != "one_time_secret" || r.body != nil {
		t.Fatalf("the secret after the upgrade: %+v", r)
	}
	if r := begin("k-lease", "POST /v1/jobs", "job", nil); r.outcome != "in_progress" || r.attempt != 2 {
		t.Fatalf("the running lease after the upgrade: %+v", r)
	}
	pgtest.Exec(t, conn, `SELECT idem.idem_complete('p_alice', 'k-lease', 2, 200, '{}', 'done')`)
	pgtest.Exec(t, conn, `BEGIN`)
	defer func() { _, _ = conn.Exec(ctx, `ROLLBACK`) }()
	if r := begin("k-new", "POST /v1/transfers", "new", nil); r.outcome != "claimed" || r.attempt <= 2 {
		t.Fatalf("a new claim after the upgrade: %+v (its token must be above every 0.1.0 token)", r)
	}
	pgtest.Exec(t, conn, `ROLLBACK`)
	var code string
	err := conn.QueryRow(ctx, `SELECT outcome FROM idem.idem_begin('p_nobody', 'k', 'a', sha256('x'))`).Scan(&code)
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "23503" || pgErr.TableName != "idempotency_keys" {
		t.Fatalf("an unknown principal after the upgrade: %v, want 23503 from the principal reference", err)
	}
	if n := pgtest.Count(t, conn, `SELECT balance FROM ledger.accounts WHERE principal_id = 'p_alice'`); n != 500 {
		t.Fatalf("the ledger's account after the upgrade: balance %d", n)
	}
}

func hexSum(s string) string {
	h := sha256.Sum256([]byte(s))
	return hex.EncodeToString(h[:])
}

package main

import (
	"bytes"
	"context"
	"crypto/sha256"
	"embed"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/tern/v2/migrate"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/canon"
	"github.com/pgidem/pgidem/internal/pgtest"
	idemsql "github.com/pgidem/pgidem/sql"
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
		// an answer without any of the headers 0.1.0 kept (its '{}'), one with headers 0.1.0
		// took though they are not strings, and field hashes 0.1.0 took though they are not hex
		`BEGIN;
		 SELECT idem.idem_begin('p_alice', 'k-noheaders', 'POST /v1/transfers', sha256('noheaders'));
		 SELECT idem.idem_complete('p_alice', 'k-noheaders', 1, 204, '{}', NULL);
		 COMMIT`,
		`BEGIN;
		 SELECT idem.idem_begin('p_alice', 'k-oddheaders', 'POST /v1/transfers', sha256('oddheaders'),
		                        p_request_fields => '{"a": "not hex at all", "b": "ab", "c": 7, "d": "` + hexSum("d") + `"}');
		 SELECT idem.idem_complete('p_alice', 'k-oddheaders', 1, 200,
		                           '{"X-Count": 5, "X-Flag": true, "X-None": null, "Vary": [], "Link": ["<a>", 2]}', 'ok');
		 COMMIT`,
		// a lease still running, taken over once (attempt 2)
		`SELECT idem.idem_begin('p_alice', 'k-lease', 'POST /v1/jobs', sha256('job'), p_lease => '10 minutes')`,
		`UPDATE idem.idempotency_keys SET lease_expires_at = now() - interval '1 s' WHERE key = 'k-lease'`,
		`SELECT idem.idem_begin('p_alice', 'k-lease', 'POST /v1/jobs', sha256('job'), p_lease => '10 minutes')`,
		`UPDATE idem.idempotency_keys SET created_at = created_at - interval '1 minute' WHERE key = 'k-lease'`,
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
	// Every stored answer is one this version's driver reads: headers an object of strings.
	if n := pgtest.Count(t, conn, `SELECT count(*) FROM idem.idempotency_keys WHERE response_status IS NOT NULL
		AND (response_headers IS NULL OR jsonb_typeof(response_headers) <> 'object'
		     OR jsonb_path_exists(response_headers, 'strict $.* ? (@.type() != "string")'))`); n != 0 {
		t.Fatalf("%d upgraded answers whose headers are not an object of strings", n)
	}
	for _, k := range []struct{ key, action, body string }{{"k-done", "POST /v1/transfers", "done"},
		{"k-final", "POST /v1/transfers", "final"}, {"k-secret", "POST /v1/api-tokens", "secret"},
		{"k-noheaders", "POST /v1/transfers", "noheaders"}, {"k-oddheaders", "POST /v1/transfers", "oddheaders"}} {
		d, err := idem.Begin(ctx, conn, idem.Claim{Principal: "p_alice", Key: k.key, Action: k.action, Fingerprint: sha256.Sum256([]byte(k.body))})
		if err != nil || d.Outcome != idem.Replay {
			t.Fatalf("%s through the driver after the upgrade: %+v %v, want a replay", k.key, d, err)
		}
	}
	if d, _ := idem.Begin(ctx, conn, idem.Claim{Principal: "p_alice", Key: "k-oddheaders", Action: "POST /v1/transfers",
		Fingerprint: sha256.Sum256([]byte("oddheaders"))}); d.Response.Status != 200 || string(d.Response.Body) != "ok" ||
		d.Response.Header.Get("X-Count") != "5" || d.Response.Header.Get("X-Flag") != "true" || d.Response.Header.Get("Link") != "<a>, 2" ||
		d.Response.Header.Get("X-None") != "" || d.Response.Header.Get("Vary") != "" {
		t.Fatalf("the odd headers after the upgrade: %+v", d.Response)
	}
	if d, _ := idem.Begin(ctx, conn, idem.Claim{Principal: "p_alice", Key: "k-noheaders", Action: "POST /v1/transfers",
		Fingerprint: sha256.Sum256([]byte("noheaders"))}); d.Response.Status != 204 || len(d.Response.Header) != 0 {
		t.Fatalf("the answer without headers after the upgrade: %+v", d.Response)
	}
	odd := `{"a": "` + hexSum("a") + `", "b": "` + hexSum("b") + `", "c": "` + hexSum("c") + `", "d": "` + hexSum("d") + `"}`
	if r := begin("k-oddheaders", "POST /v1/transfers", "other", &odd); r.outcome != "mismatch" || strings.Join(r.changed, ",") != "a,b,c" {
		t.Fatalf("a mismatch on a key whose 0.1.0 field hashes were not hex: %+v, want a, b and c changed", r)
	}

	if r := begin("k-lease", "POST /v1/jobs", "job", nil); r.outcome != "in_progress" || r.attempt != 2 {
		t.Fatalf("the running lease after the upgrade: %+v", r)
	}
	// 0.1.0's lease claim keeps when it was made, so operators see it (idem_health, the
	// stuck-lease gauge and alert): claimed_at is 0.1.0's created_at.
	var health struct{ inProgress int64 }
	if err := conn.QueryRow(ctx, `SELECT in_progress FROM idem.idem_health()`).Scan(&health.inProgress); err != nil || health.inProgress != 1 {
		t.Fatalf("idem_health after the upgrade: %d claims in progress (%v), want 0.1.0's lease claim", health.inProgress, err)
	}
	if n := pgtest.Count(t, conn, `SELECT count(*) FROM idem.idempotency_keys WHERE key = 'k-lease'
		AND claimed_at IS NOT NULL AND claimed_at <= now() - interval '50 seconds'`); n != 1 {
		t.Fatal("0.1.0's lease claim has no claim time (or a new one) after the upgrade")
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

// release010Deposit is the keyed deposit of release 0.1.0's server, as that release served it
// (cmd/server and internal/http at commit 281238e): one transaction with BEGIN, idem_begin
// (0.1.0's signature, the fingerprint of canon), the deposit, idem_complete (an integer
// attempt) and COMMIT; a replay answers the stored response; a lock timeout is 409, any
// other failure 503. It runs against the database while this release's migrate runs, as the
// servers of the previous release do during a rolling upgrade.
func release010Deposit(pool *pgxpool.Pool, principal string) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		ctx := r.Context()
		body, _ := io.ReadAll(r.Body)
		key := r.Header.Get("Idempotency-Key")
		fp := canon.Compute(r.Method, r.URL.EscapedPath(), body)
		fields, _ := json.Marshal(fp.Fields)
		fail := func(err error) {
			var pgErr *pgconn.PgError
			if errors.As(err, &pgErr) && pgErr.Code == "55P03" {
				http.Error(w, "request_in_progress", http.StatusConflict)
				return
			}
			http.Error(w, "store_unavailable: "+err.Error(), http.StatusServiceUnavailable)
		}
		tx, err := pool.Begin(ctx)
		if err != nil {
			fail(err)
			return
		}
		defer tx.Rollback(context.WithoutCancel(ctx))
		var outcome string
		var attempt int32
		var status *int32
		var stored []byte
		if err := tx.QueryRow(ctx, `SELECT outcome, attempt::integer, response_status, response_body
			FROM idem.idem_begin(p_principal => $1::text, p_key => $2::text, p_action => $3::text,
			                     p_request_sha256 => $4::bytea, p_request_fields => $5::jsonb)`,
			principal, key, "POST /v1/accounts/{id}/deposits", fp.Sum[:], string(fields)).Scan(&outcome, &attempt, &status, &stored); err != nil {
			fail(err)
			return
		}
		switch outcome {
		case "replay":
			w.Header().Set("Idempotent-Replayed", "true")
			w.WriteHeader(int(*status))
			_, _ = w.Write(stored)
			return
		case "claimed":
		default:
			http.Error(w, outcome, http.StatusConflict)
			return
		}
		var in struct{ Amount int64 }
		_ = json.Unmarshal(body, &in)
		var out struct {
			ID        int64     `json:"id"`
			AccountID int64     `json:"account_id"`
			Amount    int64     `json:"amount"`
			Balance   int64     `json:"balance"`
			CreatedAt time.Time `json:"created_at"`
		}
		if err := tx.QueryRow(ctx, `UPDATE accounts SET balance = balance + $1, version = version + 1 WHERE id = 1
			RETURNING balance`, in.Amount).Scan(&out.Balance); err != nil {
			fail(err)
			return
		}
		if err := tx.QueryRow(ctx, `INSERT INTO deposits (account_id, amount, idempotency_key) VALUES (1, $1, $2)
			RETURNING id, account_id, amount, created_at`, in.Amount, key).Scan(&out.ID, &out.AccountID, &out.Amount, &out.CreatedAt); err != nil {
			fail(err)
			return
		}
		resp, _ := json.Marshal(out)
		resp = append(resp, '\n')
		if _, err := tx.Exec(ctx, `SELECT idem.idem_complete(p_principal => $1::text, p_key => $2::text, p_attempt => $3::integer,
			p_status => 201, p_headers => $4::jsonb, p_body => $5::bytea)`, principal, key, attempt,
			`{"Content-Type": "application/json"}`, resp); err != nil {
			fail(err)
			return
		}
		if err := tx.Commit(ctx); err != nil {
			fail(err)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write(resp)
	}
}

// TestUpgradeUnderTraffic: release 0.1.0's server keeps serving keyed deposits from several
// clients while this release's `server migrate` rebuilds a key table large enough that the
// copy takes seconds. Afterwards every deposit the old server answered 2xx replays byte for
// byte through this release's server, the others run once when retried, and the balance
// equals the deposits, one per key. Migration 003 locks the old table before it copies it:
// without the lock, keys committed to the old table during the copy were dropped with it and
// their retries deposited again.
func TestUpgradeUnderTraffic(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.NewEmptyDB(t)
	conn := pgtest.Connect(t, url)
	install010(t, conn)
	token, sum := newToken()
	pgtest.Exec(t, conn, `INSERT INTO principals VALUES ('p_alice', 'alice');
		INSERT INTO accounts (principal_id, name, currency) VALUES ('p_alice', 'main', 'EUR')`)
	pgtest.Exec(t, conn, `INSERT INTO api_tokens (principal_id, name, token_sha256) VALUES ('p_alice', 'initial', $1)`, sum)
	// A key table of 0.1.0 holding 120,000 completed keys of another principal.
	pgtest.Exec(t, conn, `INSERT INTO principals VALUES ('p_fill', 'fill')`)
	pgtest.Exec(t, conn, `INSERT INTO idem.idempotency_keys (principal_id, key, state, attempt, created_at, expires_at,
		action, request_sha256, request_fields, completed_at, response_status, response_headers, response_body, resource_id)
		SELECT 'p_fill', 'fill-' || g, 'completed', 1, now(), now() + interval '1 day', 'POST /v1/accounts/{id}/deposits',
		       sha256(g::text::bytea), jsonb_build_object('amount', encode(sha256(g::text::bytea), 'hex')), now(), 201,
		       '{"Content-Type": "application/json", "Location": "/v1/accounts/9/deposits/1"}',
		       convert_to('{"id":' || g || ',"account_id":9,"amount":1}', 'UTF8'), g::text
		  FROM generate_series(1, 120000) AS g`)

	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 8
	oldPool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer oldPool.Close()
	oldMux := http.NewServeMux()
	oldMux.Handle("POST /v1/accounts/1/deposits", release010Deposit(oldPool, "p_alice"))
	old := httptest.NewServer(oldMux)
	defer old.Close()

	type answer struct {
		status int
		body   string
	}
	var (
		mu       sync.Mutex
		answers  = map[string]answer{} // key -> what the old server answered
		stop     = make(chan struct{})
		wg       sync.WaitGroup
		ok2xx    atomic.Int64
		migrated atomic.Bool
		during   atomic.Int64 // 2xx answers while the migrate ran
	)
	const clients = 6
	for c := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				key := fmt.Sprintf("old-%d-%d", c, i)
				status, _, body := pgtest.Send(t, ctx, "POST", old.URL+"/v1/accounts/1/deposits", `{"amount":1}`,
					"Idempotency-Key", key, "Content-Type", "application/json")
				mu.Lock()
				answers[key] = answer{status, body}
				mu.Unlock()
				if status/100 == 2 {
					ok2xx.Add(1)
					if !migrated.Load() {
						during.Add(1)
					}
				}
			}
		}()
	}
	for ok2xx.Load() < 50 {
		time.Sleep(10 * time.Millisecond)
	}

	start := time.Now()
	var migrateLog bytes.Buffer
	m := NewMain(io.Discard, &migrateLog)
	if err := m.ParseFlags([]string{"migrate"}, serverEnv(url, nil)); err != nil {
		t.Fatal(err)
	}
	err = m.Run(ctx)
	_ = m.Close()
	took := time.Since(start)
	migrated.Store(true)
	time.Sleep(300 * time.Millisecond) // the old server keeps answering after the switch
	close(stop)
	wg.Wait()
	if err != nil {
		t.Fatalf("migrate under traffic: %v\n%s", err, migrateLog.String())
	}
	t.Logf("migrate took %v over 120,000 keys; the old server answered %d requests, %d of them 2xx (%d while the migrate ran)",
		took.Round(time.Millisecond), len(answers), ok2xx.Load(), during.Load())

	s := serveOn(t, url, nil)
	replayed, fresh := 0, 0
	for key, a := range answers {
		r := s.call("POST", "/v1/accounts/1/deposits", token, key, `{"amount":1}`, "Content-Type", "application/json")
		switch {
		case a.status/100 == 2:
			if r.status != a.status || r.body != a.body || r.header.Get("Idempotent-Replayed") != "true" {
				t.Errorf("key %s: the old server answered %d %s; the retry through the new server got %d %s (replayed %q)",
					key, a.status, a.body, r.status, r.body, r.header.Get("Idempotent-Replayed"))
			}
			replayed++
		case r.status != http.StatusCreated:
			t.Errorf("key %s: the old server answered %d; the retry got %d %s", key, a.status, r.status, r.body)
		default:
			fresh++
		}
	}
	var balance, deposits, keys int
	if err := conn.QueryRow(ctx, `SELECT (SELECT balance FROM ledger.accounts WHERE id = 1),
		(SELECT count(*) FROM ledger.deposits), (SELECT count(DISTINCT idempotency_key) FROM ledger.deposits)`).
		Scan(&balance, &deposits, &keys); err != nil {
		t.Fatal(err)
	}
	if balance != deposits || deposits != keys || keys != len(answers) {
		t.Fatalf("balance %d, %d deposits under %d distinct keys, %d keys sent: every key must take effect exactly once",
			balance, deposits, keys, len(answers))
	}
	t.Logf("%d replays of the old server's 2xx, %d retries that ran for the first time", replayed, fresh)
}

// migrateDB runs this release's `server migrate` against url.
func migrateDB(t *testing.T, url string) error {
	t.Helper()
	m := NewMain(io.Discard, io.Discard)
	if err := m.ParseFlags([]string{"migrate"}, serverEnv(url, nil)); err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	return m.Run(context.Background())
}

// TestMigrateIsAllOrNothing: the migrations and the function install commit together. A
// migrate that fails in the function install leaves a 0.1.0 database exactly as it was (its
// schema version, its table, its functions); the next migrate, once the cause is gone, does
// the whole upgrade.
func TestMigrateIsAllOrNothing(t *testing.T) {
	t.Parallel()
	url := pgtest.NewEmptyDB(t)
	conn := pgtest.Connect(t, url)
	install010(t, conn)
	// A function in the way: the install cannot replace it (another result type).
	pgtest.Exec(t, conn, `CREATE FUNCTION idem.idem_version() RETURNS integer LANGUAGE sql AS 'SELECT 1'`)
	if err := migrateDB(t, url); err == nil {
		t.Fatal("migrate succeeded over a function it cannot replace")
	}
	if v := pgtest.Count(t, conn, `SELECT version FROM idem.schema_version`); v != 2 {
		t.Fatalf("after a failed migrate idem.schema_version is %d, want 0.1.0's 2", v)
	}
	if n := pgtest.Count(t, conn, `SELECT count(*) FROM information_schema.columns
		WHERE table_schema = 'idem' AND table_name = 'idempotency_keys' AND column_name = 'created_at'`); n != 1 {
		t.Fatal("after a failed migrate the key table is no longer 0.1.0's")
	}
	pgtest.Exec(t, conn, `DROP FUNCTION idem.idem_version()`)
	if err := migrateDB(t, url); err != nil {
		t.Fatalf("migrate once the cause is gone: %v", err)
	}
	if err := checkMigrated(context.Background(), conn); err != nil {
		t.Fatal(err)
	}
}

// TestHalfInstalledIsRefused: a database whose schema is at this release's version beside the
// functions of 0.1.0 (what an installer that committed the migrations and the functions
// separately left when it stopped in between) is refused by serve, and by /healthz of a
// server already running; the next migrate repairs it and the stored key replays.
func TestHalfInstalledIsRefused(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.NewEmptyDB(t)
	conn := pgtest.Connect(t, url)
	install010(t, conn)
	pgtest.Exec(t, conn, `INSERT INTO principals VALUES ('p_x', 'x')`)
	pgtest.Exec(t, conn, `SELECT idem.idem_save_final('p_x', 'k-old', 'POST /t', sha256('old'), '1 day', 422, '{}', 'no')`)
	m, err := migrate.NewMigrator(ctx, conn, idemsql.VersionTable)
	if err != nil {
		t.Fatal(err)
	}
	if m.Data, err = idemsql.TemplateData(idemsql.Options{}); err != nil {
		t.Fatal(err)
	}
	if err := m.LoadMigrations(idemsql.Migrations()); err != nil {
		t.Fatal(err)
	}
	if err := m.Migrate(ctx); err != nil { // the migrations only: 0.1.0's functions stay
		t.Fatal(err)
	}
	serve := NewMain(io.Discard, io.Discard)
	if err := serve.ParseFlags(nil, serverEnv(url, nil)); err != nil {
		t.Fatal(err)
	}
	err = serve.Run(ctx)
	_ = serve.Close()
	if !errors.Is(err, errNotMigrated) {
		t.Fatalf("serve on a schema beside 0.1.0's functions: %v, want %v", err, errNotMigrated)
	}
	if err := migrateDB(t, url); err != nil {
		t.Fatal(err)
	}
	s := serveOn(t, url, nil)
	if r := s.call("GET", "/healthz", "", "", ""); r.status != 200 {
		t.Fatalf("/healthz after the repair: %d %s", r.status, r.body)
	}
	var outcome string
	if err := conn.QueryRow(ctx, `SELECT outcome FROM idem.idem_begin('p_x', 'k-old', 'POST /t', sha256('old'))`).Scan(&outcome); err != nil || outcome != "replay" {
		t.Fatalf("the key stored before: %q, %v", outcome, err)
	}

	// Functions of another version appear under the running server: /healthz says so.
	pgtest.Exec(t, conn, `CREATE OR REPLACE FUNCTION idem.idem_version(OUT functions_version integer, OUT schema_version integer)
		LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS 'SELECT 2, (SELECT version FROM idem.schema_version)'`)
	if r := s.call("GET", "/healthz", "", "", ""); r.status != 503 || !strings.Contains(r.body, "functions belong to schema version 2") {
		t.Fatalf("/healthz beside functions of another version: %d %s", r.status, r.body)
	}
	if err := migrateDB(t, url); err != nil {
		t.Fatal(err)
	}
	if r := s.call("GET", "/healthz", "", "", ""); r.status != 200 {
		t.Fatalf("/healthz after migrate: %d %s", r.status, r.body)
	}
}

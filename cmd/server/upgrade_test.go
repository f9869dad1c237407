package main

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"strconv"
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
	"github.com/pgidem/pgidem/internal/pgtest"
	"github.com/pgidem/pgidem/internal/release010"
	idemsql "github.com/pgidem/pgidem/sql"
)

// install010 installs release 0.1.0's SQL as that release's `server migrate` did.
func install010(t *testing.T, conn *pgx.Conn) {
	t.Helper()
	if err := release010.Install(context.Background(), conn); err != nil {
		t.Fatal(err)
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

// release010Deposit is the keyed deposit of release 0.1.0's server (release010.Deposit).
func release010Deposit(pool *pgxpool.Pool, principal string) http.HandlerFunc {
	return release010.Deposit(pool, principal)
}

// oldRequest is one request of the old server in TestUpgradeUnderTraffic.
type oldRequest struct {
	began, ended time.Time
	status       int
	body         string
}

func TestUpgradeUnderTraffic(t *testing.T) {
	t.Parallel()
	fill := 120000
	if v := os.Getenv("UPGRADE_KEYS"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 {
			t.Fatalf("UPGRADE_KEYS=%q: want a number of keys", v)
		}
		fill = n
	}
	ctx := context.Background()
	url := pgtest.NewEmptyDB(t)
	conn := pgtest.Connect(t, url)
	install010(t, conn)
	token, sum := newToken()
	pgtest.Exec(t, conn, `INSERT INTO principals VALUES ('p_alice', 'alice');
		INSERT INTO accounts (principal_id, name, currency) VALUES ('p_alice', 'main', 'EUR')`)
	pgtest.Exec(t, conn, `INSERT INTO api_tokens (principal_id, name, token_sha256) VALUES ('p_alice', 'initial', $1)`, sum)
	// A key table of 0.1.0 holding fill completed keys of another principal.
	if err := release010.Fill(ctx, conn, fill); err != nil {
		t.Fatal(err)
	}

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
		// Every request the old server answered: when it was sent and answered, and how.
		sent []oldRequest
		// When idem's migrate committed: the swap (its schema version moved on).
		swapped atomic.Pointer[time.Time]
	)
	var start time.Time
	go func() {
		for !migrated.Load() {
			var v int
			if err := oldPool.QueryRow(ctx, `SELECT version FROM idem.schema_version`).Scan(&v); err == nil && v >= 3 {
				now := time.Now()
				swapped.Store(&now)
				return
			}
			time.Sleep(2 * time.Millisecond)
		}
	}()
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
				began := time.Now()
				status, _, body := pgtest.Send(t, ctx, "POST", old.URL+"/v1/accounts/1/deposits", `{"amount":1}`,
					"Idempotency-Key", key, "Content-Type", "application/json")
				mu.Lock()
				answers[key] = answer{status, body}
				sent = append(sent, oldRequest{began: began, ended: time.Now(), status: status, body: body})
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

	start = time.Now()
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
	t.Logf("migrate took %v over %d keys; the old server answered %d requests, %d of them 2xx (%d while the migrate ran)",
		took.Round(time.Millisecond), fill, len(answers), ok2xx.Load(), during.Load())
	// The old server's requests while idem's migrate ran, until it committed (the swap): their
	// answers and the slowest; those it was still working on at the swap (they waited on the
	// swap's lock, which lasts milliseconds, and resume against the new table with statements
	// planned for the old one: the old release answers them 503, retryable); and, after the
	// swap, the reference server's own ledger migration, which moves the ledger's tables out of
	// the schema 0.1.0's server reads them from (not idem's: not counted).
	swapAt := swapped.Load()
	if swapAt == nil {
		t.Fatal("the swap's commit was not seen")
	}
	// The swap is seen by polling the version every 2 ms: an answer in the last swapSeen
	// before it was seen may have come after the commit.
	const swapSeen = 20 * time.Millisecond
	before, atSwap := map[int]int{}, map[int]int{}
	var slowest time.Duration
	var sample string
	for _, r := range sent {
		// A statement planned for the old table that resumes against the new one fails on a
		// column the new table lacks: that can only happen once the swap has committed, however
		// late the poller saw it.
		afterSwap := strings.Contains(r.body, `column "created_at"`)
		switch {
		case afterSwap && r.began.Before(*swapAt):
			atSwap[r.status]++
		case r.began.After(start) && r.ended.Before(swapAt.Add(-swapSeen)):
			before[r.status]++
			slowest = max(slowest, r.ended.Sub(r.began))
			if r.status >= 500 && sample == "" {
				sample = r.body
			}
		case r.began.Before(*swapAt) && !r.ended.Before(swapAt.Add(-swapSeen)):
			atSwap[r.status]++
		}
	}
	t.Logf("the old server during the migrate, until it committed after %v: %v, the slowest %v; in flight at the swap: %v",
		swapAt.Sub(start).Round(time.Millisecond), before, slowest.Round(time.Millisecond), atSwap)
	for status, n := range before {
		if status >= 500 {
			t.Errorf("%d answers %d from the old server before the migrate committed, e.g. %s: want none", n, status, sample)
		}
	}
	// A behaviour check, not a speed target (the target, a second, is make bench's): a request
	// that waited out its lock timeout (2 s) on a locked table would take longer than this.
	if slowest >= 2*time.Second {
		t.Errorf("the old server's slowest request before the migrate committed took %v: it waited out a lock timeout", slowest)
	}

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

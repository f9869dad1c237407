package tests

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/internal/pgtest"
	"github.com/pgidem/pgidem/internal/release020"
	idemsql "github.com/pgidem/pgidem/sql"
)

// upBegin is every column idem_begin returns (0.2.0's columns, which this release keeps).
type upBegin struct {
	Outcome     string
	Attempt     int64
	Status      *int32
	Headers     map[string]any
	Body        []byte
	Resource    *string
	Withheld    *string
	Changed     []string
	RetryAfter  *time.Duration
	ProviderKey *string
}

type upQuerier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// upCallBegin calls idem_begin with 0.2.0's named arguments, as its driver did.
func upCallBegin(t *testing.T, q upQuerier, principal, key, action, body string, ttl, lease, fields *string) upBegin {
	t.Helper()
	var r upBegin
	if err := q.QueryRow(context.Background(), `SELECT outcome, attempt, response_status, response_headers, response_body,
		resource_id, withheld, changed_fields, retry_after, provider_key
		FROM idem.idem_begin(p_principal => $1, p_key => $2, p_action => $3, p_request_sha256 => sha256($4::bytea),
		                     p_ttl => coalesce($5::interval, interval '24 hours'), p_lease => $6::interval, p_request_fields => $7::jsonb)`,
		principal, key, action, body, ttl, lease, fields).
		Scan(&r.Outcome, &r.Attempt, &r.Status, &r.Headers, &r.Body, &r.Resource, &r.Withheld, &r.Changed, &r.RetryAfter, &r.ProviderKey); err != nil {
		t.Fatalf("idem_begin %s: %v", key, err)
	}
	return r
}

func upStr(s string) *string { return &s }

func upHex(s string) string {
	h := sha256.Sum256([]byte(s))
	return hex.EncodeToString(h[:])
}

// up020DB is an empty database that release 0.2.0's own `server migrate` installed, with
// principal p_a in its ledger.
func up020DB(t *testing.T) (string, *pgx.Conn) {
	t.Helper()
	if _, err := release020.Binary(); err != nil {
		t.Fatal(err)
	}
	url := pgtest.NewEmptyDB(t)
	if err := release020.Migrate(context.Background(), url); err != nil {
		t.Fatal(err)
	}
	conn := pgtest.Connect(t, url)
	pgtest.Exec(t, conn, `INSERT INTO ledger.principals (id, name) VALUES ('p_a', 'a')`)
	return url, conn
}

func upMigrate(t *testing.T, url string) {
	t.Helper()
	c := pgtest.Connect(t, url)
	if err := idemsql.Migrate(context.Background(), c, idemsql.Options{}); err != nil {
		t.Fatalf("this tree's migrate over 0.2.0: %v", err)
	}
}

// upCatalog is installed's listing without what differs by design after an upgrade from 0.2.0:
// token_seq starts 2^32 above 0.2.0's tokens (D99), and the reference server's ledger adds a
// foreign key to its principals (docs/operations.md).
func upCatalog(s string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.HasPrefix(l, "sequence idem.token_seq ") || strings.Contains(l, "idempotency_keys_principal_fkey") {
			continue
		}
		out = append(out, l)
	}
	return strings.Join(out, "\n")
}

// TestUpgrade020CatalogMatchesFresh: a database installed by 0.2.0 and migrated by this
// tree has the catalog of schema idem a fresh install has: the same functions (no 0.2.0
// function left over with its old body), attributes and grants; the roles can call
// everything they could, nothing more.
func TestUpgrade020CatalogMatchesFresh(t *testing.T) {
	t.Parallel()
	url, conn := up020DB(t)
	upMigrate(t, url)
	fresh := pgtest.Connect(t, pgtest.NewEmptyDB(t))
	if err := idemsql.Migrate(context.Background(), fresh, idemsql.Options{}); err != nil {
		t.Fatal(err)
	}
	got, want := upCatalog(installed(t, conn)), upCatalog(installed(t, fresh))
	if got != want {
		g, w := strings.Split(got, "\n"), strings.Split(want, "\n")
		gs, ws := map[string]bool{}, map[string]bool{}
		for _, l := range g {
			gs[l] = true
		}
		for _, l := range w {
			ws[l] = true
		}
		var extra, missing []string
		for _, l := range g {
			if !ws[l] {
				extra = append(extra, l)
			}
		}
		for _, l := range w {
			if !gs[l] {
				missing = append(missing, l)
			}
		}
		t.Fatalf("schema idem upgraded from 0.2.0 differs from a fresh install:\nonly after the upgrade:\n  %s\nonly in a fresh install:\n  %s",
			strings.Join(extra, "\n  "), strings.Join(missing, "\n  "))
	}
}

// TestUpgrade020RowsOfEveryState: rows of every state that 0.2.0's functions stored, then
// this tree's migrate: every completed key replays byte for byte (and with the provider key
// 0.2.0 gave), a mismatch names the changed fields, lease claims in progress keep their
// provider keys (in idem_begin, idem_stuck, a takeover, idem_release_stuck), expired keys are
// absent, and idem_cleanup deletes what expired and nothing else.
func TestUpgrade020RowsOfEveryState(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url, conn := up020DB(t)
	fields := upStr(`{"amount": "` + upHex("100") + `", "to": "` + upHex("2") + `"}`)
	hour, tenMin, oneSec := upStr("1 hour"), upStr("10 minutes"), upStr("1 second")

	// Completed by a transactional claim, with fields and a body with every byte value.
	pgtest.Exec(t, conn, `BEGIN`)
	r := upCallBegin(t, conn, "p_a", "tx-done", "POST /t", "tx-done", hour, nil, fields)
	pgtest.Exec(t, conn, `SELECT idem.idem_complete('p_a', 'tx-done', $1, 201,
		'{"Content-Type": "application/octet-stream", "Location": "/t/1"}', (SELECT string_agg(set_byte('\x00'::bytea, 0, g), ''::bytea) FROM generate_series(0, 255) g), 'r1')`, r.Attempt)
	pgtest.Exec(t, conn, `COMMIT`)
	// Completed without fields.
	pgtest.Exec(t, conn, `BEGIN`)
	r = upCallBegin(t, conn, "p_a", "tx-nofields", "POST /t", "tx-nofields", hour, nil, nil)
	pgtest.Exec(t, conn, `SELECT idem.idem_complete('p_a', 'tx-nofields', $1, 200, '{}', 'plain')`, r.Attempt)
	pgtest.Exec(t, conn, `COMMIT`)
	// Completed by a lease claim.
	r = upCallBegin(t, conn, "p_a", "lease-done", "POST /p", "lease-done", hour, tenMin, fields)
	pgtest.Exec(t, conn, `SELECT idem.idem_complete('p_a', 'lease-done', $1, 201, '{"Content-Type": "application/json"}', '{"paid":1}', 'pay1')`, r.Attempt)
	// A withheld body.
	pgtest.Exec(t, conn, `BEGIN`)
	r = upCallBegin(t, conn, "p_a", "withheld", "POST /tokens", "withheld", hour, nil, nil)
	pgtest.Exec(t, conn, `SELECT idem.idem_complete('p_a', 'withheld', $1, 201, '{}', NULL, 'tok9', 'one_time_secret')`, r.Attempt)
	pgtest.Exec(t, conn, `COMMIT`)
	// A final error stored on its own.
	pgtest.Exec(t, conn, `SELECT idem.idem_save_final('p_a', 'final', 'POST /t', sha256('final'), '1 hour', 422,
		'{"Content-Type": "application/problem+json"}', '{"code":"insufficient_funds"}', $1::jsonb)`, *fields)
	// A lease claim in progress with time left, one whose lease runs out in a second, one
	// yielded, one released.
	live := upCallBegin(t, conn, "p_a", "lease-live", "POST /p", "lease-live", hour, tenMin, nil)
	out := upCallBegin(t, conn, "p_a", "lease-out", "POST /p", "lease-out", hour, oneSec, fields)
	yielded := upCallBegin(t, conn, "p_a", "yielded", "POST /p", "yielded", hour, tenMin, nil)
	pgtest.Exec(t, conn, `SELECT idem.idem_yield('p_a', 'yielded', $1)`, yielded.Attempt)
	rel := upCallBegin(t, conn, "p_a", "released", "POST /p", "released", hour, tenMin, nil)
	pgtest.Exec(t, conn, `SELECT idem.idem_release('p_a', 'released', $1)`, rel.Attempt)
	// Keys that expire: a transactional answer with a 1 s TTL, a lease answer given well
	// before its lease's end with a 1 s TTL (D200: expired a second after the answer), and a
	// lease claim whose lease and TTL both run out.
	pgtest.Exec(t, conn, `BEGIN`)
	r = upCallBegin(t, conn, "p_a", "tx-expired", "POST /t", "tx-expired", oneSec, nil, nil)
	pgtest.Exec(t, conn, `SELECT idem.idem_complete('p_a', 'tx-expired', $1, 201, '{}', 'x')`, r.Attempt)
	pgtest.Exec(t, conn, `COMMIT`)
	r = upCallBegin(t, conn, "p_a", "lease-short-ttl", "POST /p", "lease-short-ttl", oneSec, tenMin, nil)
	pgtest.Exec(t, conn, `SELECT idem.idem_complete('p_a', 'lease-short-ttl', $1, 201, '{}', 'y')`, r.Attempt)
	dead := upCallBegin(t, conn, "p_a", "lease-dead", "POST /p", "lease-dead", oneSec, oneSec, nil)

	completed := []string{"tx-done", "tx-nofields", "lease-done", "withheld", "final"}
	actions := map[string]string{"tx-done": "POST /t", "tx-nofields": "POST /t", "lease-done": "POST /p", "withheld": "POST /tokens", "final": "POST /t"}
	before := map[string]upBegin{}
	for _, k := range completed {
		before[k] = upCallBegin(t, conn, "p_a", k, actions[k], k, nil, nil, fields)
		if before[k].Outcome != "replay" {
			t.Fatalf("0.2.0's replay of %s: %+v", k, before[k])
		}
	}
	liveBefore := upCallBegin(t, conn, "p_a", "lease-live", "POST /p", "lease-live", nil, tenMin, nil)
	if liveBefore.Outcome != "in_progress" || *liveBefore.ProviderKey != *live.ProviderKey {
		t.Fatalf("0.2.0's in_progress: %+v", liveBefore)
	}

	upMigrate(t, url)
	time.Sleep(2100 * time.Millisecond) // every 1 s lease and TTL above has run out

	// Every completed key replays as 0.2.0 replayed it: every column, the provider key too.
	for _, k := range completed {
		got := upCallBegin(t, conn, "p_a", k, actions[k], k, nil, nil, fields)
		if !reflect.DeepEqual(got, before[k]) {
			t.Errorf("%s after the migrate: %+v\nwant 0.2.0's replay %+v", k, got, before[k])
		}
	}
	other := upStr(`{"amount": "` + upHex("999") + `", "to": "` + upHex("2") + `"}`)
	if got := upCallBegin(t, conn, "p_a", "tx-done", "POST /t", "other", nil, nil, other); got.Outcome != "mismatch" ||
		strings.Join(got.Changed, ",") != "amount" {
		t.Errorf("a mismatch on 0.2.0's key: %+v, want changed_fields [amount]", got)
	}
	if got := upCallBegin(t, conn, "p_a", "final", "POST /t", "other", nil, nil, other); got.Outcome != "mismatch" ||
		strings.Join(got.Changed, ",") != "amount" {
		t.Errorf("a mismatch on 0.2.0's final error: %+v, want changed_fields [amount]", got)
	}

	// The operator's view (idem_operator) of 0.2.0's rows.
	op := pgtest.Connect(t, pgtest.LoginRole(t, url, "idem_operator"))
	type keyView struct {
		state     string
		expired   bool
		keptUntil *time.Time
		attempt   int64
	}
	view := func(key string) keyView {
		t.Helper()
		var v keyView
		if err := op.QueryRow(ctx, `SELECT state, expired, kept_until, attempt FROM idem.idem_key('p_a', $1)`, key).
			Scan(&v.state, &v.expired, &v.keptUntil, &v.attempt); err != nil {
			t.Fatalf("idem_key %s as idem_operator: %v", key, err)
		}
		return v
	}
	for _, k := range completed {
		if v := view(k); v.state != "completed" || v.expired || v.keptUntil == nil || time.Until(*v.keptUntil) < 50*time.Minute {
			t.Errorf("idem_key %s: %+v, want completed, not expired, kept about an hour", k, v)
		}
	}
	for _, k := range []string{"tx-expired", "lease-short-ttl"} {
		if v := view(k); v.state != "completed" || !v.expired {
			t.Errorf("idem_key %s: %+v, want completed and expired (its TTL after the answer has passed)", k, v)
		}
	}
	if v := view("lease-dead"); !v.expired {
		t.Errorf("idem_key lease-dead: %+v, want expired", v)
	}
	stuck := map[string]string{}
	rows, err := op.Query(ctx, `SELECT key, provider_key FROM idem.idem_stuck()`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var k, pk string
		if err := rows.Scan(&k, &pk); err != nil {
			t.Fatal(err)
		}
		stuck[k] = pk
	}
	if rows.Err() != nil {
		t.Fatal(rows.Err())
	}
	if stuck["lease-live"] != *live.ProviderKey || stuck["lease-out"] != *out.ProviderKey {
		t.Errorf("idem_stuck after the migrate: %v, want lease-live %s and lease-out %s (0.2.0's provider keys)",
			stuck, *live.ProviderKey, *out.ProviderKey)
	}
	if _, ok := stuck["lease-dead"]; ok {
		t.Errorf("idem_stuck lists lease-dead, whose lease and TTL have run out (absent)")
	}
	var inProgress, runOut int64
	if err := op.QueryRow(ctx, `SELECT in_progress, leases_run_out FROM idem.idem_summary()`).Scan(&inProgress, &runOut); err != nil {
		t.Fatal(err)
	}
	t.Logf("idem_summary: in_progress %d, leases_run_out %d", inProgress, runOut)

	// The application (idem_app): 0.2.0's lease claims, taken over in their generation.
	app := pgtest.Connect(t, pgtest.LoginRole(t, url, "idem_app"))
	if got := upCallBegin(t, app, "p_a", "lease-live", "POST /p", "lease-live", nil, tenMin, nil); got.Outcome != "in_progress" ||
		got.Attempt != live.Attempt || *got.ProviderKey != *live.ProviderKey {
		t.Errorf("0.2.0's live lease after the migrate: %+v, want in_progress, attempt %d, provider key %s", got, live.Attempt, *live.ProviderKey)
	}
	took := upCallBegin(t, app, "p_a", "lease-out", "POST /p", "lease-out", nil, tenMin, fields)
	if took.Outcome != "claimed" || took.Attempt <= out.Attempt || *took.ProviderKey != *out.ProviderKey {
		t.Errorf("takeover of 0.2.0's run-out lease: %+v, want claimed with 0.2.0's provider key %s", took, *out.ProviderKey)
	}
	if got := upCallBegin(t, app, "p_a", "yielded", "POST /p", "yielded", nil, tenMin, nil); got.Outcome != "claimed" ||
		*got.ProviderKey != *yielded.ProviderKey {
		t.Errorf("takeover of 0.2.0's yielded lease: %+v, want claimed with 0.2.0's provider key %s", got, *yielded.ProviderKey)
	}
	if got := upCallBegin(t, app, "p_a", "released", "POST /p", "released", nil, tenMin, nil); got.Outcome != "claimed" ||
		*got.ProviderKey == *rel.ProviderKey {
		t.Errorf("a claim of 0.2.0's released key: %+v, want claimed in a new generation (a provider key other than %s)", got, *rel.ProviderKey)
	}
	var released bool
	if err := app.QueryRow(ctx, `SELECT idem.idem_release('p_a', 'lease-out', $1)`, took.Attempt).Scan(&released); err != nil || !released {
		t.Errorf("idem_release of the takeover as idem_app: %v %v", released, err)
	}
	// The operator ends 0.2.0's live lease; the next claim takes it over in its generation.
	if _, err := op.Exec(ctx, `SELECT idem.idem_release_stuck('p_a', 'lease-live', $1, 'upgrade test')`, live.Attempt); err != nil {
		t.Fatalf("idem_release_stuck of 0.2.0's lease as idem_operator: %v", err)
	}
	if got := upCallBegin(t, app, "p_a", "lease-live", "POST /p", "lease-live", nil, tenMin, nil); got.Outcome != "claimed" ||
		*got.ProviderKey != *live.ProviderKey {
		t.Errorf("the claim after idem_release_stuck of 0.2.0's lease: %+v, want claimed with 0.2.0's provider key %s", got, *live.ProviderKey)
	}

	// Expired keys are absent: a new request claims them (a new generation).
	for _, k := range []string{"tx-expired", "lease-short-ttl", "lease-dead"} {
		pgtest.Exec(t, conn, `BEGIN`)
		got := upCallBegin(t, conn, "p_a", k, "POST /other", "other", nil, nil, nil)
		pgtest.Exec(t, conn, `ROLLBACK`)
		if got.Outcome != "claimed" {
			t.Errorf("%s (expired) after the migrate: %+v, want claimed", k, got)
		}
		if k == "lease-dead" && *got.ProviderKey == *dead.ProviderKey {
			t.Errorf("lease-dead's new generation has the old provider key")
		}
	}

	// idem_cleanup as idem_app deletes what expired (and may be deleted), nothing else.
	var deleted int
	if err := app.QueryRow(ctx, `SELECT idem.idem_cleanup(1000)`).Scan(&deleted); err != nil {
		t.Fatal(err)
	}
	var left []string
	rows, err = conn.Query(ctx, `SELECT key FROM idem.idempotency_keys ORDER BY key`)
	if err != nil {
		t.Fatal(err)
	}
	left, err = pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"final", "lease-done", "lease-live", "lease-out", "lease-short-ttl", "released", "tx-done", "tx-nofields", "withheld", "yielded"}
	if fmt.Sprint(left) != fmt.Sprint(want) {
		t.Errorf("idem_cleanup deleted %d; left %v, want %v (tx-expired and lease-dead deleted; lease-short-ttl kept until its claim's TTL, D200)", deleted, left, want)
	}
}

// TestUpgrade010RowsOfEveryState: rows of every state that 0.1.0's functions stored, then
// this tree's migrate: replays, mismatches, expiry (D200: a row 0.1.0 completed keeps its old
// expiry), the operator's functions, a takeover of a run-out lease (the provider key that
// idem_begin and idem_stuck reported for the claim in progress), and idem_cleanup.
func TestUpgrade010RowsOfEveryState(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url, conn := at010(t)
	pgtest.Exec(t, conn, `INSERT INTO principals VALUES ('p_a', 'a')`)
	fields := `{"amount": "` + upHex("100") + `", "to": "` + upHex("2") + `"}`
	for _, sql := range []string{
		`BEGIN; SELECT idem.idem_begin('p_a', 'tx-done', 'POST /t', sha256('tx-done'), '1 hour', p_request_fields => '` + fields + `');
		 SELECT idem.idem_complete('p_a', 'tx-done', 1, 201, '{"Content-Type": "application/json"}', '{"id":1}', 'r1'); COMMIT`,
		`BEGIN; SELECT idem.idem_begin('p_a', 'tx-nofields', 'POST /t', sha256('tx-nofields'), '1 hour');
		 SELECT idem.idem_complete('p_a', 'tx-nofields', 1, 200, '{}', 'plain'); COMMIT`,
		`SELECT idem.idem_begin('p_a', 'lease-done', 'POST /p', sha256('lease-done'), '1 hour', '10 minutes', '` + fields + `');
		 SELECT idem.idem_complete('p_a', 'lease-done', 1, 201, '{}', '{"paid":1}')`,
		`BEGIN; SELECT idem.idem_begin('p_a', 'withheld', 'POST /tokens', sha256('withheld'), '1 hour');
		 SELECT idem.idem_complete('p_a', 'withheld', 1, 201, '{}', NULL, 'tok', 'one_time_secret'); COMMIT`,
		`SELECT idem.idem_save_final('p_a', 'final', 'POST /t', sha256('final'), '1 hour', 422, '{}', '{"code":"x"}', '` + fields + `')`,
		`SELECT idem.idem_begin('p_a', 'lease-live', 'POST /p', sha256('lease-live'), '1 hour', '10 minutes')`,
		`SELECT idem.idem_begin('p_a', 'lease-out', 'POST /p', sha256('lease-out'), '1 hour', '1 second')`,
		`SELECT idem.idem_begin('p_a', 'released', 'POST /p', sha256('released'), '1 hour', '10 minutes');
		 SELECT idem.idem_release('p_a', 'released', 1)`,
		`BEGIN; SELECT idem.idem_begin('p_a', 'tx-expired', 'POST /t', sha256('tx-expired'), '1 second');
		 SELECT idem.idem_complete('p_a', 'tx-expired', 1, 201, '{}', 'x'); COMMIT`,
		`SELECT idem.idem_begin('p_a', 'lease-dead', 'POST /p', sha256('lease-dead'), '1 second', '1 second')`,
	} {
		pgtest.Exec(t, conn, sql)
	}
	upMigrate(t, url)
	time.Sleep(2100 * time.Millisecond)

	for _, k := range []struct{ key, action string }{{"tx-done", "POST /t"}, {"tx-nofields", "POST /t"}, {"lease-done", "POST /p"},
		{"withheld", "POST /tokens"}, {"final", "POST /t"}} {
		if got := upCallBegin(t, conn, "p_a", k.key, k.action, k.key, nil, nil, upStr(fields)); got.Outcome != "replay" {
			t.Errorf("0.1.0's %s after the migrate: %+v, want a replay", k.key, got)
		}
	}
	other := upStr(`{"amount": "` + upHex("999") + `", "to": "` + upHex("2") + `"}`)
	for _, k := range []string{"tx-done", "final"} {
		if got := upCallBegin(t, conn, "p_a", k, "POST /t", "other", nil, nil, other); got.Outcome != "mismatch" || strings.Join(got.Changed, ",") != "amount" {
			t.Errorf("a mismatch on 0.1.0's %s: %+v, want changed_fields [amount]", k, got)
		}
	}

	op := pgtest.Connect(t, pgtest.LoginRole(t, url, "idem_operator"))
	app := pgtest.Connect(t, pgtest.LoginRole(t, url, "idem_app"))
	live := upCallBegin(t, app, "p_a", "lease-live", "POST /p", "lease-live", nil, upStr("10 minutes"), nil)
	if live.Outcome != "in_progress" || live.ProviderKey == nil {
		t.Fatalf("0.1.0's live lease after the migrate: %+v", live)
	}
	stuck := map[string]string{}
	rows, err := op.Query(ctx, `SELECT key, provider_key FROM idem.idem_stuck()`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var k, pk string
		if err := rows.Scan(&k, &pk); err != nil {
			t.Fatal(err)
		}
		stuck[k] = pk
	}
	if stuck["lease-live"] != *live.ProviderKey || stuck["lease-out"] == "" {
		t.Errorf("idem_stuck after the upgrade from 0.1.0: %v, want lease-live's %s and lease-out", stuck, *live.ProviderKey)
	}
	if _, ok := stuck["lease-dead"]; ok {
		t.Errorf("idem_stuck lists lease-dead, whose lease and TTL have run out")
	}
	took := upCallBegin(t, app, "p_a", "lease-out", "POST /p", "lease-out", nil, upStr("10 minutes"), nil)
	if took.Outcome != "claimed" || *took.ProviderKey != stuck["lease-out"] {
		t.Errorf("takeover of 0.1.0's run-out lease: %+v, want claimed with the provider key idem_stuck showed, %s", took, stuck["lease-out"])
	}
	var liveAttempt int64
	var keptUntil *time.Time
	var expired bool
	if err := op.QueryRow(ctx, `SELECT attempt FROM idem.idem_key('p_a', 'lease-live')`).Scan(&liveAttempt); err != nil {
		t.Fatal(err)
	}
	if _, err := op.Exec(ctx, `SELECT idem.idem_release_stuck('p_a', 'lease-live', $1)`, liveAttempt); err != nil {
		t.Fatalf("idem_release_stuck of 0.1.0's lease: %v", err)
	}
	if got := upCallBegin(t, app, "p_a", "lease-live", "POST /p", "lease-live", nil, upStr("10 minutes"), nil); got.Outcome != "claimed" ||
		*got.ProviderKey != *live.ProviderKey {
		t.Errorf("the claim after idem_release_stuck of 0.1.0's lease: %+v, want its provider key %s", got, *live.ProviderKey)
	}
	for _, k := range []string{"tx-done", "lease-done", "final", "withheld"} {
		if err := op.QueryRow(ctx, `SELECT expired, kept_until FROM idem.idem_key('p_a', $1)`, k).Scan(&expired, &keptUntil); err != nil {
			t.Fatal(err)
		}
		if expired || keptUntil == nil || time.Until(*keptUntil) < 50*time.Minute {
			t.Errorf("idem_key %s (0.1.0's): expired %v, kept until %v; want kept about an hour", k, expired, keptUntil)
		}
	}
	for _, k := range []string{"tx-expired", "lease-dead"} {
		if err := op.QueryRow(ctx, `SELECT expired FROM idem.idem_key('p_a', $1)`, k).Scan(&expired); err != nil || !expired {
			t.Errorf("idem_key %s (0.1.0's, expired): expired %v %v", k, expired, err)
		}
		pgtest.Exec(t, conn, `BEGIN`)
		got := upCallBegin(t, conn, "p_a", k, "POST /x", "x", nil, nil, nil)
		pgtest.Exec(t, conn, `ROLLBACK`)
		if got.Outcome != "claimed" {
			t.Errorf("0.1.0's expired %s after the migrate: %+v, want claimed", k, got)
		}
	}
	var deleted int
	if err := app.QueryRow(ctx, `SELECT idem.idem_cleanup(1000)`).Scan(&deleted); err != nil {
		t.Fatal(err)
	}
	rows, err = conn.Query(ctx, `SELECT key FROM idem.idempotency_keys ORDER BY key`)
	if err != nil {
		t.Fatal(err)
	}
	left, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"final", "lease-done", "lease-live", "lease-out", "released", "tx-done", "tx-nofields", "withheld"}
	if fmt.Sprint(left) != fmt.Sprint(want) {
		t.Errorf("idem_cleanup deleted %d; left %v, want %v", deleted, left, want)
	}
}

// TestUpgrade020BySQLBundle: `psql -f sql/idem.sql` over a database that 0.2.0 installed
// (docs/operations.md: server migrate, idemsql.Migrate and sql/idem.sql run the same steps):
// the catalog a fresh install has, and 0.2.0's keys replay with their provider keys.
func TestUpgrade020BySQLBundle(t *testing.T) {
	t.Parallel()
	url, conn := up020DB(t)
	hour, tenMin := upStr("1 hour"), upStr("10 minutes")
	pgtest.Exec(t, conn, `BEGIN`)
	r := upCallBegin(t, conn, "p_a", "tx-done", "POST /t", "tx-done", hour, nil, nil)
	pgtest.Exec(t, conn, `SELECT idem.idem_complete('p_a', 'tx-done', $1, 201, '{"Content-Type": "application/json"}', '{"id":1}')`, r.Attempt)
	pgtest.Exec(t, conn, `COMMIT`)
	live := upCallBegin(t, conn, "p_a", "lease-live", "POST /p", "lease-live", hour, tenMin, nil)
	before := upCallBegin(t, conn, "p_a", "tx-done", "POST /t", "tx-done", nil, nil, nil)

	if out, err := installBundle(t, url); err != nil {
		t.Fatalf("psql -f sql/idem.sql over 0.2.0: %v\n%s", err, out)
	}
	fresh := pgtest.Connect(t, pgtest.NewEmptyDB(t))
	if err := idemsql.Migrate(context.Background(), fresh, idemsql.Options{}); err != nil {
		t.Fatal(err)
	}
	sameCatalog(t, "0.2.0 upgraded by sql/idem.sql", upCatalog(installed(t, conn)), upCatalog(installed(t, fresh)))
	if got := upCallBegin(t, conn, "p_a", "tx-done", "POST /t", "tx-done", nil, nil, nil); !reflect.DeepEqual(got, before) {
		t.Errorf("0.2.0's key after sql/idem.sql: %+v, want %+v", got, before)
	}
	if got := upCallBegin(t, conn, "p_a", "lease-live", "POST /p", "lease-live", nil, tenMin, nil); got.Outcome != "in_progress" ||
		*got.ProviderKey != *live.ProviderKey {
		t.Errorf("0.2.0's lease after sql/idem.sql: %+v, want in_progress with %s", got, *live.ProviderKey)
	}
}

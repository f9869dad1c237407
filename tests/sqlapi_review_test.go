package tests

// The SQL API as a DBA or a service in another language sees it, from a review of it: plain SQL
// over pgx, as the roles the docs name, partly over the simple protocol.

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/internal/pgtest"
)

type beginAnswer struct {
	Outcome     string
	Attempt     int64
	Status      *int32
	Headers     *string
	Body        []byte
	ResourceID  *string
	Withheld    *string
	Changed     []string
	RetryAfter  *time.Duration
	ProviderKey *string
}

type rowQuerier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

const beginAnswerCols = `outcome, attempt, response_status, response_headers::text, response_body, resource_id, withheld,
	changed_fields, retry_after, provider_key`

// beginAs calls idem_begin with named arguments; extra is appended to the argument list.
func beginAs(ctx context.Context, q rowQuerier, principal, key, action string, fp []byte, extra string, args ...any) (beginAnswer, error) {
	var a beginAnswer
	all := append([]any{principal, key, action, fp}, args...)
	err := q.QueryRow(ctx, `SELECT `+beginAnswerCols+` FROM idem.idem_begin(p_principal => $1, p_key => $2, p_action => $3,
		p_request_sha256 => $4`+extra+`)`, all...).Scan(&a.Outcome, &a.Attempt, &a.Status, &a.Headers, &a.Body,
		&a.ResourceID, &a.Withheld, &a.Changed, &a.RetryAfter, &a.ProviderKey)
	return a, err
}

func sum256(s string) []byte { h := sha256.Sum256([]byte(s)); return h[:] }
func hex256(s string) string { return hex.EncodeToString(sum256(s)) }

func simpleProtocol(url string) string { return url + " default_query_exec_mode=simple_protocol" }

// appSession: a fresh database, a connection as a login role in idem_app (simple protocol when
// simple), and the superuser's connection.
func appSession(t *testing.T, simple bool) (app *pgx.Conn, admin *pgx.Conn, url, appURL string) {
	t.Helper()
	url = pgtest.NewDB(t)
	admin = pgtest.Connect(t, url)
	appURL = pgtest.LoginRole(t, url, "idem_app")
	if simple {
		appURL = simpleProtocol(appURL)
	}
	return pgtest.Connect(t, appURL), admin, url, appURL
}

// TestReplayIsByteForByte: a body of every byte value, headers with odd but valid JSON
// (unicode escapes, astral characters, the U+0001 / U+0002 conventions, a 1 MB value), over
// the simple protocol and the extended one: the replay gives back exactly what was stored.
func TestReplayIsByteForByte(t *testing.T) {
	t.Parallel()
	for _, simple := range []bool{true, false} {
		t.Run(fmt.Sprintf("simple=%v", simple), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			app, _, _, _ := appSession(t, simple)
			body := make([]byte, 0, 512)
			for i := 0; i < 256; i++ {
				body = append(body, byte(i))
			}
			body = append(body, []byte("\\x00'\"--;\r\n")...)
			big := strings.Repeat("v", 1<<20)
			headers := `{"X-Esc":"caf\u00e9 \ud83d\ude00","Set-Cookie":"\u0002a=1\nb=2","ETag":"\u0001\u0122\u0176\u01e9\u0122","X-Big":"` + big + `","":"empty name"}`
			tx, err := app.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			a, err := beginAs(ctx, tx, "p", "k", "POST /x", sum256("r"), "")
			if err != nil || a.Outcome != "claimed" {
				t.Fatalf("claim: %+v %v", a, err)
			}
			if _, err := tx.Exec(ctx, `SELECT idem.idem_complete($1, $2, $3, $4, $5::jsonb, $6, $7)`, "p", "k", a.Attempt, 201, headers, body, "res-1"); err != nil {
				t.Fatal(err)
			}
			if err := tx.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			r, err := beginAs(ctx, app, "p", "k", "POST /x", sum256("r"), "")
			if err != nil || r.Outcome != "replay" {
				t.Fatalf("replay: %+v %v", r.Outcome, err)
			}
			if !bytes.Equal(r.Body, body) {
				t.Errorf("body differs: got %d bytes, want %d", len(r.Body), len(body))
			}
			if *r.Status != 201 || r.ResourceID == nil || *r.ResourceID != "res-1" || r.Withheld != nil || r.ProviderKey == nil {
				t.Errorf("replay: status %v resource %v withheld %v pk %v", *r.Status, r.ResourceID, r.Withheld, r.ProviderKey)
			}
			var same bool
			if err := app.QueryRow(ctx, `SELECT $1::jsonb = $2::jsonb`, *r.Headers, headers).Scan(&same); err != nil || !same {
				t.Errorf("headers differ as JSON: %v %v", same, err)
			}
			var esc string
			if err := app.QueryRow(ctx, `SELECT $1::jsonb ->> 'X-Esc'`, *r.Headers).Scan(&esc); err != nil || esc != "café 😀" {
				t.Errorf("X-Esc: %q %v", esc, err)
			}
		})
	}
}

// TestRepeatedHeaderNameKeepsTheLast: p_headers is jsonb, and a JSON object that names a header
// twice (valid JSON) reaches the function with the last value only, before it runs: a client
// in another language that sent two Set-Cookie lines as two members lost one without an error.
// docs/sql-api.md ("Stored headers") now says so and names the form that keeps both: one
// string, U+0002 and the lines joined by a line feed, which replays as stored.
func TestRepeatedHeaderNameKeepsTheLast(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	app, _, _, _ := appSession(t, true)
	for key, stored := range map[string]struct{ headers, want string }{
		"repeated": {`{"Set-Cookie":"a=1","Set-Cookie":"b=2"}`, `{"Set-Cookie": "b=2"}`},
		"lines":    {`{"Set-Cookie":"\u0002a=1\nb=2"}`, `{"Set-Cookie": "\u0002a=1\nb=2"}`},
	} {
		tx, err := app.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		a, err := beginAs(ctx, tx, "p", key, "POST /x", sum256("r"), "")
		if err != nil || a.Outcome != "claimed" {
			t.Fatalf("%s: claim: %+v %v", key, a, err)
		}
		if _, err := tx.Exec(ctx, `SELECT idem.idem_complete('p', $1, $2, 200, $3, 'b')`, key, a.Attempt, stored.headers); err != nil {
			t.Fatalf("%s: complete: %v", key, err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		r, err := beginAs(ctx, app, "p", key, "POST /x", sum256("r"), "")
		if err != nil || r.Headers == nil || *r.Headers != stored.want {
			t.Errorf("%s: stored %s, replayed %v (%v); want %s", key, stored.headers, r.Headers, err, stored.want)
		}
	}
}

// fieldHashes builds p_request_fields from name -> value.
func fieldHashes(m map[string]string) string {
	var b strings.Builder
	b.WriteString("{")
	i := 0
	for k, v := range m {
		if i > 0 {
			b.WriteString(",")
		}
		fmt.Fprintf(&b, "%q:%q", k, hex256(v))
		i++
	}
	b.WriteString("}")
	return b.String()
}

// TestMismatchNamesChangedFields: fields added, removed, renamed, non-ASCII names, 1000
// fields; names only, sorted.
func TestMismatchNamesChangedFields(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	app, _, _, _ := appSession(t, true)
	first := map[string]string{"amount": "100", "to": "acc", "Größe": "1", "名前": "x", "memo": "m"}
	tx, _ := app.Begin(ctx)
	a, err := beginAs(ctx, tx, "p", "m", "POST /x", sum256("first"), ", p_request_fields => $5::jsonb", fieldHashes(first))
	if err != nil || a.Outcome != "claimed" {
		t.Fatalf("%+v %v", a, err)
	}
	if _, err := tx.Exec(ctx, `SELECT idem.idem_complete('p', 'm', $1, 201, '{}', 'ok')`, a.Attempt); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	// amount changed, memo removed, 名前 renamed to 名, extra added, Größe unchanged.
	second := map[string]string{"amount": "500", "to": "acc", "Größe": "1", "名": "x", "extra": "e"}
	r, err := beginAs(ctx, app, "p", "m", "POST /x", sum256("second"), ", p_request_fields => $5::jsonb", fieldHashes(second))
	if err != nil || r.Outcome != "mismatch" {
		t.Fatalf("%+v %v", r, err)
	}
	want := map[string]bool{"amount": true, "memo": true, "名前": true, "名": true, "extra": true}
	if len(r.Changed) != len(want) {
		t.Errorf("changed_fields %q, want the names %v", r.Changed, want)
	}
	for _, n := range r.Changed {
		if !want[n] {
			t.Errorf("changed_fields names %q, which did not change (%q)", n, r.Changed)
		}
	}
	// Another action: {}.
	r, err = beginAs(ctx, app, "p", "m", "PUT /x", sum256("second"), ", p_request_fields => $5::jsonb", fieldHashes(second))
	if err != nil || r.Outcome != "mismatch" || r.Changed == nil || len(r.Changed) != 0 {
		t.Errorf("other action: %+v %v, want mismatch with {}", r, err)
	}
	// Without field hashes: NULL.
	r, err = beginAs(ctx, app, "p", "m", "POST /x", sum256("second"), "")
	if err != nil || r.Outcome != "mismatch" || r.Changed != nil {
		t.Errorf("no fields: %+v %v, want mismatch with NULL", r, err)
	}

	// 1000 fields, one changed; time it.
	many := map[string]string{}
	for i := 0; i < 1000; i++ {
		many[fmt.Sprintf("field_%04d", i)] = fmt.Sprint(i)
	}
	tx, _ = app.Begin(ctx)
	a, err = beginAs(ctx, tx, "p", "many", "POST /x", sum256("m1"), ", p_request_fields => $5::jsonb", fieldHashes(many))
	if err != nil || a.Outcome != "claimed" {
		t.Fatalf("%+v %v", a, err)
	}
	if _, err := tx.Exec(ctx, `SELECT idem.idem_complete('p', 'many', $1, 201, '{}', 'ok')`, a.Attempt); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	many["field_0500"] = "changed"
	start := time.Now()
	r, err = beginAs(ctx, app, "p", "many", "POST /x", sum256("m2"), ", p_request_fields => $5::jsonb", fieldHashes(many))
	took := time.Since(start)
	if err != nil || r.Outcome != "mismatch" || len(r.Changed) != 1 || r.Changed[0] != "field_0500" {
		t.Errorf("1000 fields: %v %v %v", r.Outcome, r.Changed, err)
	}
	t.Logf("mismatch of 1000 fields took %v", took)
}

// TestLeaseRules: in_progress with retry_after, extend beyond the TTL, fencing by token.
func TestLeaseRules(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	app, _, _, _ := appSession(t, true)
	// A lease of 300 ms with a TTL of 100 ms; extended to an hour.
	a, err := beginAs(ctx, app, "p", "l", "POST /x", sum256("r"), ", p_ttl => '100 ms', p_lease => '300 ms'")
	if err != nil || a.Outcome != "claimed" {
		t.Fatalf("%+v %v", a, err)
	}
	var end time.Time
	if err := app.QueryRow(ctx, `SELECT idem.idem_extend('p', 'l', $1, '1 hour')`, a.Attempt).Scan(&end); err != nil {
		t.Fatal(err)
	}
	time.Sleep(500 * time.Millisecond)
	var n int
	if err := app.QueryRow(ctx, `SELECT idem.idem_cleanup(1000)`).Scan(&n); err != nil || n != 0 {
		t.Fatalf("cleanup deleted %d keys under a running lease: %v", n, err)
	}
	d, err := beginAs(ctx, app, "p", "l", "POST /x", sum256("r"), ", p_ttl => '100 ms', p_lease => '300 ms'")
	if err != nil || d.Outcome != "in_progress" || d.RetryAfter == nil || *d.RetryAfter < 59*time.Minute || d.Attempt != a.Attempt || *d.ProviderKey != *a.ProviderKey {
		t.Fatalf("duplicate after extension: %+v %v", d, err)
	}
	o, err := beginAs(ctx, app, "p", "l", "POST /x", sum256("other"), "")
	if err != nil || o.Outcome != "mismatch" {
		t.Fatalf("other request: %+v %v", o, err)
	}
	// Wrong tokens.
	var ok bool
	if err := app.QueryRow(ctx, `SELECT idem.idem_release('p', 'l', $1)`, a.Attempt+1000).Scan(&ok); err != nil || ok {
		t.Errorf("release with a wrong token: %v %v", ok, err)
	}
	if err := app.QueryRow(ctx, `SELECT idem.idem_yield('p', 'l', $1)`, a.Attempt-1).Scan(&ok); err != nil || ok {
		t.Errorf("yield with a wrong token: %v %v", ok, err)
	}
	_, err = app.Exec(ctx, `SELECT idem.idem_extend('p', 'l', $1, '1 hour')`, a.Attempt+1)
	if sqlCode(err) != "55000" {
		t.Errorf("extend with a wrong token: %v", err)
	}
	// Yield, then the same request takes it over in the same generation; the yielder is fenced.
	if err := app.QueryRow(ctx, `SELECT idem.idem_yield('p', 'l', $1)`, a.Attempt).Scan(&ok); err != nil || !ok {
		t.Fatalf("yield: %v %v", ok, err)
	}
	b, err := beginAs(ctx, app, "p", "l", "POST /x", sum256("r"), ", p_lease => '1 minute'")
	if err != nil || b.Outcome != "claimed" || *b.ProviderKey != *a.ProviderKey || b.Attempt == a.Attempt {
		t.Fatalf("takeover after yield: %+v %v", b, err)
	}
	for _, q := range []string{`SELECT idem.idem_extend('p', 'l', $1, '1 hour')`, `SELECT idem.idem_complete('p', 'l', $1, 200, '{}', 'x')`} {
		if _, err := app.Exec(ctx, q, a.Attempt); sqlCode(err) != "55000" {
			t.Errorf("%s by the yielded holder: %v", q, err)
		}
	}
	if err := app.QueryRow(ctx, `SELECT idem.idem_release('p', 'l', $1)`, a.Attempt).Scan(&ok); err != nil || ok {
		t.Errorf("release by the yielded holder: %v %v", ok, err)
	}
	// Release by the holder: a new generation for the same request.
	if err := app.QueryRow(ctx, `SELECT idem.idem_release('p', 'l', $1)`, b.Attempt).Scan(&ok); err != nil || !ok {
		t.Fatalf("release: %v %v", ok, err)
	}
	c, err := beginAs(ctx, app, "p", "l", "POST /x", sum256("r"), ", p_lease => '1 minute'")
	if err != nil || c.Outcome != "claimed" || *c.ProviderKey == *a.ProviderKey {
		t.Fatalf("claim after release: %+v %v", c, err)
	}
	// A transactional claim cannot be released.
	tx, _ := app.Begin(ctx)
	defer tx.Rollback(ctx)
	tc, err := beginAs(ctx, tx, "p", "tx", "POST /x", sum256("r"), "")
	if err != nil || tc.Outcome != "claimed" {
		t.Fatal(err)
	}
	in, err := beginAs(ctx, tx, "p", "tx", "POST /x", sum256("r"), "")
	if err != nil || in.Outcome != "in_progress" || in.Attempt != tc.Attempt || in.RetryAfter != nil || *in.ProviderKey != *tc.ProviderKey {
		t.Errorf("second begin in the claim's own transaction: %+v %v", in, err)
	}
	_, err = tx.Exec(ctx, `SELECT idem.idem_release('p', 'tx', $1)`, tc.Attempt)
	if sqlCode(err) != "55000" {
		t.Errorf("release of a transactional claim: %v", err)
	}
}

// TestSaveFinalCases: on its own claim after ROLLBACK TO SAVEPOINT; on a key nobody holds;
// on a completed key; on a savepoint taken before the claim.
func TestSaveFinalCases(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	app, admin, _, _ := appSession(t, true)
	sf := `SELECT idem.idem_save_final($1, $2, 'POST /x', $3, NULL, 422, '{"Content-Type":"application/problem+json"}', $4)`

	// Own claim, after a rollback to a savepoint taken after it.
	tx, _ := app.Begin(ctx)
	a, err := beginAs(ctx, tx, "p", "own", "POST /x", sum256("r"), "")
	if err != nil || a.Outcome != "claimed" {
		t.Fatal(err)
	}
	pgtest.Exec(t, tx, `SAVEPOINT work`)
	pgtest.Exec(t, tx, `SELECT 1`)
	pgtest.Exec(t, tx, `ROLLBACK TO SAVEPOINT work`)
	var ok bool
	if err := tx.QueryRow(ctx, sf, "p", "own", sum256("r"), []byte("e1")).Scan(&ok); err != nil || !ok {
		t.Fatalf("save_final on own claim: %v %v", ok, err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatalf("commit: %v", err)
	}
	r, err := beginAs(ctx, app, "p", "own", "POST /x", sum256("r"), "")
	if err != nil || r.Outcome != "replay" || string(r.Body) != "e1" || *r.Status != 422 || *r.ProviderKey != *a.ProviderKey || r.Attempt != a.Attempt {
		t.Errorf("replay of own save_final: %+v %v (claim %+v)", r, err, a)
	}

	// Nobody holds it.
	if err := app.QueryRow(ctx, sf, "p", "free", sum256("r"), []byte("e2")).Scan(&ok); err != nil || !ok {
		t.Fatalf("save_final on a free key: %v %v", ok, err)
	}
	r, err = beginAs(ctx, app, "p", "free", "POST /x", sum256("r"), "")
	if err != nil || r.Outcome != "replay" || string(r.Body) != "e2" || r.ProviderKey == nil {
		t.Errorf("replay of save_final on a free key: %+v %v", r, err)
	}

	// A completed key: false, the first answer stays.
	if err := app.QueryRow(ctx, sf, "p", "free", sum256("r"), []byte("e3")).Scan(&ok); err != nil || ok {
		t.Errorf("save_final on a completed key: %v %v", ok, err)
	}
	r, _ = beginAs(ctx, app, "p", "free", "POST /x", sum256("r"), "")
	if string(r.Body) != "e2" {
		t.Errorf("completed key overwritten: %q", r.Body)
	}

	// Savepoint before the claim: the rollback removes the claim; save_final inserts; commit ok.
	tx, _ = app.Begin(ctx)
	pgtest.Exec(t, tx, `SAVEPOINT before`)
	if a, err = beginAs(ctx, tx, "p", "before", "POST /x", sum256("r"), ""); err != nil || a.Outcome != "claimed" {
		t.Fatal(err)
	}
	pgtest.Exec(t, tx, `ROLLBACK TO SAVEPOINT before`)
	if err := tx.QueryRow(ctx, sf, "p", "before", sum256("r"), []byte("e4")).Scan(&ok); err != nil || !ok {
		t.Fatalf("save_final after rolling the claim back: %v %v", ok, err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatalf("commit: %v", err)
	}
	// A lease held by another: false, and the row is not locked.
	l, err := beginAs(ctx, app, "p", "leased", "POST /x", sum256("r"), ", p_lease => '1 minute'")
	if err != nil || l.Outcome != "claimed" {
		t.Fatal(err)
	}
	tx, _ = app.Begin(ctx)
	if err := tx.QueryRow(ctx, sf, "p", "leased", sum256("r"), []byte("e5")).Scan(&ok); err != nil || ok {
		t.Errorf("save_final on another's lease: %v %v", ok, err)
	}
	var locked int
	if err := admin.QueryRow(ctx, `SELECT count(*) FROM (SELECT 1 FROM idem.idempotency_keys WHERE key = 'leased' FOR UPDATE NOWAIT) s`).Scan(&locked); err != nil {
		t.Errorf("the lease's row is locked by a refused save_final: %v", err)
	}
	tx.Rollback(ctx)
}

// TestRepeatableReadClaims: REPEATABLE READ and SERIALIZABLE. A claim whose snapshot
// predates another session's commit of the same key raises 40001 (and nothing else); after a
// retry the outcome is the right one.
func TestRepeatableReadClaims(t *testing.T) {
	t.Parallel()
	for _, iso := range []pgx.TxIsoLevel{pgx.RepeatableRead, pgx.Serializable} {
		t.Run(string(iso), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			app, _, _, appURL := appSession(t, true)
			other := pgtest.Connect(t, appURL)

			// 1. Fresh key committed by another session after the snapshot.
			tx, _ := app.BeginTx(ctx, pgx.TxOptions{IsoLevel: iso})
			pgtest.Exec(t, tx, `SELECT 1`) // the snapshot
			o, err := beginAs(ctx, other, "p", "k1", "POST /x", sum256("r"), ", p_lease => '1 minute'")
			if err != nil || o.Outcome != "claimed" {
				t.Fatal(err)
			}
			a, err := beginAs(ctx, tx, "p", "k1", "POST /x", sum256("r"), "")
			if sqlCode(err) != "40001" {
				t.Errorf("claim whose snapshot predates a committed claim: %+v %v, want 40001", a, err)
			}
			tx.Rollback(ctx)
			tx, _ = app.BeginTx(ctx, pgx.TxOptions{IsoLevel: iso})
			a, err = beginAs(ctx, tx, "p", "k1", "POST /x", sum256("r"), "")
			if err != nil || a.Outcome != "in_progress" || a.Attempt != o.Attempt {
				t.Errorf("retry: %+v %v", a, err)
			}
			tx.Rollback(ctx)

			// 2. A lease that ran out, taken over by another session after the snapshot.
			l, err := beginAs(ctx, other, "p", "k2", "POST /x", sum256("r"), ", p_lease => '50 ms'")
			if err != nil || l.Outcome != "claimed" {
				t.Fatal(err)
			}
			time.Sleep(80 * time.Millisecond)
			tx, _ = app.BeginTx(ctx, pgx.TxOptions{IsoLevel: iso})
			pgtest.Exec(t, tx, `SELECT 1`)
			o2, err := beginAs(ctx, other, "p", "k2", "POST /x", sum256("r"), ", p_lease => '1 minute'")
			if err != nil || o2.Outcome != "claimed" {
				t.Fatal(err)
			}
			a, err = beginAs(ctx, tx, "p", "k2", "POST /x", sum256("r"), ", p_lease => '1 minute'")
			if sqlCode(err) != "40001" {
				t.Errorf("takeover against a newer takeover: %+v %v, want 40001", a, err)
			}
			tx.Rollback(ctx)

			// 3. Completion of a lease after the snapshot; then idem_complete by the stale
			// view is fenced, and the reading answer is in_progress (documented).
			tx, _ = app.BeginTx(ctx, pgx.TxOptions{IsoLevel: iso})
			pgtest.Exec(t, tx, `SELECT 1`)
			pgtest.Exec(t, other, `SELECT idem.idem_complete('p', 'k2', $1, 200, '{}', 'done')`, o2.Attempt)
			a, err = beginAs(ctx, tx, "p", "k2", "POST /x", sum256("r"), ", p_lease => '1 minute'")
			if err != nil || a.Outcome != "in_progress" {
				t.Errorf("read answer from the snapshot: %+v %v", a, err)
			}
			_, err = tx.Exec(ctx, `SELECT idem.idem_complete('p', 'k2', $1, 200, '{}', 'again')`, o2.Attempt)
			if c := sqlCode(err); c != "40001" && c != "55000" {
				t.Errorf("complete of an answered claim from an old snapshot: %v", err)
			}
			tx.Rollback(ctx)
			r, err := beginAs(ctx, app, "p", "k2", "POST /x", sum256("r"), "")
			if err != nil || r.Outcome != "replay" || string(r.Body) != "done" {
				t.Errorf("after: %+v %v", r, err)
			}

			// 4. Cleanup and a claim of an expired key after the snapshot.
			tx2, _ := other.Begin(ctx)
			e, err := beginAs(ctx, tx2, "p", "k3", "POST /x", sum256("r"), ", p_ttl => '1 ms'")
			if err != nil || e.Outcome != "claimed" {
				t.Fatal(err)
			}
			pgtest.Exec(t, tx2, `SELECT idem.idem_complete('p', 'k3', $1, 200, '{}', 'old')`, e.Attempt)
			if err := tx2.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			time.Sleep(5 * time.Millisecond)
			tx, _ = app.BeginTx(ctx, pgx.TxOptions{IsoLevel: iso})
			pgtest.Exec(t, tx, `SELECT 1`)
			pgtest.Exec(t, other, `SELECT idem.idem_cleanup(1000)`)
			a, err = beginAs(ctx, tx, "p", "k3", "POST /x", sum256("r"), "")
			if err == nil && a.Outcome == "claimed" {
				pgtest.Exec(t, tx, `SELECT idem.idem_complete('p', 'k3', $1, 200, '{}', 'new')`, a.Attempt)
				err = tx.Commit(ctx)
			}
			if err != nil && sqlCode(err) != "40001" {
				t.Errorf("claim of a key cleaned up after the snapshot: %+v %v", a, err)
			}
			tx.Rollback(ctx)
		})
	}
}

// TestTransactionMisuse: COMMIT without completion over the simple protocol (23503),
// PREPARE TRANSACTION with a claim, a claim in a procedure that commits, and completion in
// another transaction.
func TestTransactionMisuse(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	app, admin, _, appURL := appSession(t, true)

	// Simple protocol, one multi-statement string, as a psql script would send it.
	_, err := app.Exec(ctx, `BEGIN; SELECT idem.idem_begin('p', 'c1', 'POST /x', sha256('r')); COMMIT;`)
	if sqlCode(err) != "23503" {
		t.Errorf("COMMIT without completion in one simple-protocol string: %v", err)
	}
	if n := pgtest.Count(t, admin, `SELECT count(*) FROM idem.idempotency_keys WHERE key = 'c1'`); n != 0 {
		t.Errorf("a claim committed without its completion: %d rows", n)
	}
	// Implicit transaction of one simple-protocol string (no BEGIN): the statements run as one
	// transaction; it must be refused too.
	_, err = app.Exec(ctx, `SELECT idem.idem_begin('p', 'c2', 'POST /x', sha256('r')); SELECT 1;`)
	if sqlCode(err) != "23503" {
		t.Errorf("a claim in an implicit multi-statement transaction: %v", err)
	}
	// Autocommit, one statement.
	_, err = app.Exec(ctx, `SELECT idem.idem_begin('p', 'c3', 'POST /x', sha256('r'))`)
	if sqlCode(err) != "23503" {
		t.Errorf("an autocommit claim: %v", err)
	}
	if n := pgtest.Count(t, admin, `SELECT count(*) FROM idem.idempotency_keys`); n != 0 {
		t.Errorf("%d rows committed without completion", n)
	}

	// PREPARE TRANSACTION.
	tx, _ := app.Begin(ctx)
	pgtest.Exec(t, tx, `SELECT idem.idem_begin('p', 'c4', 'POST /x', sha256('r'))`)
	_, err = tx.Exec(ctx, `PREPARE TRANSACTION 'misuse_c4'`)
	t.Logf("PREPARE TRANSACTION with a claim: %v", err)
	tx.Rollback(ctx)
	if n := pgtest.Count(t, admin, `SELECT count(*) FROM pg_prepared_xacts WHERE gid = 'misuse_c4'`); n != 0 {
		pgtest.Exec(t, admin, `ROLLBACK PREPARED 'misuse_c4'`)
		t.Errorf("a claim without completion was prepared")
	}

	// A procedure that claims and commits (as the app role; SECURITY INVOKER, in public).
	pgtest.Exec(t, admin, `CREATE PROCEDURE public.misuse_claim(k text) LANGUAGE plpgsql AS $$
		BEGIN PERFORM idem.idem_begin('p', k, 'POST /x', sha256('r')); COMMIT; END $$`)
	_, err = app.Exec(ctx, `CALL public.misuse_claim('c5')`)
	if sqlCode(err) != "23503" {
		t.Errorf("CALL of a procedure that claims and commits: %v", err)
	}
	if n := pgtest.Count(t, admin, `SELECT count(*) FROM idem.idempotency_keys WHERE key = 'c5'`); n != 0 {
		t.Errorf("procedure committed a claim without its completion")
	}

	// idem_complete from another session than the claim's: 55000, the claim's COMMIT refused.
	tx, _ = app.Begin(ctx)
	a, err := beginAs(ctx, tx, "p", "c6", "POST /x", sum256("r"), "")
	if err != nil {
		t.Fatal(err)
	}
	other := pgtest.Connect(t, appURL)
	if _, err := other.Exec(ctx, `SELECT idem.idem_complete('p', 'c6', $1, 200, '{}', 'x')`, a.Attempt); sqlCode(err) != "55000" {
		t.Errorf("idem_complete from another transaction: %v", err)
	}
	if err := tx.Commit(ctx); sqlCode(err) != "23503" {
		t.Errorf("commit: %v", err)
	}

	// ROLLBACK TO a savepoint before the claim: a waiter on the key claims at once.
	tx, _ = app.Begin(ctx)
	pgtest.Exec(t, tx, `SAVEPOINT s`)
	if _, err := beginAs(ctx, tx, "p", "c7", "POST /x", sum256("r"), ""); err != nil {
		t.Fatal(err)
	}
	done := make(chan beginAnswer, 1)
	go func() {
		a, err := beginAs(ctx, other, "p", "c7", "POST /x", sum256("r"), ", p_lease => '1 minute', p_lock_timeout => '10 s'")
		if err != nil {
			a.Outcome = err.Error()
		}
		done <- a
	}()
	pgtest.WaitUntilBlocked(t, admin, other.PgConn().PID())
	pgtest.Exec(t, tx, `ROLLBACK TO SAVEPOINT s`)
	select {
	case a := <-done:
		if a.Outcome != "claimed" {
			t.Errorf("waiter after ROLLBACK TO SAVEPOINT: %+v", a)
		}
	case <-time.After(5 * time.Second):
		t.Errorf("the waiter still waits after the claim's savepoint rolled back")
	}
	tx.Rollback(ctx)
	<-time.After(0)
}

// TestCleanupConcurrentCallers: several sessions clean at once, as pg_cron runs beside a Go
// cleaner: every expired row deleted exactly once, live rows (a running lease, a completed
// answer, an uncommitted reclaim) never.
func TestCleanupConcurrentCallers(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, admin, url, appURL := appSession(t, true)
	pgtest.InsertExpired(t, admin, "exp", 3000)
	app := pgtest.Connect(t, appURL)
	l, err := beginAs(ctx, app, "p", "lease", "POST /x", sum256("r"), ", p_ttl => '1 ms', p_lease => '1 hour'")
	if err != nil || l.Outcome != "claimed" {
		t.Fatal(err)
	}
	_ = url
	var wg sync.WaitGroup
	var mu sync.Mutex
	total := 0
	for i := 0; i < 4; i++ {
		c := pgtest.Connect(t, appURL)
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			if i%2 == 0 {
				var n int64
				if err := c.QueryRow(ctx, `CALL idem.idem_cleanup_all(250, NULL)`).Scan(&n); err != nil {
					t.Error(err)
				}
				mu.Lock()
				total += int(n)
				mu.Unlock()
				return
			}
			for {
				var n int
				if err := c.QueryRow(ctx, `SELECT idem.idem_cleanup(100)`).Scan(&n); err != nil {
					t.Error(err)
					return
				}
				mu.Lock()
				total += n
				mu.Unlock()
				if n < 100 {
					return
				}
			}
		}(i)
	}
	wg.Wait()
	left := pgtest.Count(t, admin, `SELECT count(*) FROM idem.idempotency_keys WHERE principal_id = 'exp'`)
	if total+left != 3000 {
		t.Errorf("deleted %d, left %d: not 3000", total, left)
	}
	if n := pgtest.Count(t, admin, `SELECT count(*) FROM idem.idempotency_keys WHERE key = 'lease'`); n != 1 {
		t.Errorf("the running lease was deleted")
	}
	var n int64
	if err := app.QueryRow(ctx, `CALL idem.idem_cleanup_all(250, NULL)`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if left-int(n) != 0 {
		t.Errorf("left %d after a second run that deleted %d", left, n)
	}
}

// TestGenerationsAndProviderKeys: the table of docs/sql-api.md, "Generations and provider
// keys", as the app role over the simple protocol; and a rotation of the installation's secret
// by the owner, seen from a session whose plans predate it. (Its leases last 500 ms: with 50 ms
// a loaded CI machine let one run out before the duplicate came.)
func TestGenerationsAndProviderKeys(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	app, admin, _, appURL := appSession(t, true)
	pk := func(a beginAnswer) string {
		if a.ProviderKey == nil {
			return "<nil>"
		}
		return *a.ProviderKey
	}
	a, err := beginAs(ctx, app, "alice", "g", "POST /x", sum256("r"), ", p_ttl => '1500 ms', p_lease => '500 ms'")
	if err != nil || a.Outcome != "claimed" || len(pk(a)) != 64 {
		t.Fatalf("%+v %v", a, err)
	}
	b, _ := beginAs(ctx, app, "bob", "g", "POST /x", sum256("r"), ", p_lease => '1 minute'")
	if pk(b) == pk(a) {
		t.Errorf("two principals, one provider key")
	}
	d, _ := beginAs(ctx, app, "alice", "g", "POST /x", sum256("r"), ", p_ttl => '1500 ms', p_lease => '500 ms'")
	if d.Outcome != "in_progress" || pk(d) != pk(a) {
		t.Errorf("duplicate: %+v", d)
	}
	time.Sleep(600 * time.Millisecond)
	tk, _ := beginAs(ctx, app, "alice", "g", "POST /x", sum256("r"), ", p_ttl => '1500 ms', p_lease => '500 ms'")
	if tk.Outcome != "claimed" || pk(tk) != pk(a) || tk.Attempt == a.Attempt {
		t.Errorf("takeover: %+v (first %+v)", tk, a)
	}
	// A transactional takeover of the same generation, completed: the replay keeps the key.
	time.Sleep(600 * time.Millisecond)
	tx, _ := app.Begin(ctx)
	tt, err := beginAs(ctx, tx, "alice", "g", "POST /x", sum256("r"), ", p_ttl => '1500 ms'")
	if err != nil || tt.Outcome != "claimed" || pk(tt) != pk(a) {
		t.Fatalf("transactional takeover: %+v %v", tt, err)
	}
	pgtest.Exec(t, tx, `SELECT idem.idem_complete('alice', 'g', $1, 200, '{}', 'ok')`, tt.Attempt)
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	r, _ := beginAs(ctx, app, "alice", "g", "POST /x", sum256("r"), "")
	if r.Outcome != "replay" || pk(r) != pk(a) {
		t.Errorf("replay: %+v", r)
	}
	// Expired and cleaned up: a new generation, a new key.
	time.Sleep(1600 * time.Millisecond)
	pgtest.Exec(t, app, `SELECT idem.idem_cleanup(1000)`)
	if n := pgtest.Count(t, admin, `SELECT count(*) FROM idem.idempotency_keys WHERE principal_id = 'alice'`); n != 0 {
		t.Errorf("cleanup left the expired key")
	}
	n, _ := beginAs(ctx, app, "alice", "g", "POST /x", sum256("r"), ", p_lease => '1 minute'")
	if n.Outcome != "claimed" || pk(n) == pk(a) {
		t.Errorf("after cleanup: %+v", n)
	}

	// The app role may not rotate the secret; nothing changes.
	before := pgtest.Count(t, admin, `SELECT count(*) FROM idem.installation_secrets`)
	if _, err := app.Exec(ctx, `CALL idem.idem_new_installation_secret('1 second')`); err == nil {
		t.Errorf("the app role rotated the installation secret")
	}
	if after := pgtest.Count(t, admin, `SELECT count(*) FROM idem.installation_secrets`); after != before {
		t.Errorf("secrets %d -> %d after a refused call", before, after)
	}
	// A pooled session (plans made before the rotation) and a fresh one, after the rotation.
	pooled := pgtest.Connect(t, appURL)
	y, _ := beginAs(ctx, pooled, "carol", "y", "POST /x", sum256("r"), ", p_lease => '1 minute'")
	if y.Outcome != "claimed" {
		t.Fatal(y)
	}
	pgtest.Exec(t, admin, `CALL idem.idem_new_installation_secret('30 seconds')`)
	if after := pgtest.Count(t, admin, `SELECT count(*) FROM idem.installation_secrets`); after != before+1 {
		t.Fatalf("secrets %d -> %d after the owner's rotation", before, after)
	}
	// The existing generation keeps its key, through a yield and a takeover.
	var ok bool
	if err := pooled.QueryRow(ctx, `SELECT idem.idem_yield('carol', 'y', $1)`, y.Attempt).Scan(&ok); err != nil || !ok {
		t.Fatal(err)
	}
	y2, _ := beginAs(ctx, pooled, "carol", "y", "POST /x", sum256("r"), ", p_lease => '1 minute'")
	if y2.Outcome != "claimed" || pk(y2) != pk(y) {
		t.Errorf("generation across the rotation: %+v (was %s)", y2, pk(y))
	}
	// A new generation in the pooled session takes the new secret: compare with what a fresh
	// superuser session computes from the internal functions for the same generation.
	z, _ := beginAs(ctx, pooled, "carol", "z", "POST /x", sum256("r"), ", p_lease => '1 minute'")
	var want string
	adm2 := pgtest.Connect(t, admin.Config().ConnString())
	if err := adm2.QueryRow(ctx, `SELECT encode(sha256((idem.provider_key_prefixes())[width_bucket($1::bigint, idem.provider_key_bounds()) + 1]
		|| convert_to('carol', 'UTF8') || '\x00'::bytea || convert_to('z', 'UTF8') || '\x00'::bytea || convert_to($1::text, 'UTF8')), 'hex')`, z.Attempt).Scan(&want); err != nil {
		t.Fatal(err)
	}
	var oldWant string
	if err := adm2.QueryRow(ctx, `SELECT encode(sha256((idem.provider_key_prefixes())[2]
		|| convert_to('carol', 'UTF8') || '\x00'::bytea || convert_to('z', 'UTF8') || '\x00'::bytea || convert_to($1::bigint::text, 'UTF8')), 'hex')`, z.Attempt).Scan(&oldWant); err != nil {
		t.Logf("old prefix: %v", err)
	}
	if pk(z) != want {
		t.Errorf("new generation in a session older than the rotation: provider key %s, want %s (old secret's: %s)", pk(z), want, oldWant)
	}
}

// TestHostileKeysAndIntervals: the edges of the documented ranges, stored values included.
func TestHostileKeysAndIntervals(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	app, admin, _, _ := appSession(t, true)
	fp := sum256("r")
	cases := []struct {
		principal, key, extra string
		args                  []any
		want                  string
	}{
		{"p", strings.Repeat("!", 255), "", nil, "ok"},
		{"p", strings.Repeat("~", 256), "", nil, "22023"},
		{"p", "a\tb", "", nil, "22023"},
		{"p", "a\x7fb", "", nil, "22023"},
		{"p", "a\x01", "", nil, "22023"},
		{"p", "ключ", "", nil, "22023"},
		{"p", "a b", "", nil, "22023"},
		{strings.Repeat("é", 255), "k", "", nil, "ok"},
		{strings.Repeat("é", 256), "k", "", nil, "22023"},
		{"", "k", "", nil, "22023"},
		{" ", "k-space-principal", "", nil, "ok"},
		{"p", "lt1", ", p_lock_timeout => '1 mon'", nil, "22023"},
		{"p", "lt2", ", p_lock_timeout => '24 days'", nil, "ok"},
		{"p", "lt3", ", p_lock_timeout => '25 days'", nil, "22023"},
		{"p", "lt4", ", p_lock_timeout => '0'", nil, "22023"},
		{"p", "lt5", ", p_lock_timeout => '1 day -1 hour'", nil, "22023"},
		{"p", "lt6", ", p_lock_timeout => '1 microsecond'", nil, "ok"},
		{"p", "t1", ", p_ttl => '1 mon'", nil, "ok"},
		{"p", "t2", ", p_ttl => '10 years'", nil, "ok"},
		{"p", "t3", ", p_ttl => '10 years 1 microsecond'", nil, "22023"},
		{"p", "t4", ", p_ttl => '-1 year 361 days'", nil, "22023"},
		{"p", "t5", ", p_ttl => '0.4 microseconds'", nil, "22023"},
		{"p", "t6", ", p_ttl => NULL", nil, "ok"},
		{"p", "l1", ", p_lease => '10 years', p_ttl => '10 years'", nil, "ok"},
		{"p", "l2", ", p_lease => '1 mon -1 day'", nil, "22023"},
		{"p", "l3", ", p_lease => '0'", nil, "22023"},
	}
	for _, c := range cases {
		tx, _ := app.Begin(ctx)
		_, err := beginAs(ctx, tx, c.principal, c.key, "POST /x", fp, c.extra, c.args...)
		if got := sqlCode(err); got != c.want {
			t.Errorf("principal %q key %q %s: %s, want %s", c.principal, c.key, c.extra, got, c.want)
		}
		tx.Rollback(ctx)
	}
	for _, l := range []int{31, 33, 0} {
		_, err := beginAs(ctx, app, "p", "fp", "POST /x", make([]byte, l), "")
		if sqlCode(err) != "22023" {
			t.Errorf("fingerprint of %d bytes: %v", l, err)
		}
	}
	// Stored: a TTL of one month is 720 hours from the answer, whatever the calendar.
	tx, _ := app.Begin(ctx)
	a, err := beginAs(ctx, tx, "p", "month", "POST /x", fp, ", p_ttl => '1 mon'")
	if err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, tx, `SELECT idem.idem_complete('p', 'month', $1, 200, '{}', 'x')`, a.Attempt)
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	var kept time.Duration
	if err := admin.QueryRow(ctx, `SELECT greatest(expires_at, lease_expires_at) - now() FROM idem.idempotency_keys WHERE key = 'month'`).Scan(&kept); err != nil {
		t.Fatal(err)
	}
	if kept < 719*time.Hour || kept > 721*time.Hour {
		t.Errorf("a month's TTL kept %v", kept)
	}
	if n := pgtest.Count(t, admin, `SELECT count(*) FROM idem.idempotency_keys`); n != 1 {
		t.Errorf("%d rows stored (only 'month' was committed)", n)
	}
}

// TestHugeBody: no limit is documented for p_body; a 16 MB body (more than the middleware's
// default MaxBodyBytes) stores and replays byte for byte (PostgreSQL's own bound is 1 GB).
func TestHugeBody(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	app, _, _, _ := appSession(t, false)
	body := make([]byte, 16<<20)
	for i := range body {
		body[i] = byte(i*7 + i>>9)
	}
	tx, _ := app.Begin(ctx)
	a, err := beginAs(ctx, tx, "p", "big", "POST /x", sum256("r"), "")
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if _, err := tx.Exec(ctx, `SELECT idem.idem_complete('p', 'big', $1, 200, '{}', $2)`, a.Attempt, body); err != nil {
		t.Fatalf("complete with 16 MB: %v", err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	r, err := beginAs(ctx, app, "p", "big", "POST /x", sum256("r"), "")
	if err != nil || r.Outcome != "replay" || !bytes.Equal(r.Body, body) {
		t.Errorf("replay of 16 MB: %v %v %d", r.Outcome, err, len(r.Body))
	}
	t.Logf("16 MB stored and replayed in %v", time.Since(start))
}

// TestStepsRules: work in steps as the app role.
func TestStepsRules(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	app, _, _, _ := appSession(t, true)
	var outcome string
	var tok int64
	var point *string
	if err := app.QueryRow(ctx, `SELECT outcome, attempt, recovery_point FROM idem.idem_begin_steps('p', 's', 'POST /x', sha256('r'), p_lease => '50 ms')`).Scan(&outcome, &tok, &point); err != nil || outcome != "claimed" || point != nil {
		t.Fatal(outcome, err)
	}
	pgtest.Exec(t, app, `SELECT idem.idem_step('p', 's', $1, 'ünïcödé', '"€€€"')`, tok)
	if _, err := app.Exec(ctx, `SELECT idem.idem_step('p', 's', $1, 'ünïcödé')`, tok); sqlCode(err) != "23505" {
		t.Errorf("step twice: %v", err)
	}
	// Size is counted in bytes of the text form: 3000 euro signs are 9000 bytes.
	if _, err := app.Exec(ctx, `SELECT idem.idem_step('p', 's', $1, 'big', to_jsonb(repeat('€', 3000)))`, tok); sqlCode(err) != "22023" {
		t.Errorf("9000 bytes of saved values: %v", err)
	}
	time.Sleep(70 * time.Millisecond)
	var tok2 int64
	var saved *string
	if err := app.QueryRow(ctx, `SELECT outcome, attempt, recovery_point, recovery_saved::text FROM idem.idem_begin_steps('p', 's', 'POST /x', sha256('r'), p_lease => '1 minute')`).Scan(&outcome, &tok2, &point, &saved); err != nil || outcome != "claimed" || point == nil || *point != "ünïcödé" {
		t.Fatalf("takeover: %v %v %v", outcome, point, err)
	}
	if _, err := app.Exec(ctx, `SELECT idem.idem_step('p', 's', $1, 'late')`, tok); sqlCode(err) != "55000" {
		t.Errorf("step by the taken-over holder: %v", err)
	}
	pgtest.Exec(t, app, `SELECT idem.idem_complete('p', 's', $1, 200, '{}', 'x')`, tok2)
	if _, err := app.Exec(ctx, `SELECT * FROM idem.idem_recovery('p', 's', $1)`, tok2); sqlCode(err) != "55000" {
		t.Errorf("recovery after completion: %v", err)
	}
	// A transactional claim records no step.
	tx, _ := app.Begin(ctx)
	defer tx.Rollback(ctx)
	if err := tx.QueryRow(ctx, `SELECT attempt FROM idem.idem_begin('p', 'st', 'POST /x', sha256('r'))`).Scan(&tok); err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `SELECT idem.idem_step('p', 'st', $1, 'a')`, tok); sqlCode(err) != "55000" {
		t.Errorf("step of a transactional claim: %v", err)
	}
}

// TestLockTimeoutPerCall: p_lock_timeout bounds the wait for an uncommitted holder (shorter
// and longer than the 2 s default), raises 55P03, aborts the caller's transaction, and leaves
// the session's own lock_timeout as it was; a statement_timeout below it ends the wait with
// 57014.
func TestLockTimeoutPerCall(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	holder, _, _, appURL := appSession(t, true)
	waiter := pgtest.Connect(t, appURL)
	tx, _ := holder.Begin(ctx)
	defer tx.Rollback(ctx)
	if a, err := beginAs(ctx, tx, "p", "held", "POST /x", sum256("r"), ""); err != nil || a.Outcome != "claimed" {
		t.Fatal(err)
	}
	pgtest.Exec(t, waiter, `SET lock_timeout = '17s'`)
	for _, c := range []struct {
		lt       string
		min, max time.Duration
	}{{"'300 ms'", 250 * time.Millisecond, 1500 * time.Millisecond}, {"'2500 ms'", 2400 * time.Millisecond, 4 * time.Second}} {
		wtx, _ := waiter.Begin(ctx)
		start := time.Now()
		_, err := beginAs(ctx, wtx, "p", "held", "POST /x", sum256("r"), ", p_lock_timeout => "+c.lt)
		took := time.Since(start)
		if sqlCode(err) != "55P03" || took < c.min || took > c.max {
			t.Errorf("p_lock_timeout %s: %v after %v", c.lt, err, took)
		}
		if _, err := wtx.Exec(ctx, `SELECT 1`); sqlCode(err) != "25P02" {
			t.Errorf("transaction after 55P03 not aborted: %v", err)
		}
		wtx.Rollback(ctx)
	}
	var lt string
	if err := waiter.QueryRow(ctx, `SHOW lock_timeout`).Scan(&lt); err != nil || lt != "17s" {
		t.Errorf("session lock_timeout after the calls: %q %v", lt, err)
	}
	pgtest.Exec(t, waiter, `SET statement_timeout = '200ms'`)
	_, err := beginAs(ctx, waiter, "p", "held", "POST /x", sum256("r"), ", p_lock_timeout => '5 s'")
	if sqlCode(err) != "57014" {
		t.Errorf("statement_timeout below the lock timeout: %v", err)
	}
}

// TestSetConstraintsImmediate: a session that runs SET CONSTRAINTS ALL IMMEDIATE checks the
// commit guard at once, so idem_begin itself raised its 23503, which the SQLSTATE table gave to
// COMMIT alone; the table now names this case. Nothing is stored. And SET CONSTRAINTS ALL
// DEFERRED after a claim does not let it commit without its completion.
func TestSetConstraintsImmediate(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	app, admin, _, _ := appSession(t, true)
	tx, _ := app.Begin(ctx)
	pgtest.Exec(t, tx, `SET CONSTRAINTS ALL IMMEDIATE`)
	_, err := beginAs(ctx, tx, "p", "imm", "POST /x", sum256("r"), "")
	if sqlCode(err) != "23503" || !strings.Contains(err.Error(), "idempotency_keys_claim_completed_in_its_transaction") {
		t.Errorf("idem_begin under SET CONSTRAINTS ALL IMMEDIATE: %v; want the commit guard's 23503, as docs/sql-api.md says", err)
	}
	tx.Rollback(ctx)
	tx, _ = app.Begin(ctx)
	if _, err := beginAs(ctx, tx, "p", "imm2", "POST /x", sum256("r"), ""); err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `SET CONSTRAINTS ALL DEFERRED`); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); sqlCode(err) != "23503" {
		t.Errorf("commit after SET CONSTRAINTS ALL DEFERRED: %v", err)
	}
	if n := pgtest.Count(t, admin, `SELECT count(*) FROM idem.idempotency_keys`); n != 0 {
		t.Errorf("%d uncompleted claims committed", n)
	}
}

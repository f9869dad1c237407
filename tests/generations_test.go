package tests

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/internal/pgtest"
)

// ownerSecret reads the newest installation secret (32 bytes) as the owner.
func ownerSecret(t *testing.T, admin *pgx.Conn) []byte {
	t.Helper()
	var b []byte
	if err := admin.QueryRow(context.Background(), `SELECT string_agg(int8send(pg_sequence_last_value(u.q::regclass)), ''::bytea ORDER BY u.o)
		FROM idem.installation_secrets AS s, unnest(s.secret_seqs) WITH ORDINALITY AS u(q, o)
		WHERE s.from_token = (SELECT max(from_token) FROM idem.installation_secrets)`).Scan(&b); err != nil {
		t.Fatal(err)
	}
	if len(b) != 32 {
		t.Fatalf("secret of %d bytes", len(b))
	}
	return b
}

// providerKeyFormula is docs/sql-api.md's formula: SHA-256 of the label "pgidem provider key v3", the
// secret, the principal, the key and the generation in decimal, UTF-8, each part followed by a
// NUL byte but the last.
func providerKeyFormula(secret []byte, principal, key string, gen int64) string {
	h := sha256.New()
	h.Write([]byte("pgidem provider key v3\x00"))
	h.Write(secret)
	h.Write([]byte{0})
	h.Write([]byte(principal))
	h.Write([]byte{0})
	h.Write([]byte(key))
	h.Write([]byte{0})
	h.Write([]byte(strconv.FormatInt(gen, 10)))
	return hex.EncodeToString(h.Sum(nil))
}

func pkOf(a beginAnswer) string {
	if a.ProviderKey == nil {
		return "<nil>"
	}
	return *a.ProviderKey
}

// TestGenerationsHashInputsAreUnambiguous: with the same generation number forced (the token
// sequence set back by the owner, test-only), principals and keys that a naive concatenation
// would confuse get different provider keys, NFC and NFD spellings of one principal are two
// principals with two keys, and every key equals the documented formula computed outside.
func TestGenerationsHashInputsAreUnambiguous(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	app, admin, _, _ := appSession(t, false)
	secret := ownerSecret(t, admin)
	const gen = 5000000
	cases := []struct{ principal, key string }{
		{"a", "bc"}, {"ab", "c"}, // principal/key boundary
		{"p", "x1"}, {"p", "x12"}, // key/generation boundary (x1 + "2..." vs x12 + "..."): same gen, so checked by the formula
		{"caf\u00e9", "k"}, {"cafe\u0301", "k"}, // NFC, NFD
		{"p ", "k"}, {"p", "k"}, // trailing space
		{"\u212b", "k"}, {"\u00c5", "k"}, // ANGSTROM SIGN vs LATIN A WITH RING
	}
	seen := map[string]string{}
	for _, c := range cases {
		pgtest.Exec(t, admin, `SELECT setval('idem.token_seq', $1, false)`, int64(gen))
		a, err := beginAs(ctx, app, c.principal, c.key, "POST /x", sum256("r"), ", p_lease => '1 minute'")
		if err != nil || a.Outcome != "claimed" || a.Attempt != gen {
			t.Fatalf("%q/%q: %+v %v", c.principal, c.key, a, err)
		}
		pk := pkOf(a)
		if want := providerKeyFormula(secret, c.principal, c.key, gen); pk != want {
			t.Errorf("%q/%q gen %d: provider key %s, the documented formula gives %s", c.principal, c.key, gen, pk, want)
		}
		id := fmt.Sprintf("%q/%q", c.principal, c.key)
		if other, dup := seen[pk]; dup {
			t.Errorf("%s and %s share provider key %s", id, other, pk)
		}
		seen[pk] = id
	}
	// The key/generation boundary for real: key "x1" at generation 23 and key "x12" at
	// generation 3 (hash inputs "x1" NUL "23" and "x12" NUL "3").
	var pks []string
	for _, c := range []struct {
		key string
		gen int64
	}{{"y1", 6000023}, {"y12", 600003}} {
		pgtest.Exec(t, admin, `SELECT setval('idem.token_seq', $1, false)`, c.gen)
		a, err := beginAs(ctx, app, "p", c.key, "POST /x", sum256("r"), ", p_lease => '1 minute'")
		if err != nil || a.Attempt != c.gen {
			t.Fatalf("%+v %v", a, err)
		}
		pks = append(pks, pkOf(a))
	}
	if pks[0] == pks[1] {
		t.Errorf("key/generation boundary: one provider key %s", pks[0])
	}
}

// storyAnswer is one answer in the story of a key: what reported it, the token and the
// provider key.
type storyAnswer struct {
	what    string
	attempt int64
	pk      string
}

// TestGenerationsEveryPathOfOneKey: one principal and key through every path that
// continues or ends a generation, as idem_app (and idem_operator for the operators' functions):
// every answer of one generation carries one provider key, on every function that reports it;
// every new generation gets a key no earlier one had; every claim's token is one no earlier
// holder of the key had.
func TestGenerationsEveryPathOfOneKey(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	app, admin, url, _ := appSession(t, false)
	op := pgtest.Connect(t, pgtest.LoginRole(t, url, "idem_operator"))
	const P, K = "alice", "gen-key"
	fp, other := sum256("r1"), sum256("r2")
	lease := ", p_lease => '1 minute'"
	var story []storyAnswer
	gens := map[string]int{} // provider key -> generation index
	var maxToken int64
	gen := 0
	note := func(what string, a beginAnswer, wantOutcome string, newGen bool) {
		t.Helper()
		if a.Outcome != wantOutcome {
			t.Fatalf("%s: outcome %s, want %s (%+v)", what, a.Outcome, wantOutcome, a)
		}
		pk := pkOf(a)
		story = append(story, storyAnswer{what, a.Attempt, pk})
		if wantOutcome == "claimed" {
			if a.Attempt <= maxToken {
				t.Errorf("%s: token %d, an earlier holder had up to %d", what, a.Attempt, maxToken)
			}
			maxToken = a.Attempt
		}
		if newGen {
			gen++
			if g, ok := gens[pk]; ok {
				t.Errorf("%s: new generation %d got generation %d's provider key %s", what, gen, g, pk)
			}
			gens[pk] = gen
			return
		}
		if g, ok := gens[pk]; !ok || g != gen {
			t.Errorf("%s: provider key %s, want generation %d's (story %+v)", what, pk, gen, story)
		}
	}
	begin := func(q rowQuerier, f []byte, extra string) beginAnswer {
		t.Helper()
		a, err := beginAs(ctx, q, P, K, "POST /x", f, extra)
		if err != nil {
			t.Fatal(err)
		}
		return a
	}
	stuckPK := func(attempt int64) string {
		t.Helper()
		var pk string
		if err := op.QueryRow(ctx, `SELECT provider_key FROM idem.idem_stuck() WHERE principal_id = $1 AND key = $2 AND attempt = $3`,
			P, K, attempt).Scan(&pk); err != nil {
			t.Fatalf("idem_stuck: %v", err)
		}
		return pk
	}
	runOut := func(alsoExpire bool) {
		t.Helper()
		set := `lease_expires_at = clock_timestamp() - interval '1 second'`
		if alsoExpire {
			set += `, expires_at = clock_timestamp() - interval '1 second'`
		}
		pgtest.Exec(t, admin, `UPDATE idem.idempotency_keys SET `+set+` WHERE principal_id = $1 AND key = $2`, P, K)
	}

	// Generation 1: a lease claim, a duplicate, idem_begin_steps, idem_stuck, a yield and its
	// retry, an operator's release of a stuck claim and its retry, a lease run out and a
	// transactional takeover that rolls its work back to a savepoint and saves a final error.
	a := begin(app, fp, lease)
	note("fresh lease claim", a, "claimed", true)
	note("duplicate", begin(app, fp, lease), "in_progress", false)
	var stepsOutcome, stepsPK string
	if err := app.QueryRow(ctx, `SELECT outcome, provider_key FROM idem.idem_begin_steps(p_principal => $1, p_key => $2,
		p_action => 'POST /x', p_request_sha256 => $3, p_lease => '1 minute')`, P, K, fp).Scan(&stepsOutcome, &stepsPK); err != nil {
		t.Fatal(err)
	}
	note("idem_begin_steps duplicate", beginAnswer{Outcome: stepsOutcome, ProviderKey: &stepsPK}, "in_progress", false)
	note("idem_stuck", beginAnswer{Outcome: "stuck", ProviderKey: strPtr(stuckPK(a.Attempt))}, "stuck", false)
	pgtest.Exec(t, app, `SELECT idem.idem_step($1, $2, $3, 'one', '1')`, P, K, a.Attempt)
	var ok bool
	if err := app.QueryRow(ctx, `SELECT idem.idem_yield($1, $2, $3)`, P, K, a.Attempt).Scan(&ok); err != nil || !ok {
		t.Fatalf("yield: %v %v", ok, err)
	}
	b := begin(app, fp, lease)
	note("retry after a yield", b, "claimed", false)
	pgtest.Exec(t, op, `SELECT idem.idem_release_stuck($1, $2, $3, 'test')`, P, K, b.Attempt)
	c := begin(app, fp, lease)
	note("retry after idem_release_stuck", c, "claimed", false)
	note("idem_stuck after release_stuck", beginAnswer{Outcome: "stuck", ProviderKey: strPtr(stuckPK(c.Attempt))}, "stuck", false)
	runOut(false)
	tx, err := app.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	d := begin(tx, fp, "")
	note("transactional takeover of a lease that ran out", d, "claimed", false)
	pgtest.Exec(t, tx, `SAVEPOINT work`)
	pgtest.Exec(t, tx, `CREATE TEMP TABLE gen_work (x int)`)
	pgtest.Exec(t, tx, `ROLLBACK TO SAVEPOINT work`)
	if err := tx.QueryRow(ctx, `SELECT idem.idem_save_final($1, $2, 'POST /x', $3, NULL, 422, '{}', 'final')`, P, K, fp).Scan(&ok); err != nil || !ok {
		t.Fatalf("save_final of its own claim: %v %v", ok, err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	r := begin(app, fp, "")
	note("replay of the final error", r, "replay", false)
	if m := begin(app, other, ""); m.Outcome != "mismatch" || m.ProviderKey != nil {
		t.Errorf("mismatch: %+v (a mismatch carries no provider key)", m)
	}
	note("replay after a mismatch", begin(app, fp, ""), "replay", false)

	// Generation 2: the key expired without cleanup; the same request claims it.
	runOut(true)
	e := begin(app, fp, lease)
	note("expired, not cleaned up, same request", e, "claimed", true)
	// The old holder's late answer finds nothing (fenced), and the generation stays.
	if _, err := app.Exec(ctx, `SELECT idem.idem_complete($1, $2, $3, 200, '{}', 'late')`, P, K, c.Attempt); sqlCode(err) != "55000" {
		t.Errorf("late answer of a holder of generation 1: %v, want 55000", err)
	}
	note("duplicate after a late answer", begin(app, fp, lease), "in_progress", false)

	// Generation 3: released; the same request claims again.
	if err := app.QueryRow(ctx, `SELECT idem.idem_release($1, $2, $3)`, P, K, e.Attempt).Scan(&ok); err != nil || !ok {
		t.Fatalf("release: %v %v", ok, err)
	}
	f := begin(app, fp, lease)
	note("released, same request", f, "claimed", true)
	pgtest.Exec(t, app, `SELECT idem.idem_complete($1, $2, $3, 201, '{}', 'ok')`, P, K, f.Attempt)
	note("replay", begin(app, fp, ""), "replay", false)

	// Generation 4: expired and cleaned up.
	runOut(true)
	pgtest.Exec(t, admin, `UPDATE idem.idempotency_keys SET lease_expires_at = clock_timestamp() - interval '1 second'
		WHERE principal_id = $1 AND key = $2`, P, K)
	if n := pgtest.Count(t, app, `SELECT idem.idem_cleanup(1000)`); n != 1 {
		t.Fatalf("cleanup deleted %d", n)
	}
	g := begin(app, fp, lease)
	note("cleaned up, same request", g, "claimed", true)
	pgtest.Exec(t, app, `SELECT idem.idem_complete($1, $2, $3, 201, '{}', 'ok')`, P, K, g.Attempt)

	// A transactional claim rolled back: nothing of it stays; the next claim is a new generation
	// whose key and token differ from the rolled-back one's.
	runOut(true)
	tx, err = app.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	h := begin(tx, fp, "")
	if h.Outcome != "claimed" {
		t.Fatalf("%+v", h)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	i := begin(app, fp, lease)
	note("after a rolled-back transactional claim", i, "claimed", true)
	if i.Attempt <= h.Attempt || pkOf(i) == pkOf(h) {
		t.Errorf("rolled back claim %d %s, next claim %d %s", h.Attempt, pkOf(h), i.Attempt, pkOf(i))
	}
	pgtest.Exec(t, app, `SELECT idem.idem_complete($1, $2, $3, 201, '{}', 'ok')`, P, K, i.Attempt)

	// A final error saved on a free (expired) key: a new generation, whose replay carries a
	// new key.
	runOut(true)
	if err := app.QueryRow(ctx, `SELECT idem.idem_save_final($1, $2, 'POST /x', $3, NULL, 404, '{}', 'nf')`, P, K, fp).Scan(&ok); err != nil || !ok {
		t.Fatalf("save_final on a free key: %v %v", ok, err)
	}
	note("replay of a final error saved on a free key", begin(app, fp, ""), "replay", true)
	t.Logf("story: %+v", story)
}

func strPtr(s string) *string { return &s }

// TestGenerationsDumpRestoreIsACopy: docs/sql-api.md and docs/operations.md say a dump restored into
// another database carries the original's secret (so the same token gives the same provider
// key), that CALL idem.idem_new_installation_secret() in the copy gives the generations that
// start afterwards keys the original never gives, and that generations that exist (a lease in
// flight when the dump was taken) keep their keys. Checked with the real pg_dump and psql.
func TestGenerationsDumpRestoreIsACopy(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	origURL := pgtest.NewDB(t)
	orig := pgtest.Connect(t, origURL)
	origApp := pgtest.Connect(t, pgtest.LoginRole(t, origURL, "idem_app"))
	inFlight, err := beginAs(ctx, origApp, "alice", "in-flight", "POST /pay", sum256("p"), ", p_lease => '1 minute'")
	if err != nil || inFlight.Outcome != "claimed" {
		t.Fatalf("%+v %v", inFlight, err)
	}
	dump, err := exec.Command("pg_dump", "--no-owner", "-d", origURL).Output()
	if err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			t.Fatalf("pg_dump: %v: %s", err, ee.Stderr)
		}
		t.Fatal(err)
	}
	copyURL := pgtest.NewEmptyDB(t)
	f, err := os.CreateTemp(t.TempDir(), "dump*.sql")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.Write(dump); err != nil {
		t.Fatal(err)
	}
	f.Close()
	if out, err := exec.Command("psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", copyURL, "-f", f.Name()).CombinedOutput(); err != nil {
		t.Fatalf("restore: %v: %s", err, out)
	}
	cp := pgtest.Connect(t, copyURL)
	cpApp := pgtest.Connect(t, pgtest.LoginRole(t, copyURL, "idem_app"))

	// The same token in both: the same key before the copy's own secret (documented).
	sameToken := func(key string) (string, string, int64) {
		t.Helper()
		next := int64(pgtest.Count(t, cp, `SELECT greatest((SELECT last_value FROM idem.token_seq), 0) + 1000`))
		if o := int64(pgtest.Count(t, orig, `SELECT greatest((SELECT last_value FROM idem.token_seq), 0) + 1000`)); o > next {
			next = o
		}
		pgtest.Exec(t, orig, `SELECT setval('idem.token_seq', $1, false)`, next)
		pgtest.Exec(t, cp, `SELECT setval('idem.token_seq', $1, false)`, next)
		a, err := beginAs(ctx, origApp, "alice", key, "POST /pay", sum256("p"), ", p_lease => '1 minute'")
		if err != nil {
			t.Fatal(err)
		}
		b, err := beginAs(ctx, cpApp, "alice", key, "POST /pay", sum256("p"), ", p_lease => '1 minute'")
		if err != nil {
			t.Fatal(err)
		}
		if a.Attempt != b.Attempt || a.Attempt != next {
			t.Fatalf("tokens %d and %d, want %d", a.Attempt, b.Attempt, next)
		}
		return pkOf(a), pkOf(b), next
	}
	if a, b, tok := sameToken("before"); a != b {
		t.Errorf("a restored dump, token %d: provider keys %s and %s; the docs say a copy carries the secret", tok, a, b)
	}
	if _, err := cp.Exec(ctx, `CALL idem.idem_new_installation_secret('30 seconds')`); err != nil {
		t.Fatal(err)
	}
	// The lease in flight when the dump was taken keeps its key in the copy.
	pgtest.Exec(t, cp, `UPDATE idem.idempotency_keys SET lease_expires_at = clock_timestamp() - interval '1 second' WHERE key = 'in-flight'`)
	tk, err := beginAs(ctx, cpApp, "alice", "in-flight", "POST /pay", sum256("p"), ", p_lease => '1 minute'")
	if err != nil || tk.Outcome != "claimed" || pkOf(tk) != pkOf(inFlight) {
		t.Errorf("takeover in the copy of a lease in flight at the dump: %+v %v, want the original's key %s", tk, err, pkOf(inFlight))
	}
	if a, b, tok := sameToken("after"); a == b {
		t.Errorf("after idem_new_installation_secret in the copy, token %d still gives the original's provider key %s", tok, a)
	}
}

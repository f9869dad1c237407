package tests

import (
	"context"
	"crypto/sha256"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/idem/idemmigrate"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// leaseClaim claims principal/key as a lease on url's database through the public package and
// returns the decision.
func leaseClaim(t *testing.T, url, principal, key string) idem.Decision {
	t.Helper()
	conn := pgtest.Connect(t, url)
	d, err := idem.Begin(context.Background(), conn, idem.Claim{Principal: principal, Key: key, Action: "POST /v1/payouts",
		Fingerprint: sha256.Sum256([]byte("100")), Lease: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// TestProviderKeysDifferAcrossInstallations: two databases installed from nothing, the same
// principal, key and request, the first claim in each (so the same generation number is
// possible): the provider keys differ, because each installation's secret enters them.
func TestProviderKeysDifferAcrossInstallations(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	var keys []string
	for range 2 {
		url := pgtest.NewEmptyDB(t)
		if err := idemmigrate.Migrate(ctx, pgtest.Connect(t, url), idemmigrate.Options{}); err != nil {
			t.Fatal(err)
		}
		d := leaseClaim(t, url, "alice", "k1")
		if d.Outcome != idem.Claimed || len(d.ProviderKey) != 64 {
			t.Fatalf("claim: %+v", d)
		}
		keys = append(keys, d.ProviderKey)
	}
	if keys[0] == keys[1] {
		t.Fatalf("two installations gave alice's k1 the same provider key %s", keys[0])
	}
}

// TestNewInstallationSecret: CALL idem.idem_new_installation_secret() in a copy of a database
// (here a clone of the test template, which shares its secret with every other test database)
// gives the generations that start afterwards provider keys no other copy gives, and leaves a
// lease claimed before it with its provider key.
func TestNewInstallationSecret(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	copyA, copyB := pgtest.NewDB(t), pgtest.NewDB(t)
	if a, b := leaseClaim(t, copyA, "alice", "before"), leaseClaim(t, copyB, "alice", "before"); a.Attempt == b.Attempt &&
		a.ProviderKey != b.ProviderKey {
		t.Fatalf("two clones of one database, one token %d: provider keys %s and %s (clones share the secret)", a.Attempt,
			a.ProviderKey, b.ProviderKey)
	}
	inFlight := leaseClaim(t, copyB, "alice", "in-flight")
	// A session that claimed before the call, and so planned the provider key with the old
	// secrets (they are folded into the plan): it must use the new secret afterwards.
	session := pgtest.Connect(t, copyB)
	if _, err := idem.Begin(ctx, session, idem.Claim{Principal: "alice", Key: "session-before", Action: "POST /v1/payouts",
		Fingerprint: sha256.Sum256([]byte("1")), Lease: time.Minute}); err != nil {
		t.Fatal(err)
	}
	conn := pgtest.Connect(t, copyB)
	if _, err := conn.Exec(ctx, `CALL idem.idem_new_installation_secret()`); err != nil {
		t.Fatal(err)
	}
	if n := pgtest.Count(t, conn, `SELECT count(*) FROM idem.installation_secrets`); n != 2 {
		t.Fatalf("%d secrets after the call, want 2", n)
	}
	// The lease claimed before the call runs out and is taken over: the same generation, the
	// same provider key.
	pgtest.Exec(t, conn, `UPDATE idem.idempotency_keys SET lease_expires_at = clock_timestamp() - interval '1 second'
		WHERE key = 'in-flight'`)
	if d := leaseClaim(t, copyB, "alice", "in-flight"); d.Outcome != idem.Claimed || d.ProviderKey != inFlight.ProviderKey {
		t.Fatalf("takeover after the new secret: %s %s, want claimed %s", d.Outcome, d.ProviderKey, inFlight.ProviderKey)
	}
	// A new generation in each copy, with the same token (above the new secret's first one):
	// different keys now.
	next := pgtest.Count(t, conn, `SELECT last_value + 1000 FROM idem.token_seq`)
	for _, url := range []string{copyA, copyB} {
		pgtest.Exec(t, pgtest.Connect(t, url), `SELECT setval('idem.token_seq', $1, false)`, next)
	}
	a, b := leaseClaim(t, copyA, "alice", "after"), leaseClaim(t, copyB, "alice", "after")
	if a.Attempt != b.Attempt {
		t.Fatalf("the copies drew tokens %d and %d; the test wants one", a.Attempt, b.Attempt)
	}
	if a.ProviderKey == b.ProviderKey {
		t.Fatalf("after idem_new_installation_secret the copy still gives the original's provider key %s", a.ProviderKey)
	}
	// The session that had planned the old secrets computes a new generation's key with the new one.
	d, err := idem.Begin(ctx, session, idem.Claim{Principal: "alice", Key: "session-after", Action: "POST /v1/payouts",
		Fingerprint: sha256.Sum256([]byte("1")), Lease: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	var want string
	if err := conn.QueryRow(ctx, `SELECT encode(sha256('pgidem provider key v3'::bytea || '\x00'::bytea
		|| (SELECT string_agg(int8send(pg_sequence_last_value(u.q::regclass)), ''::bytea ORDER BY u.o)
		      FROM unnest(s.secret_seqs) WITH ORDINALITY AS u(q, o)) || '\x00'::bytea
		|| 'alice'::bytea || '\x00'::bytea || 'session-after'::bytea || '\x00'::bytea || convert_to($1::bigint::text, 'UTF8')), 'hex')
		FROM idem.installation_secrets AS s ORDER BY s.from_token DESC LIMIT 1`, d.Attempt).Scan(&want); err != nil {
		t.Fatal(err)
	}
	if d.ProviderKey != want {
		t.Fatalf("a session that planned the provider key before the new secret gave %s, want %s (the new secret's)", d.ProviderKey, want)
	}
	// Nobody but the owner may run it.
	app := pgtest.Connect(t, pgtest.LoginRole(t, copyB, "idem_app"))
	if _, err := app.Exec(ctx, `CALL idem.idem_new_installation_secret()`); err == nil {
		t.Fatal("the application role ran idem_new_installation_secret")
	}
}

// TestNewInstallationSecretWaitsForThisDatabaseOnly (review finding): the procedure waits for the
// transactions that were running when the new secret committed, and only this database's can
// claim a key here: a transaction open in another database of the cluster (a pg_dump, a long
// report) must not hold it up, while one open in this database must.
func TestNewInstallationSecretWaitsForThisDatabaseOnly(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	here, elsewhere := pgtest.NewDB(t), pgtest.NewDB(t)
	other, err := pgtest.Connect(t, elsewhere).Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer other.Rollback(ctx)
	if _, err := other.Exec(ctx, `SELECT 1`); err != nil {
		t.Fatal(err)
	}
	conn := pgtest.Connect(t, here)
	start := time.Now()
	if _, err := conn.Exec(ctx, `CALL idem.idem_new_installation_secret(p_wait => '5 seconds')`); err != nil {
		t.Fatalf("a transaction open in another database held the call up: %v (after %s)", err, time.Since(start))
	}
	local, err := pgtest.Connect(t, here).Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer local.Rollback(ctx)
	if _, err := local.Exec(ctx, `SELECT 1`); err != nil {
		t.Fatal(err)
	}
	_, err = conn.Exec(ctx, `CALL idem.idem_new_installation_secret(p_wait => '300 milliseconds')`)
	if pgErr := (*pgconn.PgError)(nil); !errors.As(err, &pgErr) || pgErr.Code != "55000" {
		t.Fatalf("with a transaction of this database open since the new secret: %v, want 55000", err)
	}
}

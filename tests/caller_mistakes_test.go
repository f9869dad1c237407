package tests

// Mistakes a service in another language makes with the SQL API, from a review of it as a
// Python service (psycopg2) that read only docs/sql-api.md: each is answered as that page says.

import (
	"context"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestAutocommitTransactionalClaimIs23503: outside a transaction block (a driver's autocommit
// mode) a transactional claim commits with its statement, without its completion: SQLSTATE
// 23503 from the commit guard at once, nothing stored. A lease claim in the same mode commits on
// its own, as it should.
func TestAutocommitTransactionalClaimIs23503(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	app, admin, _, _ := appSession(t, true)
	_, err := beginAs(ctx, app, "p", "auto", "POST /x", sum256("r"), "")
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "23503" ||
		pgErr.ConstraintName != "idempotency_keys_claim_completed_in_its_transaction" {
		t.Fatalf("a transactional claim in autocommit: %v, want 23503 on the commit guard", err)
	}
	if n := pgtest.Count(t, admin, `SELECT count(*) FROM idem.idempotency_keys`); n != 0 {
		t.Fatalf("%d rows stored", n)
	}
	a, err := beginAs(ctx, app, "p", "auto", "POST /x", sum256("r"), ", p_lease => interval '1 minute'")
	if err != nil || a.Outcome != "claimed" {
		t.Fatalf("a lease claim in autocommit: %+v %v", a, err)
	}
	if n := pgtest.Count(t, admin, `SELECT count(*) FROM idem.idempotency_keys WHERE state = 'p'`); n != 1 {
		t.Fatalf("the lease claim: %d rows in progress, want 1", n)
	}
}

// TestProceduresInATransactionBlockAre2D000: idem_cleanup_all (the application's role) and
// idem_new_installation_secret (the owner's) commit as they go; called inside a transaction
// block they raise 2D000, as the SQLSTATE table says, and leave the keys as they were.
func TestProceduresInATransactionBlockAre2D000(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	app, admin, _, _ := appSession(t, false)
	pgtest.InsertExpired(t, admin, "p", 3)
	for _, c := range []struct {
		name string
		call func() error
	}{
		{"idem_cleanup_all as the application", func() error {
			tx, err := app.Begin(ctx)
			if err != nil {
				return err
			}
			defer func() { _ = tx.Rollback(ctx) }()
			_, err = tx.Exec(ctx, `CALL idem.idem_cleanup_all(5000)`)
			return err
		}},
		{"idem_new_installation_secret as the owner", func() error {
			tx, err := admin.Begin(ctx)
			if err != nil {
				return err
			}
			defer func() { _ = tx.Rollback(ctx) }()
			_, err = tx.Exec(ctx, `CALL idem.idem_new_installation_secret(interval '0')`)
			return err
		}},
	} {
		err := c.call()
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "2D000" {
			t.Errorf("%s in a transaction block: %v, want 2D000", c.name, err)
		}
	}
	if n := pgtest.Count(t, admin, `SELECT count(*) FROM idem.idempotency_keys`); n != 3 {
		t.Fatalf("%d keys left, want the 3 expired ones", n)
	}
	if n := pgtest.Count(t, admin, `SELECT count(*) FROM idem.installation_secrets`); n != 1 {
		t.Fatalf("%d installation secrets, want 1", n)
	}
	if _, err := app.Exec(ctx, `CALL idem.idem_cleanup_all(5000)`); err != nil {
		t.Fatalf("idem_cleanup_all on its own: %v", err)
	}
	if n := pgtest.Count(t, admin, `SELECT count(*) FROM idem.idempotency_keys`); n != 0 {
		t.Fatalf("%d keys left after a cleanup on its own", n)
	}
}

// TestADuplicatesAttemptIsTheHolders: the attempt of an in_progress answer is the holder's own
// token, which docs/sql-api.md tells a caller never to pass on: the functions cannot tell the
// duplicate from the holder, and a release with it frees the key for a new generation (a new
// provider key) while the holder is fenced off.
func TestADuplicatesAttemptIsTheHolders(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	app, _, _, _ := appSession(t, false)
	lease := ", p_lease => interval '1 minute'"
	held, err := beginAs(ctx, app, "p", "k", "POST /payouts", sum256("r"), lease)
	if err != nil || held.Outcome != "claimed" {
		t.Fatalf("claim: %+v %v", held, err)
	}
	dup, err := beginAs(ctx, app, "p", "k", "POST /payouts", sum256("r"), lease)
	if err != nil || dup.Outcome != "in_progress" || dup.Attempt != held.Attempt {
		t.Fatalf("duplicate: %+v %v, want in_progress with the holder's token %d", dup, err, held.Attempt)
	}
	other, err := beginAs(ctx, app, "p", "k", "POST /payouts", sum256("other"), lease)
	if err != nil || other.Outcome != "mismatch" || other.Attempt != held.Attempt {
		t.Fatalf("another request: %+v %v, want mismatch with the holder's token %d", other, err, held.Attempt)
	}
	var released bool
	if err := app.QueryRow(ctx, `SELECT idem.idem_release('p', 'k', $1)`, dup.Attempt).Scan(&released); err != nil || !released {
		t.Fatalf("release with the duplicate's attempt: %v %v", released, err)
	}
	next, err := beginAs(ctx, app, "p", "k", "POST /payouts", sum256("r"), lease)
	if err != nil || next.Outcome != "claimed" || *next.ProviderKey == *held.ProviderKey {
		t.Fatalf("after that release: %+v %v, want a new claim with a new provider key", next, err)
	}
	_, err = app.Exec(ctx, `SELECT idem.idem_complete('p', 'k', $1, 201, '{}', '\x7b7d')`, held.Attempt)
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "55000" {
		t.Fatalf("the holder's completion: %v, want 55000", err)
	}
}

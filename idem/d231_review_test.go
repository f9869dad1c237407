package idem_test

// A review of D231/D232 (helper session), no broken promise found here: times read by
// different paths, the client_encoding check behind PgBouncer, bodies in every mode.

import (
	"bytes"
	"context"
	"crypto/sha256"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestFarTimesAgreeAcrossReads: a lease claim of the longest lease and TTL (Claim: "At
// most 10 years"), under a legacy role's settings, in the default mode and in
// QueryExecModeExec. Extend's "lease's new end", ReadKey's LeaseExpiresAt and ReadStuck's
// LeaseExpiresAt are one time, the database's (D231: "Every time and duration the library reads
// comes as whole microseconds"), and ClaimedAt, ExpiresAt are the database's to the
// microsecond, as pgx reads them in the binary format.
func TestFarTimesAgreeAcrossReads(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	admin := pgtest.Connect(t, db)
	appURL := pgtest.LoginRole(t, db, "idem_app")
	opURL := pgtest.LoginRole(t, db, "idem_operator")
	for _, u := range []string{appURL, opURL} {
		for _, s := range legacyRoleSettings {
			pgtest.Exec(t, admin, `ALTER ROLE `+roleOf(t, u)+` SET `+s)
		}
	}
	const far = idem.MaxDuration
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeCacheStatement, pgx.QueryExecModeExec} {
		t.Run(mode.String(), func(t *testing.T) {
			ctx := context.Background()
			app, op := modePool(t, appURL, mode), modePool(t, opURL, mode)
			key := "far-" + strings.ReplaceAll(mode.String(), " ", "-")
			tx, err := app.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = tx.Rollback(ctx) }()
			d, err := idem.Begin(ctx, tx, idem.Claim{Principal: "p", Key: key, Action: "a", Fingerprint: sha256.Sum256([]byte(key)),
				Lease: far, TTL: far})
			if err != nil || d.Outcome != idem.Claimed {
				t.Fatalf("Begin: %+v %v", d, err)
			}
			if err := tx.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			// A second claimer: in progress, with the lease's remaining time.
			tx2, err := app.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			d2, err := idem.Begin(ctx, tx2, idem.Claim{Principal: "p", Key: key, Action: "a", Fingerprint: sha256.Sum256([]byte(key)),
				Lease: far, TTL: far})
			_ = tx2.Rollback(ctx)
			if err != nil || d2.Outcome != idem.InProgress || d2.RetryAfter < far-time.Minute || d2.RetryAfter > far {
				t.Errorf("a second claim: %v, RetryAfter %v, %v; want in progress with about %v", d2.Outcome, d2.RetryAfter, err, far)
			}
			end, err := idem.Extend(ctx, app, "p", key, d.Attempt, far)
			if err != nil {
				t.Fatalf("Extend: %v", err)
			}
			var claimed, expires, lease time.Time
			if err := admin.QueryRow(ctx, `SELECT claimed_at, expires_at, lease_expires_at FROM idem.idem_key($1, $2)`, "p", key).
				Scan(&claimed, &expires, &lease); err != nil {
				t.Fatal(err)
			}
			story, ok, err := idem.ReadKey(ctx, op, "p", key)
			if err != nil || !ok {
				t.Fatalf("ReadKey: %v %v", ok, err)
			}
			time.Sleep(2 * time.Millisecond)
			stuck, err := idem.ReadStuck(ctx, op, time.Microsecond, 10)
			if err != nil {
				t.Fatalf("ReadStuck: %v", err)
			}
			var stuckEnd, stuckClaimed time.Time
			var stuckAge time.Duration
			for _, s := range stuck {
				if s.Key == key {
					stuckEnd, stuckClaimed, stuckAge = s.LeaseExpiresAt, s.ClaimedAt, s.Age
				}
			}
			if !end.Equal(lease) || !story.LeaseExpiresAt.Equal(lease) || !stuckEnd.Equal(lease) {
				t.Errorf("the lease's end: Extend %v, ReadKey %v, ReadStuck %v; the database holds %v", end, story.LeaseExpiresAt, stuckEnd, lease)
			}
			if !story.ClaimedAt.Equal(claimed) || !stuckClaimed.Equal(claimed) || !story.ExpiresAt.Equal(expires) {
				t.Errorf("ReadKey: claimed %v, expires %v; ReadStuck: claimed %v; the database holds %v, %v", story.ClaimedAt, story.ExpiresAt, stuckClaimed, claimed, expires)
			}
			if stuckAge <= 0 || stuckAge > time.Minute {
				t.Errorf("ReadStuck's age %v; want a little above 0", stuckAge)
			}
		})
	}
}

// TestClientEncodingCheckBehindPgBouncer: D232 and idem.CheckSchema's go doc: the start
// check refuses a connection whose client_encoding is not UTF8, naming the remedy
// "client_encoding=UTF8 in the connection string, a startup parameter above the role's and the
// database's settings". Behind PgBouncer (the documented DATABASE_URL form), with the
// database set to LATIN1: refused without the parameter, nothing stored; with it, a
// non-ASCII principal is stored as sent and a repeat replays.
func TestClientEncodingCheckBehindPgBouncer(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.NewDB(t)
	admin := pgtest.Connect(t, db)
	var name string
	if err := admin.QueryRow(ctx, `SELECT current_database()`).Scan(&name); err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, admin, `ALTER DATABASE "`+name+`" SET client_encoding = 'LATIN1'`)
	b := pgtest.PgBouncer(t, nil)
	via := pgtest.ThroughPgBouncer(t, db, b)

	job := idem.Job{Principal: "müller", Key: "k", Action: "a"}
	runs := 0
	fn := func(context.Context, pgx.Tx) (int, error) { runs++; return 1, nil }
	_, _, err := idem.Do(ctx, newPool(t, via), job, idem.TxOptions{}, fn)
	if err == nil || runs != 0 || !strings.Contains(err.Error(), "client_encoding is LATIN1") {
		t.Errorf("Do through PgBouncer on a LATIN1 session: %v (ran %d times); want the start check's refusal", err, runs)
	}
	utf8 := newPool(t, via+"&client_encoding=UTF8")
	for i := 0; i < 3; i++ {
		v, replayed, err := idem.Do(ctx, utf8, job, idem.TxOptions{}, fn)
		if err != nil || v != 1 || replayed != (i > 0) {
			t.Errorf("Do %d through PgBouncer with client_encoding=UTF8: %v replayed %v, %v", i+1, v, replayed, err)
		}
	}
	if runs != 1 {
		t.Errorf("the work ran %d times; want once", runs)
	}
	direct := pgtest.Connect(t, db)
	pgtest.Exec(t, direct, `SET client_encoding = 'UTF8'`)
	if n := pgtest.Count(t, direct, `SELECT count(*) FROM idem.idem_key($1, 'k') WHERE state IS NOT NULL`, "müller"); n != 1 {
		t.Errorf("a UTF8 session finds %d keys of müller; want 1", n)
	}
}

// TestEmptyAndWithheldBodiesInEveryModeAndByteaOutput: Response.Body "is the body byte for byte; nil
// when withheld" (go doc), read through anyBytea in every pgx mode with bytea_output 'escape'
// and 'hex' (D231): an empty stored body comes back empty and not nil, a withheld one nil, a
// body of every byte value and one that looks like the hex form ("\x41") byte for byte.
func TestEmptyAndWithheldBodiesInEveryModeAndByteaOutput(t *testing.T) {
	t.Parallel()
	every := make([]byte, 256)
	for i := range every {
		every[i] = byte(i)
	}
	bodies := []struct {
		name     string
		body     []byte
		withheld string
	}{
		{"empty", []byte{}, ""},
		{"withheld", nil, idem.WithheldOneTimeSecret},
		{"every", every, ""},
		{"hexlike", []byte(`\x41`), ""},
		{"backslashes", []byte(`\\\000`), ""},
	}
	for _, mode := range modesAll {
		for _, output := range []string{"escape", "hex"} {
			t.Run(strings.ReplaceAll(mode.String(), " ", "-")+"/"+output, func(t *testing.T) {
				t.Parallel()
				ctx := context.Background()
				env := modesPools(t, mode, append(append([]string{}, modesLegacy...), "bytea_output = '"+output+"'"))
				for _, b := range bodies {
					c := idem.Claim{Principal: "p", Key: "body-" + b.name, Action: "a", Fingerprint: sha256.Sum256([]byte(b.name))}
					tx, err := env.app.Begin(ctx)
					if err != nil {
						t.Fatal(err)
					}
					d, err := idem.Begin(ctx, tx, c)
					if err == nil {
						err = idem.Complete(ctx, tx, c.Principal, c.Key, d.Attempt, idem.Response{Status: 200, Body: b.body, Withheld: b.withheld})
					}
					if err == nil {
						err = tx.Commit(ctx)
					}
					_ = tx.Rollback(ctx)
					if err != nil {
						t.Fatalf("%s: claim and complete: %v", b.name, err)
					}
					tx, err = env.app.Begin(ctx)
					if err != nil {
						t.Fatal(err)
					}
					r, err := idem.Begin(ctx, tx, c)
					_ = tx.Rollback(ctx)
					if err != nil || r.Outcome != idem.Replay {
						t.Errorf("%s: the repeat: %v %v; want a replay", b.name, r.Outcome, err)
						continue
					}
					if (r.Response.Body == nil) != (b.body == nil) || !bytes.Equal(r.Response.Body, b.body) || r.Response.Withheld != b.withheld {
						t.Errorf("%s: replayed body %q (nil %v, withheld %q); want %q (nil %v, withheld %q)", b.name,
							r.Response.Body, r.Response.Body == nil, r.Response.Withheld, b.body, b.body == nil, b.withheld)
					}
				}
			})
		}
	}
}

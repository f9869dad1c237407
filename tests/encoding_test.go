package tests

// Database encodings and collations (D232). A review (helper session) installed the SQL API
// into databases a DBA may already have: LATIN1 and SQL_ASCII ones installed without a word and
// then failed valid requests (a character outside LATIN1: 500; SQL_ASCII: 503, retried
// forever; limits counted in bytes), and a Go service's principals were stored garbled; in a
// UTF8 database with an ICU collation, changed_fields and idem_key's field_names came in the
// collation's order, not sorted as the docs say. The install now refuses a database that is not
// UTF8, and both lists are sorted by code point.

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgidem/pgidem/idem/idemmigrate"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// encodingKinds are the databases of the review: CREATE DATABASE options after TEMPLATE
// template0.
var encodingKinds = []struct{ name, opts string }{
	{"utf8_c", `ENCODING 'UTF8' LC_COLLATE 'C' LC_CTYPE 'C'`},
	{"latin1_c", `ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C'`},
	{"sql_ascii", `ENCODING 'SQL_ASCII' LC_COLLATE 'C' LC_CTYPE 'C'`},
	{"utf8_c_utf8", `ENCODING 'UTF8' LC_COLLATE 'C.UTF-8' LC_CTYPE 'C.UTF-8'`},
	{"icu_und", `ENCODING 'UTF8' LOCALE_PROVIDER icu ICU_LOCALE 'und' LC_COLLATE 'C.UTF-8' LC_CTYPE 'C.UTF-8'`},
	{"icu_tr", `ENCODING 'UTF8' LOCALE_PROVIDER icu ICU_LOCALE 'tr' LC_COLLATE 'C.UTF-8' LC_CTYPE 'C.UTF-8'`},
}

func encodingOpts(t *testing.T, name string) string {
	t.Helper()
	for _, k := range encodingKinds {
		if k.name == name {
			return k.opts
		}
	}
	t.Fatalf("no kind %s", name)
	return ""
}

// encodingNewDB creates a database with opts (from template0), as the harness's superuser,
// installs the SQL API into it with idemmigrate.Migrate when install is true, and returns its
// connection string (superuser). It is dropped when the test ends.
func encodingNewDB(t *testing.T, opts string, install bool) string {
	t.Helper()
	db := pgtest.NewDatabaseWith(t, opts)
	if install {
		conn := pgtest.Connect(t, db)
		if err := idemmigrate.Migrate(context.Background(), conn, idemmigrate.Options{}); err != nil {
			t.Fatalf("idemmigrate.Migrate into a database %s: %v", opts, err)
		}
	}
	return db
}

func encodingSecret(t *testing.T, conn *pgx.Conn) []byte {
	t.Helper()
	var secrets [][]byte
	if err := conn.QueryRow(context.Background(), `SELECT idem.installation_secret_values()`).Scan(&secrets); err != nil {
		t.Fatal(err)
	}
	if len(secrets) != 1 || len(secrets[0]) != 32 {
		t.Fatalf("installation secrets: %x", secrets)
	}
	return secrets[0]
}

type encodingBegin struct {
	Outcome  string
	Attempt  int64
	Headers  *string
	Body     []byte
	Changed  []string
	Provider *string
}

func encodingClaim(ctx context.Context, q interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}, principal, key, action string, sha []byte, fields *string) (encodingBegin, error) {
	var b encodingBegin
	err := q.QueryRow(ctx, `SELECT outcome, attempt, response_headers::text, response_body, changed_fields, provider_key
		FROM idem.idem_begin(p_principal => $1, p_key => $2, p_action => $3, p_request_sha256 => $4,
		                     p_request_fields => $5::jsonb)`, principal, key, action, sha, fields).
		Scan(&b.Outcome, &b.Attempt, &b.Headers, &b.Body, &b.Changed, &b.Provider)
	return b, err
}

func encodingSHA(s string) []byte { h := sha256.Sum256([]byte(s)); return h[:] }

// encodingFields is p_request_fields for names, each with the hash of value.
func encodingFields(names []string, value string) *string {
	var b strings.Builder
	b.WriteString("{")
	for i, n := range names {
		if i > 0 {
			b.WriteString(",")
		}
		fmt.Fprintf(&b, "%q:%q", n, hex.EncodeToString(encodingSHA(n+value)))
	}
	b.WriteString("}")
	s := b.String()
	return &s
}

// TestSQLInstallAndReplayInEveryUTF8Database: in a UTF8 database of every collation, the install
// works (docs/sql-api.md "Installing") and a key whose principal, action and headers hold non-ASCII text that the
// database's encoding can hold is stored, replayed byte for byte ("the body byte for byte"),
// and its provider key is the documented formula over UTF-8 text, the same as a UTF8 database
// computes for the same secret, principal, key and generation.
func TestSQLInstallAndReplayInEveryUTF8Database(t *testing.T) {
	t.Parallel()
	for _, k := range encodingKinds {
		if !strings.Contains(k.opts, "'UTF8'") {
			continue // refused: TestSQLInstallRefusesADatabaseThatIsNotUTF8
		}
		t.Run(k.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			db := encodingNewDB(t, k.opts, true)
			conn := pgtest.Connect(t, db)
			// A SQL caller whose text is UTF-8 says so (pgx does not: its session takes the
			// database's encoding; the install refuses a database that is not UTF8).
			if k.name != "sql_ascii" {
				pgtest.Exec(t, conn, `SET client_encoding = 'UTF8'`)
			}
			secret := encodingSecret(t, conn)
			principals := []string{"alice", "prinçipal-é-ü-ÿ"}
			headerValue := "café naïve ü"
			if k.name != "latin1_c" {
				principals = append(principals, "İı-😀-日本")
				headerValue += " İı 😀"
			}
			for i, p := range principals {
				key := fmt.Sprintf("k-%d", i)
				tx, err := conn.Begin(ctx)
				if err != nil {
					t.Fatal(err)
				}
				c, err := encodingClaim(ctx, tx, p, key, "POST /café", encodingSHA("r"), nil)
				if err != nil || c.Outcome != "claimed" {
					t.Fatalf("claim %q: %+v %v", p, c, err)
				}
				want := providerKeyFormula(secret, p, key, c.Attempt)
				if c.Provider == nil {
					t.Fatalf("no provider key")
				}
				if *c.Provider != want {
					t.Errorf("%s: principal %q: provider key %s, the documented formula over UTF-8 gives %s", k.name, p, *c.Provider, want)
				}
				body := []byte("\x00\xff\xe9 body é")
				pgtest.Exec(t, tx, `SELECT idem.idem_complete(p_principal => $1, p_key => $2, p_attempt => $3, p_status => 201,
					p_headers => $4::jsonb, p_body => $5)`, p, key, c.Attempt, `{"X-Note":"`+headerValue+`"}`, body)
				if err := tx.Commit(ctx); err != nil {
					t.Fatal(err)
				}
				r, err := encodingClaim(ctx, conn, p, key, "POST /café", encodingSHA("r"), nil)
				if err != nil || r.Outcome != "replay" {
					t.Fatalf("replay %q: %+v %v", p, r, err)
				}
				if string(r.Body) != string(body) || r.Headers == nil || !strings.Contains(*r.Headers, headerValue) || *r.Provider != want {
					t.Errorf("%s: replay of %q: body %q headers %s provider %s; want body %q, header %q, provider %s",
						k.name, p, r.Body, *r.Headers, *r.Provider, body, headerValue, want)
				}
			}
		})
	}
}

// TestSQLChangedFieldsSortedByCodePoint: docs/sql-api.md, idem_begin's columns:
// "`changed_fields` | mismatch | sorted names of top-level fields whose hashes differ", and go
// doc idem.Decision.ChangedFields: "sorted". The same two requests under one key should name
// the same fields in the same order in every installation; a Go caller reads "sorted" as
// sort.Strings's order (bytes, which is also RFC 8785's for these names). In a database whose
// default collation is not C, the list comes in that collation's order.
func TestSQLChangedFieldsSortedByCodePoint(t *testing.T) {
	t.Parallel()
	names := []string{"b", "B", "a", "_x", "i", "I", "İ", "ı", "é", "Z", "10", "9"}
	var ref []string
	for _, kind := range []string{"utf8_c", "icu_und", "icu_tr"} {
		db := encodingNewDB(t, encodingOpts(t, kind), true)
		conn := pgtest.Connect(t, db)
		ctx := context.Background()
		tx, err := conn.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		c, err := encodingClaim(ctx, tx, "alice", "k1", "POST /x", encodingSHA("one"), encodingFields(names, "one"))
		if err != nil || c.Outcome != "claimed" {
			t.Fatalf("%s: claim: %+v %v", kind, c, err)
		}
		pgtest.Exec(t, tx, `SELECT idem.idem_complete('alice', 'k1', $1, 201, '{}', NULL)`, c.Attempt)
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		m, err := encodingClaim(ctx, conn, "alice", "k1", "POST /x", encodingSHA("two"), encodingFields(names, "two"))
		if err != nil || m.Outcome != "mismatch" {
			t.Fatalf("%s: mismatch: %+v %v", kind, m, err)
		}
		if len(m.Changed) != len(names) {
			t.Fatalf("%s: changed_fields %q", kind, m.Changed)
		}
		if !slices.IsSorted(m.Changed) {
			t.Errorf("%s: changed_fields %q is not sorted (bytes, as sort.Strings sorts)", kind, m.Changed)
		}
		if ref == nil {
			ref = m.Changed
		} else if !slices.Equal(ref, m.Changed) {
			t.Errorf("%s: changed_fields %q; the same requests in a UTF8/C database: %q", kind, m.Changed, ref)
		}
		var keyNames []string
		if err := conn.QueryRow(ctx, `SELECT field_names FROM idem.idem_key(p_principal => 'alice', p_key => 'k1')`).Scan(&keyNames); err != nil {
			t.Fatal(err)
		}
		if !slices.IsSorted(keyNames) {
			t.Errorf("%s: idem_key's field_names %q not sorted as bytes", kind, keyNames)
		}
	}
}

// TestSQLInstallRefusesADatabaseThatIsNotUTF8: idemmigrate.Migrate and sql/idem.sql refuse a
// LATIN1 and a SQL_ASCII database with 55000, naming the encoding, before they change anything
// (D232): no schema idem is left behind.
func TestSQLInstallRefusesADatabaseThatIsNotUTF8(t *testing.T) {
	t.Parallel()
	for _, kind := range []string{"latin1_c", "sql_ascii"} {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			db := encodingNewDB(t, encodingOpts(t, kind), false)
			conn := pgtest.Connect(t, db)
			err := idemmigrate.Migrate(ctx, conn, idemmigrate.Options{})
			var pgErr *pgconn.PgError
			if !errors.As(err, &pgErr) || pgErr.Code != "55000" || !strings.Contains(err.Error(), "needs a UTF8 database") ||
				!strings.Contains(err.Error(), "ENCODING 'UTF8'") {
				t.Errorf("idemmigrate.Migrate into a %s database: %v; want 55000 naming UTF8, with the hint", kind, err)
			}
			out, err := psqlCommand(t, db, "-X", "-v", "ON_ERROR_STOP=1", "-f", "../sql/idem.sql").CombinedOutput()
			if err == nil || !strings.Contains(string(out), "needs a UTF8 database") {
				t.Errorf("psql -f sql/idem.sql into a %s database: %v\n%s\nwant the refusal", kind, err, out)
			}
			var schema bool
			if err := conn.QueryRow(ctx, `SELECT to_regnamespace('idem') IS NOT NULL`).Scan(&schema); err != nil || schema {
				t.Errorf("schema idem after the refusals: %v %v; want none", schema, err)
			}
		})
	}
}

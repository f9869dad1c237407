package idem_test

// Database encodings (D232): the Go library against UTF8 databases of two collations, installed
// with idemmigrate.Migrate as docs/sql-api.md "Installing" says, through a pool made from the
// database's plain connection string. A review (helper session) wrote these tests.

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net/http"
	"strconv"
	"sync/atomic"
	"testing"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/idem/idemmigrate"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// encodingNewDB creates a database TEMPLATE template0 with opts as the harness's superuser,
// installs the SQL API with idemmigrate.Migrate, and returns its connection string.
func encodingNewDB(t *testing.T, opts string) string {
	t.Helper()
	db := pgtest.NewDatabaseWith(t, opts)
	conn := pgtest.Connect(t, db)
	if err := idemmigrate.Migrate(context.Background(), conn, idemmigrate.Options{}); err != nil {
		t.Fatalf("idemmigrate.Migrate into a database %s: %v", opts, err)
	}
	return db
}

// encodingProviderKey is docs/sql-api.md's formula: "the SHA-256 of the label `pgidem provider
// key v3`, the installation's secret, the principal, the key and the generation's number in
// decimal, in UTF-8, separated by NUL bytes".
func encodingProviderKey(secret []byte, principal, key string, gen int64) string {
	h := sha256.New()
	h.Write([]byte("pgidem provider key v3\x00"))
	h.Write(secret)
	h.Write([]byte("\x00" + principal + "\x00" + key + "\x00" + strconv.FormatInt(gen, 10)))
	return hex.EncodeToString(h.Sum(nil))
}

const (
	encodingUTF8 = `ENCODING 'UTF8' LC_COLLATE 'C' LC_CTYPE 'C'`
	encodingICU  = `ENCODING 'UTF8' LOCALE_PROVIDER icu ICU_LOCALE 'tr' LC_COLLATE 'C.UTF-8' LC_CTYPE 'C.UTF-8'`
)

// TestMiddlewareProviderKeyOfANonASCIIPrincipal: the middleware, principal "müller" (a review
// found it stored garbled in a LATIN1 database, which the install now refuses, D232). docs/sql-api.md: the provider key
// is the SHA-256 of "... the principal, the key and the generation's number in decimal, in
// UTF-8"; README: "Services in other languages and DBAs call the same functions from SQL". The
// key the Go service claimed should be the key an operator's or another service's SQL session
// (client_encoding UTF8, as psql on a UTF-8 terminal or JDBC sets it) finds under "müller", and
// the handler's ProviderKey the documented one. In a UTF8 database with the C collation and with an ICU one.
func TestMiddlewareProviderKeyOfANonASCIIPrincipal(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ name, opts string }{{"utf8", encodingUTF8}, {"icu", encodingICU}} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			db := encodingNewDB(t, c.opts)
			var secret [][]byte
			if err := pgtest.Connect(t, db).QueryRow(ctx, `SELECT idem.installation_secret_values()`).Scan(&secret); err != nil {
				t.Fatal(err)
			}
			const principal = "müller"
			var info idem.ClaimInfo
			srv, _ := auditServer(t, idem.Options{DB: newPool(t, db), Principal: func(*http.Request) (string, bool) { return principal, true }},
				idem.Route{}, func(w http.ResponseWriter, r *http.Request) {
					info, _ = idem.ClaimOf(r.Context())
					w.WriteHeader(http.StatusCreated)
				})
			if s, _, b := auditPost(t, srv.URL, "k1", `{"a":1}`); s != 201 {
				t.Fatalf("first: %d %s", s, b)
			}
			want := encodingProviderKey(secret[0], principal, "k1", info.Attempt)
			if info.ProviderKey != want {
				t.Errorf("%s: ProviderKey %s; the documented formula over the principal in UTF-8 gives %s", c.name, info.ProviderKey, want)
			}
			sql := pgtest.Connect(t, db)
			pgtest.Exec(t, sql, `SET client_encoding = 'UTF8'`)
			if n := pgtest.Count(t, sql, `SELECT count(*) FROM idem.idem_key(p_principal => $1, p_key => 'k1') WHERE state IS NOT NULL`, principal); n != 1 {
				var stored string
				_ = sql.QueryRow(ctx, `SELECT principal_id FROM idem.idempotency_keys LIMIT 1`).Scan(&stored)
				t.Errorf("%s: a SQL session in UTF8 finds %d keys of %q with idem_key; the key table holds principal %q", c.name, n, principal, stored)
			}
		})
	}
}

// TestLineSeparatorInAHeaderAndAFieldName: docs/http.md ("repeat, same request | the stored status, headers
// and body, byte for byte"; X-Title is in Options.StoredHeaders) and docs/sql-api.md "Stored headers" ("A line of UTF-8 text, the
// usual case, is stored as it is"). A response header whose value holds U+2028 (valid UTF-8;
// encoding/json writes it as the escape \u2028), and a JSON body with a member named "a\u2028b"
// (its field hashes go to p_request_fields the same way): served and replayed in a UTF8
// database (in LATIN1 and SQL_ASCII ones, which the install now refuses, they failed with 500
// and 503, D232).
func TestLineSeparatorInAHeaderAndAFieldName(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ name, opts string }{{"utf8", encodingUTF8}, {"icu", encodingICU}} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			db := encodingNewDB(t, c.opts)
			var runs atomic.Int32
			srv, _ := auditServer(t, idem.Options{DB: newPool(t, db), StoredHeaders: []string{"Content-Type", "X-Title"}}, idem.Route{}, func(w http.ResponseWriter, r *http.Request) {
				runs.Add(1)
				if r.Header.Get("X-Case") == "header" {
					w.Header().Set("X-Title", "chapter\u2028one")
				}
				w.WriteHeader(http.StatusCreated)
				fmt.Fprint(w, `{"ok":true}`)
			})
			for _, k := range []struct{ key, body, which string }{
				{"ls-header", `{"a":1}`, "header"},
				{"ls-field", `{"a\u2028b":1}`, "field"},
			} {
				runs.Store(0)
				s1, h1, b1 := auditPost(t, srv.URL, k.key, k.body, "X-Case", k.which)
				s2, h2, b2 := auditPost(t, srv.URL, k.key, k.body, "X-Case", k.which)
				if s1 != 201 || s2 != 201 || h2.Get("Idempotent-Replayed") != "true" || h1.Get("X-Title") != h2.Get("X-Title") || runs.Load() != 1 {
					t.Errorf("%s: %s with U+2028: first %d %q (X-Title %q), repeat %d %q (X-Title %q, replayed %q), handler ran %d times; want 201 and its replay",
						c.name, k.which, s1, auditCode(b1), h1.Get("X-Title"), s2, auditCode(b2), h2.Get("X-Title"), h2.Get("Idempotent-Replayed"), runs.Load())
				}
			}
		})
	}
}

package idemhttp

import (
	"context"
	"errors"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgidem/pgidem/internal/pgtest"
)

func TestParseKey(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		in             []string
		key            string
		present, valid bool
	}{
		{nil, "", false, false},
		{[]string{"k1"}, "k1", true, true},
		{[]string{`"k1"`}, "k1", true, true},
		{[]string{`"a\"b\\c"`}, `a"b\c`, true, true},
		{[]string{`""`}, "", true, false},
		{[]string{`"a b"`}, "", true, false},
		{[]string{`"ab`}, "", true, false},
		{[]string{`"a\qb"`}, "", true, false},
		{[]string{"a", "b"}, "", true, false},
		{[]string{strings.Repeat("k", 255)}, strings.Repeat("k", 255), true, true},
		{[]string{strings.Repeat("k", 256)}, "", true, false},
		{[]string{"clé"}, "", true, false},
	} {
		key, present, valid := parseKey(c.in)
		if key != c.key || present != c.present || valid != c.valid {
			t.Errorf("parseKey(%q) = %q, %v, %v; want %q, %v, %v", c.in, key, present, valid, c.key, c.present, c.valid)
		}
	}
}

// FuzzParseKey: parseKey never panics, and the key rule it applies (validKey) is the SQL
// API's own: for every string, Go accepts it exactly when idem_release does (which refuses
// a bad key with 22023 before looking for any row).
func FuzzParseKey(f *testing.F) {
	for _, s := range []string{"k1", `"k1"`, `"a\"b"`, `""`, "\x00", `"\`, strings.Repeat("x", 300), strings.Repeat("y", 255),
		"a b", "clé", "\x7f", "~!", "\xff\xfe"} {
		f.Add(s)
	}
	pool, _ := pgtest.NewPool(f, 2)
	f.Fuzz(func(t *testing.T, v string) {
		key, present, valid := parseKey([]string{v})
		if !present || (valid && key == "") || (!valid && key != "") {
			t.Fatalf("parseKey(%q) = %q, %v, %v", v, key, present, valid)
		}
		var released bool
		err := pool.QueryRow(context.Background(), `SELECT idem.idem_release('p', $1, 1)`, v).Scan(&released)
		var pgErr *pgconn.PgError
		sqlValid := err == nil
		if err != nil && !(errors.As(err, &pgErr) && strings.HasPrefix(pgErr.Code, "22")) && utf8.ValidString(v) && !strings.ContainsRune(v, 0) {
			t.Fatalf("idem_release(%q): %v", v, err)
		}
		if validKey(v) != sqlValid {
			t.Fatalf("key %q: Go says valid=%v, the SQL API says %v (%v)", v, validKey(v), sqlValid, err)
		}
	})
}

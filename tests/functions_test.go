package tests

import (
	"context"
	"regexp"
	"strings"
	"testing"

	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestNoVolatileCallsInKeyTableWrites: every statement of the API functions that writes the
// key table (INSERT INTO, UPDATE, DELETE FROM idem.idempotency_keys) calls only IMMUTABLE
// functions and does no arithmetic: every time value and anything else not immutable is
// computed into a variable before the statement. Citus refuses a VOLATILE function in an
// UPDATE, and anything but an IMMUTABLE one in INSERT ... ON CONFLICT DO UPDATE SET, on a
// distributed table (docs/scale-out.md); timestamptz + interval is STABLE, hence no
// arithmetic. The functions' sources are read back from pg_catalog.
func TestNoVolatileCallsInKeyTableWrites(t *testing.T) {
	t.Parallel()
	conn := pgtest.Connect(t, pgtest.NewDB(t))
	ctx := context.Background()
	rows, err := conn.Query(ctx, `SELECT p.oid::regprocedure::text, p.prosrc FROM pg_proc p
		WHERE p.pronamespace = 'idem'::regnamespace AND p.prolang = (SELECT oid FROM pg_language WHERE lanname = 'plpgsql')`)
	if err != nil {
		t.Fatal(err)
	}
	sources := map[string]string{}
	for rows.Next() {
		var name, src string
		if err := rows.Scan(&name, &src); err != nil {
			t.Fatal(err)
		}
		sources[name] = src
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if len(sources) < 5 {
		t.Fatalf("only %d PL/pgSQL functions in schema idem", len(sources))
	}
	write := regexp.MustCompile(`(?is)\b(INSERT\s+INTO|UPDATE|DELETE\s+FROM)\s+idem\.idempotency_keys\b[^;]*;`)
	call := regexp.MustCompile(`(?i)\b([a-z_][a-z0-9_]*)\s*\(`)
	notFunctions := map[string]bool{"values": true, "in": true, "any": true, "array": true, "coalesce": true,
		"greatest": true, "least": true, "nullif": true, "exists": true, "keys": true, "k": true}
	checked := 0
	for name, src := range sources {
		for _, stmt := range write.FindAllString(stripComments(src), -1) {
			checked++
			if strings.ContainsAny(stmt, "+") || regexp.MustCompile(`[^-]-[^-]`).MatchString(stripStrings(stmt)) {
				t.Errorf("%s: arithmetic in a statement that writes the key table:\n%s", name, stmt)
			}
			for _, m := range call.FindAllStringSubmatch(stripStrings(stmt), -1) {
				fn := strings.ToLower(m[1])
				if notFunctions[fn] || strings.HasPrefix(fn, "idempotency_keys") {
					continue
				}
				var volatile int
				if err := conn.QueryRow(ctx, `SELECT count(*) FROM pg_proc WHERE lower(proname) = $1 AND provolatile <> 'i'`, fn).Scan(&volatile); err != nil {
					t.Fatal(err)
				}
				if volatile > 0 {
					t.Errorf("%s: %s() is not IMMUTABLE, inside a statement that writes the key table:\n%s", name, fn, stmt)
				}
			}
		}
	}
	if checked < 6 {
		t.Fatalf("found only %d statements that write the key table; the pattern no longer matches the sources", checked)
	}
}

func stripComments(s string) string { return regexp.MustCompile(`--[^\n]*`).ReplaceAllString(s, "") }

func stripStrings(s string) string { return regexp.MustCompile(`'[^']*'`).ReplaceAllString(s, "''") }

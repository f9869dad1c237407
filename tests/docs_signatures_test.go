package tests

import (
	"context"
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/pgidem/pgidem/internal/pgtest"
)

// docSignature is one function or procedure signature shown in a ```sql block of
// docs/sql-api.md: "idem.NAME(params) RETURNS result" or "CALL idem.NAME(params)".
type docSignature struct {
	line int    // the block's line in the doc
	proc bool   // CALL: a procedure
	name string // without the schema
	text string // the signature, on one line, without comments
}

// docSignatures returns every signature docs/sql-api.md shows: the lines of its sql blocks
// that start with "idem.idem_" or "CALL idem." and are not statements (no closing ";").
func docSignatures(t *testing.T) []docSignature {
	t.Helper()
	raw, err := os.ReadFile("../docs/sql-api.md")
	if err != nil {
		t.Fatal(err)
	}
	doc := string(raw)
	start := regexp.MustCompile(`^(CALL )?idem\.(\w+)\(`)
	var out []docSignature
	for _, m := range regexp.MustCompile("(?s)```sql\n(.*?)```").FindAllStringSubmatchIndex(doc, -1) {
		block := regexp.MustCompile(`--[^\n]*`).ReplaceAllString(doc[m[2]:m[3]], "")
		if !start.MatchString(strings.TrimSpace(block)) {
			continue
		}
		line := strings.Count(doc[:m[0]], "\n") + 1
		// Split before each line that starts a signature.
		var sigs []string
		for _, l := range strings.Split(strings.TrimSpace(block), "\n") {
			if start.MatchString(l) || len(sigs) == 0 {
				sigs = append(sigs, l)
			} else {
				sigs[len(sigs)-1] += " " + l
			}
		}
		for _, s := range sigs {
			s = strings.Join(strings.Fields(s), " ")
			if strings.HasSuffix(s, ";") {
				continue // a statement to run, not a signature
			}
			sm := start.FindStringSubmatch(s)
			out = append(out, docSignature{line: line, proc: sm[1] != "", name: sm[2], text: strings.TrimPrefix(s, "CALL ")})
		}
	}
	return out
}

// TestSQLAPISignaturesMatchTheCatalog (docs/sql-api.md): every signature the SQL API's page
// shows is the installed one: each parameter's name, mode, type and default, in order, and
// what the function returns (its result type, and its OUT or TABLE columns). Each documented
// signature is created in a scratch schema and read back through the catalog beside the real
// function's, so "timestamptz" and "timestamp with time zone", '24 hours' and
// '24:00:00'::interval compare equal. Only the generated catalog block and three defaults were
// checked before; a parameter renamed or a default changed in the functions, and not on the
// page, fails here.
func TestSQLAPISignaturesMatchTheCatalog(t *testing.T) {
	t.Parallel()
	sigs := docSignatures(t)
	if len(sigs) < 20 {
		t.Fatalf("found %d signatures in docs/sql-api.md, want the SQL API's (at least 20): the parser lost them", len(sigs))
	}
	ctx := context.Background()
	db := pgtest.Connect(t, pgtest.NewDB(t))
	pgtest.Exec(t, db, `CREATE SCHEMA doc_sig`)
	// What a routine is, read from the catalog: its kind, each parameter (mode with TABLE
	// columns counted as OUT, name, type, default) and its result type.
	const shape = `
SELECT p.prokind::text,
       coalesce((SELECT string_agg(format('%s %s %s%s',
                   CASE a.m WHEN 't' THEN 'o' ELSE a.m::text END, a.n, a.ty::regtype,
                   coalesce(' DEFAULT ' || pg_get_function_arg_default(p.oid, a.o::int), '')), ', ' ORDER BY a.o)
                 FROM unnest(coalesce(p.proallargtypes, p.proargtypes::oid[]),
                             coalesce(p.proargmodes, array_fill('i'::"char", ARRAY[cardinality(p.proargtypes::oid[])])),
                             p.proargnames) WITH ORDINALITY AS a(ty, m, n, o)), ''),
       p.prorettype::regtype::text
  FROM pg_proc p WHERE p.oid = $1`
	type routine struct{ kind, params, result string }
	read := func(oid uint32) routine {
		t.Helper()
		var r routine
		if err := db.QueryRow(ctx, shape, oid).Scan(&r.kind, &r.params, &r.result); err != nil {
			t.Fatalf("reading routine %d: %v", oid, err)
		}
		return r
	}
	seen := map[string]bool{}
	for _, s := range sigs {
		seen[s.name] = true
		decl := "doc_sig." + strings.TrimPrefix(s.text, "idem.")
		var create string
		switch {
		case s.proc:
			create = `CREATE PROCEDURE ` + decl + ` LANGUAGE plpgsql AS 'BEGIN END'`
		case strings.Contains(s.text, "RETURNS TABLE") || strings.HasSuffix(s.text, "RETURNS void"):
			create = `CREATE FUNCTION ` + decl + ` LANGUAGE plpgsql AS 'BEGIN RETURN; END'`
		default:
			create = `CREATE FUNCTION ` + decl + ` LANGUAGE plpgsql AS 'BEGIN RETURN NULL; END'`
		}
		if _, err := db.Exec(ctx, create); err != nil {
			t.Errorf("docs/sql-api.md:%d: the signature of %s is not valid SQL: %v\n%s", s.line, s.name, err, s.text)
			continue
		}
		var docOID uint32
		if err := db.QueryRow(ctx, `SELECT p.oid FROM pg_proc p WHERE p.pronamespace = 'doc_sig'::regnamespace AND p.proname = $1`, s.name).Scan(&docOID); err != nil {
			t.Fatalf("%s in the scratch schema: %v", s.name, err)
		}
		want := read(docOID)
		var sig string
		if err := db.QueryRow(ctx, `SELECT $1::oid::regprocedure::text`, docOID).Scan(&sig); err != nil {
			t.Fatal(err)
		}
		defer pgtest.Exec(t, db, `DROP ROUTINE `+sig)
		// The installed routine with the same input types (an overload would differ in them).
		var realOID uint32
		err := db.QueryRow(ctx, `SELECT p.oid FROM pg_proc p WHERE p.pronamespace = 'idem'::regnamespace AND p.proname = $1
			AND p.proargtypes = (SELECT d.proargtypes FROM pg_proc d WHERE d.oid = $2)`, s.name, docOID).Scan(&realOID)
		if err != nil {
			var installed []string
			rows, _ := db.Query(ctx, `SELECT pg_get_function_arguments(p.oid) FROM pg_proc p
				WHERE p.pronamespace = 'idem'::regnamespace AND p.proname = $1`, s.name)
			for rows.Next() {
				var a string
				_ = rows.Scan(&a)
				installed = append(installed, "("+a+")")
			}
			t.Errorf("docs/sql-api.md:%d: no installed idem.%s takes the documented arguments (installed: %s)\n%s",
				s.line, s.name, strings.Join(installed, "; "), s.text)
			continue
		}
		if got := read(realOID); got != want {
			t.Errorf("docs/sql-api.md:%d: idem.%s as documented and as installed differ\n doc:       %s %s -> %s\n installed: %s %s -> %s",
				s.line, s.name, want.kind, want.params, want.result, got.kind, got.params, got.result)
		}
	}
	// The contract's five functions are on the page.
	for _, name := range []string{"idem_begin", "idem_complete", "idem_save_final", "idem_release", "idem_cleanup"} {
		if !seen[name] {
			t.Errorf("docs/sql-api.md shows no signature of idem.%s", name)
		}
	}
}

package tests

import (
	"io/fs"
	"regexp"
	"strings"
	"testing"

	idemsql "github.com/pgidem/pgidem/sql"
)

// The rule of docs/operations.md ("Upgrades"): a migration runs while the previous release
// serves, so no step of it may hold, for a time that grows with the key table, a lock that the
// functions wait on. Expand and contract: add what is new (a nullable column, an index built
// CONCURRENTLY, a constraint NOT VALID), fill it in batches outside the migration's
// transaction, switch in a short lock, drop the old later.
//
// blocking lists the statements that break it on idem.idempotency_keys: each takes a lock that
// blocks claims (SHARE or stronger) and reads or rewrites the whole table under it, or writes
// every row in the migration's one transaction.
var blocking = []struct {
	re     *regexp.Regexp
	unless func(code string) bool
	why    string
}{
	// (The text is normalized first: quotes dropped, the schema made explicit; see keysRef.)
	{regexp.MustCompile(`(?is)\bCREATE\s+(UNIQUE\s+)?INDEX\b[^;]*?\bON\s+(ONLY\s+)?` + keysRef), concurrently,
		"builds an index under a SHARE lock (use CREATE INDEX CONCURRENTLY, outside the transaction)"},
	{regexp.MustCompile(`(?is)\bALTER\s+TABLE\s+(ONLY\s+)?(IF\s+EXISTS\s+)?` + keysRef + `[^;]*\b(TYPE|SET\s+(LOGGED|UNLOGGED|TABLESPACE)|PRIMARY\s+KEY|UNIQUE|EXCLUDE|NOT\s+NULL|DEFAULT|GENERATED|SERIAL|BIGSERIAL|SMALLSERIAL|SERIAL[248])\b`), nil,
		"rewrites or scans the table under its ACCESS EXCLUSIVE lock"},
	{regexp.MustCompile(`(?is)\bALTER\s+TABLE\s+(ONLY\s+)?(IF\s+EXISTS\s+)?` + keysRef + `[^;]*\b(CHECK|FOREIGN\s+KEY)\b`), allNotValid,
		"validates a constraint by scanning the table under a lock (add it NOT VALID, VALIDATE it later)"},
	{regexp.MustCompile(`(?is)\b(CLUSTER|VACUUM\s+FULL)\b[^;]*` + keysRef), nil,
		"rewrites the table or its indexes under an exclusive lock"},
	{regexp.MustCompile(`(?is)\bREINDEX\b[^;]*\bidem\.idempotency_keys`), concurrently,
		"rebuilds an index of the table under a lock that blocks claims (use REINDEX ... CONCURRENTLY)"},
	{regexp.MustCompile(`(?is)\bFROM\s+(ONLY\s+)?` + keysRef), nil,
		"reads the whole table in the migration's transaction"},
	{regexp.MustCompile(`(?is)\b(UPDATE|DELETE\s+FROM)\s+(ONLY\s+)?` + keysRef), nil,
		"writes every row in the migration's transaction, holding their locks to its end"},
	{regexp.MustCompile(`(?is)\bLOCK\s+(TABLE\s+)?(ONLY\s+)?` + keysRef), nil,
		"locks the table"},
	{regexp.MustCompile(`(?is)\bEXECUTE\b`), triggerOnly,
		"runs SQL built at run time, which no check can read (justify it)"},
}

// keysRef matches a reference to the key table in normalized text: idem.idempotency_keys,
// not a table whose name only starts so (idempotency_keys_v3).
const keysRef = `idem\.idempotency_keys\b(?:[^_]|$)`

// normalize makes the ways of naming the key table one: quotes go, and where a migration sets
// its search_path to idem, a bare idempotency_keys is idem.idempotency_keys.
func normalize(sql string) string {
	sql = strings.ReplaceAll(sql, `"`, "")
	if regexp.MustCompile(`(?is)\bsearch_path\b[^;]*\bidem\b`).MatchString(sql) {
		sql = regexp.MustCompile(`(?i)(^|[^.\w])idempotency_keys\b`).ReplaceAllString(sql, "${1}idem.idempotency_keys")
	}
	return sql
}

// concurrently: the statement runs CONCURRENTLY (outside a transaction; it does not block claims).
func concurrently(code string) bool {
	return regexp.MustCompile(`(?is)\b(INDEX|REINDEX)\s+(\(\s*[^)]*\)\s*)?(INDEX\s+|TABLE\s+)?CONCURRENTLY\b`).MatchString(code)
}

// triggerOnly: every EXECUTE of the statement is a trigger's EXECUTE FUNCTION (or PROCEDURE),
// not dynamic SQL.
func triggerOnly(code string) bool {
	return len(regexp.MustCompile(`(?is)\bEXECUTE\b`).FindAllString(code, -1)) ==
		len(regexp.MustCompile(`(?is)\bEXECUTE\s+(FUNCTION|PROCEDURE)\b`).FindAllString(code, -1))
}

// allNotValid: every constraint the statement adds is added NOT VALID.
func allNotValid(code string) bool {
	added := len(regexp.MustCompile(`(?is)\b(CHECK|FOREIGN\s+KEY)\b`).FindAllString(code, -1))
	return added > 0 && added == len(regexp.MustCompile(`(?is)\bNOT\s+VALID\b`).FindAllString(code, -1))
}

// createsKeys matches the migration that creates the key table (0.1.0's 001).
var createsKeys = regexp.MustCompile(`(?i)\bCREATE\s+TABLE\s+idem\.idempotency_keys\s*\(`)

// justified is the marker of a statement that breaks the letter of the rule but not its aim:
// a comment line "-- online: why" right above the statement (or the block it is in), whose
// text holds no semicolon (statements are split at them).
var justified = regexp.MustCompile(`(?m)^\s*-- online: \S`)

// blockingSteps returns, for each statement of a migration that breaks the rule without a
// justification, why.
func blockingSteps(sql string) []string {
	sql, _, _ = strings.Cut(sql, "---- create above / drop below ----")
	if createsKeys.MatchString(sql) {
		return nil // the table is new, and empty, in this migration
	}
	sql = normalize(sql)
	var out []string
	// Statements end at a semicolon; a DO block's body is cut into pieces too, which is what
	// the check wants: each piece is looked at with the comments right above it.
	pieces := strings.Split(sql, ";")
	for i, piece := range pieces {
		code := regexp.MustCompile(`--[^\n]*`).ReplaceAllString(piece, "")
		for _, b := range blocking {
			if !b.re.MatchString(code) || (b.unless != nil && b.unless(code)) {
				continue
			}
			context := piece
			if i > 0 {
				prev := pieces[i-1]
				if j := strings.LastIndex(prev, "\n"); j >= 0 {
					context = prev[j:] + piece
				}
			}
			if !justified.MatchString(context) && !justified.MatchString(blockComment(pieces, i)) {
				out = append(out, b.why+": "+strings.TrimSpace(strings.SplitN(strings.TrimSpace(code), "\n", 2)[0]))
			}
			break
		}
	}
	return out
}

// blockComment is the comment right above the DO block (or statement) that piece i belongs
// to: the comment lines at the end of the text before the block's start.
func blockComment(pieces []string, i int) string {
	// Walk back to the piece that opens the enclosing DO block, if any.
	for j := i; j >= 0; j-- {
		if k := strings.Index(pieces[j], "DO $$"); k >= 0 {
			return pieces[j][:k]
		}
		if j < i && strings.Contains(pieces[j], "$$") {
			break // the end of an earlier block: piece i is in none
		}
	}
	return pieces[i]
}

// TestKeyTableMigrationsStayOnline checks every migration against the rule, and the check
// against migrations that break it.
func TestKeyTableMigrationsStayOnline(t *testing.T) {
	t.Parallel()
	checked := 0
	err := fs.WalkDir(idemsql.Migrations(), ".", func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		b, err := fs.ReadFile(idemsql.Migrations(), path)
		if err != nil {
			return err
		}
		for _, why := range blockingSteps(string(b)) {
			t.Errorf("%s %s", path, why)
		}
		checked++
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if checked < 5 {
		t.Fatalf("%d migrations checked", checked)
	}
	for _, bad := range []string{
		"CREATE INDEX note_idx ON idem.idempotency_keys (note);",
		"ALTER TABLE idem.idempotency_keys ALTER COLUMN attempt TYPE numeric;",
		"ALTER TABLE idem.idempotency_keys ADD COLUMN note text NOT NULL DEFAULT 'x';",
		"ALTER TABLE idem.idempotency_keys ADD CONSTRAINT c CHECK (attempt > 0);",
		"UPDATE idem.idempotency_keys SET note = 'x';",
		"CREATE TABLE idem.k2 (LIKE idem.idempotency_keys);\nINSERT INTO idem.k2 SELECT * FROM idem.idempotency_keys;",
		"LOCK TABLE idem.idempotency_keys IN ACCESS EXCLUSIVE MODE;\nDROP TABLE idem.idempotency_keys;",
		"DO $$\nBEGIN\n    CREATE INDEX x ON idem.idempotency_keys (note);\nEND\n$$;",
	} {
		if len(blockingSteps(bad)) == 0 {
			t.Errorf("the check passed a migration that blocks the functions for as long as the table is big:\n%s", bad)
		}
	}
	for _, good := range []string{
		"ALTER TABLE idem.idempotency_keys ADD COLUMN note text;",
		"ALTER TABLE idem.idempotency_keys ADD CONSTRAINT c CHECK (attempt > 0) NOT VALID;",
		"-- online: the swap of a table copied beforehand: the lock lasts milliseconds\nLOCK TABLE idem.idempotency_keys IN ACCESS EXCLUSIVE MODE;",
	} {
		if why := blockingSteps(good); len(why) != 0 {
			t.Errorf("the check refused a migration that keeps the table online: %v\n%s", why, good)
		}
	}
}

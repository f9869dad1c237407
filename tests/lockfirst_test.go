package tests

import (
	"io/fs"
	"regexp"
	"strconv"
	"strings"
	"testing"

	idemsql "github.com/pgidem/pgidem/sql"
)

// rewritesKeys matches a statement that copies, replaces or rewrites the key table: an INSERT
// that reads it, a DROP or TRUNCATE of it, or an ALTER that changes a column's type or the
// table's name, persistence or tablespace.
var rewritesKeys = regexp.MustCompile(`(?is)^(INSERT\s+INTO\b.*\bFROM\s+idem\.idempotency_keys\b|` +
	`DROP\s+TABLE\b.*\bidem\.idempotency_keys\b|TRUNCATE\b.*\bidem\.idempotency_keys\b|` +
	`ALTER\s+TABLE\s+(ONLY\s+)?idem\.idempotency_keys\b.*\b(TYPE|RENAME\s+TO|SET\s+(LOGGED|UNLOGGED|TABLESPACE))\b)`)

var lockKeys = regexp.MustCompile(`(?is)^LOCK\s+TABLE\s+idem\.idempotency_keys\s+IN\s+ACCESS\s+EXCLUSIVE\s+MODE$`)

// lockFirst returns why a migration breaks the rule of docs/operations.md ("Upgrades"): one
// that rewrites the key table must lock it first, so that the servers of the previous
// release, still serving, cannot commit keys into a table that is being replaced.
func lockFirst(sql string) string {
	sql, _, _ = strings.Cut(sql, "---- create above / drop below ----")
	sql = regexp.MustCompile(`--[^\n]*`).ReplaceAllString(sql, "")
	var stmts []string
	for _, s := range strings.Split(sql, ";") {
		if s = strings.TrimSpace(s); s != "" {
			stmts = append(stmts, s)
		}
	}
	for i, s := range stmts {
		if rewritesKeys.MatchString(s) && !lockKeys.MatchString(stmts[0]) {
			return "statement " + strconv.Itoa(i+1) + " rewrites idem.idempotency_keys, and the first statement is not " +
				"LOCK TABLE idem.idempotency_keys IN ACCESS EXCLUSIVE MODE: " + strings.SplitN(s, "\n", 2)[0]
		}
	}
	return ""
}

// TestKeyTableRewritesLockFirst checks every migration against the rule, and the rule against
// a migration that breaks it.
func TestKeyTableRewritesLockFirst(t *testing.T) {
	t.Parallel()
	rewriting := 0
	err := fs.WalkDir(idemsql.Migrations(), ".", func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		b, err := fs.ReadFile(idemsql.Migrations(), path)
		if err != nil {
			return err
		}
		if why := lockFirst(string(b)); why != "" {
			t.Errorf("%s: %s", path, why)
		}
		if strings.Contains(string(b), "LOCK TABLE idem.idempotency_keys") {
			rewriting++
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if rewriting == 0 {
		t.Fatal("no migration locks the key table: 003_lean_keys, which copies it, must")
	}
	for _, bad := range []string{
		"CREATE TABLE idem.k2 (LIKE idem.idempotency_keys);\nINSERT INTO idem.k2 SELECT * FROM idem.idempotency_keys;\nDROP TABLE idem.idempotency_keys;",
		"ALTER TABLE idem.idempotency_keys ALTER COLUMN attempt TYPE numeric;",
		"SELECT 1;\nLOCK TABLE idem.idempotency_keys IN ACCESS EXCLUSIVE MODE;\nTRUNCATE idem.idempotency_keys;",
		"LOCK TABLE idem.idempotency_keys IN SHARE MODE;\nDROP TABLE idem.idempotency_keys;",
	} {
		if lockFirst(bad) == "" {
			t.Errorf("the check passed a migration that rewrites the key table without locking it first:\n%s", bad)
		}
	}
	if why := lockFirst("ALTER TABLE idem.idempotency_keys ADD COLUMN note text;\nCREATE INDEX x ON idem.idempotency_keys (note);"); why != "" {
		t.Errorf("a migration that adds a nullable column needs no lock: %s", why)
	}
}

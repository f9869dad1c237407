package main

// Adversarial review (operations, round 2): what `server keys` prints to an operator.

import (
	"fmt"
	"regexp"
	"strings"
	"testing"

	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestReviewOpsKeyStoryEscapesClientFieldNames: `server keys PRINCIPAL KEY` prints one key's
// story, one "name value" line per field (docs/operations.md, "Operators": "look at the key,
// not at the logs"). field_names are the top-level member names of the client's body, and
// a client chooses them: a member name with a newline and an ESC forges lines of the story
// (here a second "state" line saying completed) and sends terminal escape sequences to the
// operator's terminal. The ledger refuses the unknown member with 400 malformed_body, a final
// answer that is stored with the key, so the story is there to be read.
func TestReviewOpsKeyStoryEscapesClientFieldNames(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	principal, token := s.principal("hostile")
	body := `{"name":"a","currency":"EUR","x\nstate              completed\nresponse_status    201\u001b[2J":1}`
	r := s.call("POST", "/v1/accounts", token, "evil-1", body)
	if r.status != 400 {
		t.Fatalf("the hostile body: %+v", r)
	}
	story, err := runCommand(t, loginRoleIn(t, s.db, "idem_operator"), "keys", principal, "evil-1")
	if err != nil {
		t.Fatal(err)
	}
	states := regexp.MustCompile(`(?m)^state\s`).FindAllString(story, -1)
	if len(states) != 1 || strings.ContainsRune(story, 0x1b) {
		t.Fatalf("the story holds %d state lines and ESC bytes: %v; printed:\n%q", len(states), strings.ContainsRune(story, 0x1b), story)
	}
}

// TestReviewOpsKeysStuckSaysWhenCut: `server keys stuck [AGE]` lists "the lease claims in
// progress claimed at least AGE ago" and ends with "N lease claims in progress claimed at
// least AGE ago". It reads at most 1,000 (keys.go) and says nothing when there are more: with
// 1,001 claims in progress it says 1,000, which is exactly the moment (a mass outage of a
// provider, a dead fleet) an operator needs the true figure.
func TestReviewOpsKeysStuckSaysWhenCut(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	owner := pgtest.Connect(t, db)
	pgtest.Exec(t, owner, `SELECT count((idem.idem_begin('alice', 'k-' || i, 'POST /pay', sha256(i::text::bytea),
		p_lease => interval '1 hour')).outcome) FROM generate_series(1, 1001) AS i`)
	if n := pgtest.Count(t, owner, `SELECT count(*) FROM idem.idempotency_keys WHERE state = 'p'`); n != 1001 {
		t.Logf("%d claims in progress", n)
	}
	out, err := runCommand(t, loginRoleIn(t, db, "idem_operator"), "keys", "stuck")
	if err != nil {
		t.Fatal(err)
	}
	last := out[strings.LastIndex(strings.TrimRight(out, "\n"), "\n")+1:]
	if !strings.HasPrefix(last, "1001 lease claims") && !strings.Contains(last, "more") {
		t.Fatalf("1001 lease claims in progress; `server keys stuck` ends with: %s", last)
	}
}

// TestReviewOpsKeysStuckOneLinePerClaim: the list of `server keys stuck` is one line per
// claim (principal, key, token, ...), the line an operator copies into `server keys release
// PRINCIPAL KEY TOKEN`. Keys are visible ASCII, but a principal is any text of 1 to 255
// characters (the application's: idem.Options.Principal, idem.Do's Job.Principal): a
// principal with a newline prints a line of its own, here one that names another principal's
// key with another token.
func TestReviewOpsKeysStuckOneLinePerClaim(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	owner := pgtest.Connect(t, db)
	forged := fmt.Sprintf("alice\n%-24s %-36s %12d  2026-01-01T00:00:00Z 2026-01-01T00:00:00Z false     %064d", "bob", "payout-7", 42, 0)
	pgtest.Exec(t, owner, `SELECT (idem.idem_begin($1, 'k1', 'POST /pay', sha256('x'), p_lease => interval '1 hour')).outcome`, forged)
	out, err := runCommand(t, loginRoleIn(t, db, "idem_operator"), "keys", "stuck")
	if err != nil {
		t.Fatal(err)
	}
	if lines := strings.Count(out, "\n"); lines != 3 { // the header, one claim, the summary
		t.Fatalf("one claim in progress, %d lines; the list shows a claim of bob that does not exist:\n%s", lines, out)
	}
}

// TestKeysStuckQuotesKeysLikeEveryClientValue: docs/operations.md ("server keys stuck"): what
// clients chose is printed Go-quoted when it holds a space, a comma, a quote or a character
// that is not printable. A key is the client's too (visible ASCII, commas and quotes among
// them): it was printed as it was, where the principal beside it was quoted.
func TestKeysStuckQuotesKeysLikeEveryClientValue(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	owner := pgtest.Connect(t, db)
	pgtest.Exec(t, owner, `SELECT idem.idem_begin('alice', 'a,"b"', 'POST /pay', sha256('p'), p_lease => interval '1 hour')`)
	out, err := runCommand(t, loginRoleIn(t, db, "idem_operator"), "keys", "stuck", "0s")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out, ` "a,\"b\"" `) {
		t.Fatalf("the key a,\"b\" is not listed Go-quoted:\n%s", out)
	}
}

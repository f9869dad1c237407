package main

// A second review of D162: the account version's arithmetic, amounts past 2^63, If-None-Match,
// HEAD, SkipClean. Its findings first (fixed in D162 before it was released), then what it
// checked and found correct.

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgidem/pgidem/internal/pgtest"
)

// previousReleaseChange is the previous release's change of an account, as 0.2.0 writes it.
const previousReleaseChange = `UPDATE ledger.accounts SET balance = balance + 1, version = version + 1 WHERE id = $1`

// TestLedgerReview2PreviousReleaseOverflowsAtTheWrapTop: the integer column is wrapped so that
// the previous release's "version + 1" never overflows while it serves an upgrade. The first
// wrap, into 1 to 2^31 - 2, left one change of headroom: where this release wrote version
// 2^31 - 2, the previous release's second change raised 22003, which 0.2.0 answers 422
// balance_limit for a deposit (a final answer, stored under its key). The wrap is into 1 to
// 2^30 now: from the top of it the previous release changes the account again and again, and
// each change is counted.
func TestLedgerReview2PreviousReleaseOverflowsAtTheWrapTop(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	_, token := s.principal("zz")
	a := reviewAccount(t, s, token, "EUR")
	// Stand in for 2^31 - 1 earlier changes of this release: revision 2^31 - 1 and its wrapped
	// version; the next, through the API, writes the top of the wrap.
	pgtest.Exec(t, s.pool, `UPDATE ledger.accounts SET revision = 2147483647, version = (2147483647 - 1) % 1073741824 + 1 WHERE id = $1`, a)
	reviewDeposit(t, s, token, a, 5)
	var rev, ver int64
	if err := s.pool.QueryRow(context.Background(), `SELECT revision, version FROM ledger.accounts WHERE id = $1`, a).Scan(&rev, &ver); err != nil {
		t.Fatal(err)
	}
	if rev != 1<<31 || ver != 1<<30 {
		t.Fatalf("after this release's change: revision %d, version %d; want 2^31 and the top of the wrap, 2^30", rev, ver)
	}
	for i := range 3 {
		_, err := s.pool.Exec(context.Background(), previousReleaseChange, a)
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "22003" {
			t.Fatalf("the previous release's change %d after this release wrote version %d: 22003 (integer out of range)", i+1, ver)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	// A far later previous-release change: 2^30 - 2 of them in all (the room the wrap leaves).
	pgtest.Exec(t, s.pool, `UPDATE ledger.accounts SET version = 2147483646 WHERE id = $1`, a)
	if _, err := s.pool.Exec(context.Background(), previousReleaseChange, a); err != nil {
		t.Fatalf("the previous release's change with version 2^31 - 2: %v", err)
	}
	if _, v := reviewState(t, s, a); v != 1<<31+(2147483647-1<<30) {
		t.Errorf("version read %d, want %d: each of the previous release's changes counted", v, int64(1<<31+(2147483647-1<<30)))
	}
}

// TestLedgerReview2IfNoneMatchSeveralFieldLines: If-None-Match is a list (RFC 9110 13.1.2), and
// a field sent as several field lines is the comma-joined list of them (RFC 9110 5.3;
// proxies may split or join the lines). getAccount read the first line only, so the matching
// tag on the second line was ignored: 200 instead of 304.
func TestLedgerReview2IfNoneMatchSeveralFieldLines(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	_, token := s.principal("zz")
	a := reviewAccount(t, s, token, "EUR")
	path := fmt.Sprintf("/v1/accounts/%d", a)
	if r := s.call("GET", path, token, "", "", "If-None-Match", `"0", "1"`); r.status != 304 {
		t.Fatalf("one line: %d, want 304", r.status)
	}
	if r := s.call("GET", path, token, "", "", "If-None-Match", `"0"`, "If-None-Match", `"1"`); r.status != 304 {
		t.Errorf("If-None-Match on two field lines, the second the current ETag \"1\": %d, want 304 (RFC 9110 5.3, 13.1.2)", r.status)
	}
}

// TestLedgerReview2AmountFractionPast2To64IsNotBalanceLimit: a fraction whose integer part is
// past 2^64 - 1 and has at most 21 digits is canonical without an exponent
// (18446744073709551616.5); strconv.ParseInt stops at the first digit that overflows uint64
// and reports ErrRange before it reaches the '.', so amount() took it for an integer past the
// range: a deposit was answered 422 balance_limit and a transfer insufficient_funds, both
// stored under the key, where 1.5 is validation_failed. It is validation_failed now.
func TestLedgerReview2AmountFractionPast2To64IsNotBalanceLimit(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	_, token := s.principal("zz")
	a, b := reviewAccount(t, s, token, "EUR"), reviewAccount(t, s, token, "EUR")
	reviewDeposit(t, s, token, a, 10)
	for _, amt := range []string{"18446744073709551616.5", "100000000000000000000.25"} {
		r := s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", a), token, "frac-"+amt, `{"amount":`+amt+`}`)
		if r.status != 422 || !strings.Contains(r.body, `"code":"validation_failed"`) {
			t.Errorf("deposit of the fraction %s: %d %s; want 422 validation_failed (not a positive integer)", amt, r.status, r.body)
		}
		r = s.call("POST", "/v1/transfers", token, "tfrac-"+amt, fmt.Sprintf(`{"from":%d,"to":%d,"amount":%s}`, a, b, amt))
		if r.status != 422 || !strings.Contains(r.body, `"code":"validation_failed"`) {
			t.Errorf("transfer of the fraction %s: %d %s; want 422 validation_failed", amt, r.status, r.body)
		}
	}
}

// TestLedgerReview2VersionArithmeticInterleavings (checked, correct): from states around every wrap
// boundary (revision NULL with the integer column anywhere up to 2^31 - 1; revision 1, M - 1,
// M, M + 1, 2M, 2M + 1, 2^40, 2^62 with version f(revision); M = 2^30, the wrap), any
// interleaving of this release's changes (nextRevision) and the previous release's (version +
// 1, kept below its overflow) reads back as the count of changes, the integer column stays
// within 1 .. M after every change of this release, and no version is read twice. Run in SQL on the real table (the column types of migrations 001 and 007).
func TestLedgerReview2VersionArithmeticInterleavings(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	_, token := s.principal("zz")
	a := reviewAccount(t, s, token, "EUR")
	ctx := context.Background()
	const M = 1 << 30
	f := func(r int64) int64 { return (r-1)%M + 1 }
	type start struct {
		rev *int64
		ver int64
	}
	p := func(v int64) *int64 { return &v }
	var starts []start
	for _, v := range []int64{1, 2, M - 1, M, M + 1, 2147483646, 2147483647} {
		starts = append(starts, start{nil, v})
	}
	for _, r := range []int64{1, 2, M - 1, M, M + 1, 2 * M, 2*M + 1, 1 << 40, 1 << 62} {
		starts = append(starts, start{p(r), f(r)})
	}
	patterns := []string{"nnnn", "onon", "noon", "oonn", "nono", "o", "n"}
	read := func() (v int64, rev *int64, ver int64) {
		t.Helper()
		if err := s.pool.QueryRow(ctx, `SELECT `+accountVersion+`, revision, version FROM ledger.accounts WHERE id = $1`, a).Scan(&v, &rev, &ver); err != nil {
			t.Fatal(err)
		}
		return
	}
	for _, st := range starts {
		for _, pat := range patterns {
			pgtest.Exec(t, s.pool, `UPDATE ledger.accounts SET revision = $2, version = $3 WHERE id = $1`, a, st.rev, st.ver)
			want, _, _ := read()
			seen := map[int64]bool{want: true}
			for _, c := range pat {
				_, _, ver := read()
				if c == 'o' && ver >= 2147483647 {
					continue // the previous release would overflow: the finding above
				}
				sql := `UPDATE ledger.accounts SET balance = balance + 1, ` + nextRevision + ` WHERE id = $1`
				if c == 'o' {
					sql = previousReleaseChange
				}
				if _, err := s.pool.Exec(ctx, sql, a); err != nil {
					t.Fatalf("start %v/%d, %q: %v", st.rev, st.ver, pat, err)
				}
				want++
				got, rev, ver := read()
				if got != want || seen[got] {
					t.Fatalf("start %v/%d, %q: read %d (revision %v, version %d), want %d", st.rev, st.ver, pat, got, rev, ver, want)
				}
				seen[got] = true
				if c == 'n' && (ver < 1 || ver > M || rev == nil || f(*rev) != ver) {
					t.Fatalf("start %v/%d, %q: after this release's change revision %v version %d", st.rev, st.ver, pat, rev, ver)
				}
			}
		}
	}
}

// TestLedgerReview2AmountCanonicalForms (checked, correct): amount() reads the canonical number text.
// 2^63 - 1 deposits (201); integers past it, plain or with an exponent whose mantissa has
// fewer digits than the exponent (1.5e21, 1e21, 0.00000001e30 = 1e22) are balance_limit;
// numbers past 2^63 written with an exponent that are not integers (1.2345678901234567890123e21
// has more fraction digits than its exponent) and negatives are validation_failed. (Plain
// fractions past 2^63 are TestLedgerReview2AmountFractionPast2To64IsNotBalanceLimit.)
func TestLedgerReview2AmountCanonicalForms(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	_, token := s.principal("zz")
	for _, c := range []struct{ amount, code string }{
		{"1.5e21", "balance_limit"},
		{"1E+21", "balance_limit"},
		{"0.00000001e30", "balance_limit"},
		{"10000000000000000000000", "balance_limit"},
		{"9223372036854775808.0", "balance_limit"},
		{"1.2345678901234567890123e21", "validation_failed"},
		{"9223372036854775808.5", "validation_failed"}, // past 2^63 but within uint64: ErrSyntax, correct
		{"-1e25", "validation_failed"},
		{"-9223372036854775809", "validation_failed"},
		{"1e-25", "validation_failed"},
		{"0e30", "validation_failed"},
	} {
		a := reviewAccount(t, s, token, "EUR")
		r := s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", a), token, "amt-"+c.amount, `{"amount":`+c.amount+`}`)
		if r.status != 422 || !strings.Contains(r.body, `"code":"`+c.code+`"`) {
			t.Errorf("deposit of %s: %d %s, want 422 %s", c.amount, r.status, r.body, c.code)
		}
	}
	a := reviewAccount(t, s, token, "EUR")
	if r := s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", a), token, "max", `{"amount":9223372036854775807}`); r.status != 201 {
		t.Errorf("deposit of 2^63 - 1 into an empty account: %d %s", r.status, r.body)
	}
}

// TestLedgerReview2HeadAndUncleanPathsStoreNothing (checked, correct): HEAD with an Idempotency-Key on a
// GET route passes the middleware by (no route is declared for HEAD: nothing claimed); HEAD on
// a keyed POST route is 405 and claims nothing; unclean and trailing-slash paths with a key
// are 404 and claim nothing; If-None-Match with empty elements and odd quoting does not
// match.
func TestLedgerReview2HeadAndUncleanPathsStoreNothing(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	_, token := s.principal("zz")
	a := reviewAccount(t, s, token, "EUR")
	keys := func() int { return s.count(`SELECT count(*) FROM idem.idempotency_keys`) }
	before := keys()
	if r := s.call("HEAD", fmt.Sprintf("/v1/accounts/%d", a), token, "h1", ""); r.status != 200 || r.header.Get("ETag") != `"1"` {
		t.Errorf("HEAD with a key: %d %v", r.status, r.header)
	}
	if r := s.call("HEAD", fmt.Sprintf("/v1/accounts/%d/deposits", a), token, "h2", `{"amount":5}`); r.status != 405 {
		t.Errorf("HEAD on a POST route: %d", r.status)
	}
	for _, path := range []string{"/v1/accounts/", fmt.Sprintf("/v1/accounts/%d/deposits/", a), fmt.Sprintf("/v1/accounts/%d//deposits", a),
		fmt.Sprintf("/v1/accounts/%d/./deposits", a), fmt.Sprintf("/v1/accounts/%d/x/../deposits", a)} {
		if r := s.call("POST", path, token, "u-"+path, `{"amount":5}`); r.status != 404 {
			t.Errorf("POST %s: %d %s, want 404", path, r.status, r.body)
		}
	}
	if got := keys(); got != before {
		t.Errorf("%d keys stored by HEAD and unclean paths, want none", got-before)
	}
	if b, _ := reviewState(t, s, a); b != 0 {
		t.Errorf("balance %d, want 0", b)
	}
	path := fmt.Sprintf("/v1/accounts/%d", a)
	for _, inm := range []string{`,`, `, ,`, `"1`, `1"`, `W/ "1"`, `w/"1"`, `""1""`, `"1" "2"`, `W/W/"1"`} {
		if r := s.call("GET", path, token, "", "", "If-None-Match", inm); r.status != 200 {
			t.Errorf("If-None-Match %q against ETag \"1\": %d, want 200", inm, r.status)
		}
	}
	for _, inm := range []string{`"1",`, `,"1"`, `"2",,W/"1"`} {
		if r := s.call("GET", path, token, "", "", "If-None-Match", inm); r.status != 304 {
			t.Errorf("If-None-Match %q against ETag \"1\": %d, want 304", inm, r.status)
		}
	}
}

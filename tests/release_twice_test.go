package tests

import (
	"context"
	"strings"
	"testing"

	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestReleaseStuckTwiceSaysGivenUp: an operator's second idem_release_stuck of the same claim
// (the same token) was refused with "the key's token is N (taken over since it was read, or
// mistyped)", while nothing had taken it over: the first release had given it its new token.
// The refusal now says that the claim was given up already, its token now, and that the retry
// takes it over; a takeover by that retry still reads as a takeover. A review of the
// operator's runbook (`server keys release` run twice).
func TestReleaseStuckTwiceSaysGivenUp(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	app, _, url, _ := appSession(t, false)
	op := pgtest.Connect(t, pgtest.LoginRole(t, url, "idem_operator"))
	claim := func() int64 {
		var outcome string
		var attempt int64
		if err := app.QueryRow(ctx, `SELECT outcome, attempt FROM idem.idem_begin('p', 'stuck-twice', 'POST /x',
			decode(repeat('ab', 32), 'hex'), p_lease => '1 minute')`).Scan(&outcome, &attempt); err != nil || outcome != "claimed" {
			t.Fatalf("claim: %s %v", outcome, err)
		}
		return attempt
	}
	release := func(token int64) error {
		_, err := op.Exec(ctx, `SELECT idem.idem_release_stuck('p', 'stuck-twice', $1, 'test')`, token)
		return err
	}
	first := claim()
	if err := release(first); err != nil {
		t.Fatalf("the first release: %v", err)
	}
	err := release(first)
	if err == nil || !strings.Contains(err.Error(), "claim was given up") || !strings.Contains(err.Error(), "55000") {
		t.Errorf("a second release of the same claim: %v; want 55000 saying it was given up", err)
	}
	second := claim() // the retry takes the key over
	if second == first {
		t.Fatalf("the retry's token is the released one's")
	}
	err = release(first)
	if err == nil || !strings.Contains(err.Error(), "taken over since it was read") {
		t.Errorf("a release with the token of a claim taken over since: %v; want it said taken over", err)
	}
}

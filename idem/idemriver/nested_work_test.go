package idemriver_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/idem/idemriver"
)

// TestNestedWorkForAnotherJobUnderOneKey: a Work for another job, run inside a job's Work under
// the same key (a Key function that gives both one key), is answered as its own claim would
// be, without running its fn: ErrMismatch for other arguments, ErrInProgress for the same
// ones, as plain errors (a cancel or a snooze returned on from the outer fn would be the outer
// job's: D258). The same job nested (Middleware and Work) still runs at once under the outer
// claim. D251; before it, every nested Work under the key ran its fn under the outer claim.
func TestNestedWorkForAnotherJobUnderOneKey(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	client := newClient(t, pool, nil)
	oneKey := func(*rivertype.JobRow) string { return "one-key" }
	o := idemriver.Options{DB: pool, Lease: 5 * time.Second, Snooze: 3 * time.Second, Key: oneKey}

	outer := jobRow(t, client, ReceiptArgs{Order: 41})
	other := jobRow(t, client, ReceiptArgs{Order: 42})
	twin := jobRow(t, client, ReceiptArgs{Order: 41})
	var otherRan, twinRan, selfRan bool
	var otherErr, twinErr, selfErr error
	var selfClaim, outerClaim idem.LeaseClaim
	err := idemriver.Work(ctx, outer, o, func(ctx context.Context, claim idem.LeaseClaim) error {
		outerClaim = claim
		otherErr = idemriver.Work(ctx, other, o, func(context.Context, idem.LeaseClaim) error { otherRan = true; return nil })
		twinErr = idemriver.Work(ctx, twin, o, func(context.Context, idem.LeaseClaim) error { twinRan = true; return nil })
		selfErr = idemriver.Work(ctx, outer, o, func(_ context.Context, c idem.LeaseClaim) error {
			selfRan, selfClaim = true, c
			return nil
		})
		return nil
	})
	if err != nil {
		t.Fatalf("outer Work: %v", err)
	}
	var cancel *river.JobCancelError
	var snooze *river.JobSnoozeError
	if otherRan || !errors.Is(otherErr, idem.ErrMismatch) || errors.As(otherErr, &cancel) || errors.As(otherErr, &snooze) {
		t.Errorf("another job's arguments under the held key: ran %v, %v; want ErrMismatch (no wish of River's: it would be the outer job's), fn not run", otherRan, otherErr)
	}
	if twinRan || !errors.Is(twinErr, idem.ErrInProgress) || errors.As(twinErr, &cancel) || errors.As(twinErr, &snooze) {
		t.Errorf("another job with the same arguments under the held key: ran %v, %v; want ErrInProgress (no wish of River's), fn not run", twinRan, twinErr)
	}
	if selfErr != nil || !selfRan || selfClaim != outerClaim {
		t.Errorf("the same job nested: ran %v, %v, claim %+v; want fn run under the outer claim %+v", selfRan, selfErr, selfClaim, outerClaim)
	}
	// What each would be told on its own, after the outer run stored its result: the other
	// arguments are refused, the same ones find the result without running.
	otherRan = false
	otherErr = idemriver.Work(ctx, other, o, func(context.Context, idem.LeaseClaim) error { otherRan = true; return nil })
	if otherRan || !errors.As(otherErr, &cancel) || !errors.Is(otherErr, idem.ErrMismatch) {
		t.Errorf("another job's arguments on its own: ran %v, %v; want a cancel of ErrMismatch", otherRan, otherErr)
	}
	twinRan = false
	if err := idemriver.Work(ctx, twin, o, func(context.Context, idem.LeaseClaim) error { twinRan = true; return nil }); err != nil || twinRan {
		t.Errorf("the same arguments on their own: ran %v, %v; want nil without running", twinRan, err)
	}
}

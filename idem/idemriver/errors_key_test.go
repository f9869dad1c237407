package idemriver_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/idem/idemriver"
)

// TestWorkErrorsNameNoKey: Work's errors go to River, which keeps them in the job's errors
// column and logs them; a Key function may build a key from personal data (an e-mail). They
// named the key itself; they now name its hash, idem.KeyHash, as the middleware's logs do.
func TestWorkErrorsNameNoKey(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t)
	client := newClient(t, pool, nil)
	const key = "welcome-mail:ada.lovelace@example.com"
	o := idemriver.Options{DB: pool, Lease: 5 * time.Second, Key: func(*rivertype.JobRow) string { return key }}
	hash := idem.KeyHash(idemriver.DefaultPrincipal, key)
	check := func(what string, err error) {
		t.Helper()
		if err == nil {
			t.Fatalf("%s: no error", what)
		}
		if strings.Contains(err.Error(), "ada.lovelace") || !strings.Contains(err.Error(), hash) {
			t.Errorf("%s: %q; want the key's hash %s, never the key", what, err, hash)
		}
	}
	work := func(context.Context, idem.LeaseClaim) error { return nil }
	if err := idemriver.Work(ctx, jobRow(t, client, ReceiptArgs{Order: 1}), o, work); err != nil {
		t.Fatal(err)
	}
	// Another job's arguments under the key: cancelled with ErrMismatch.
	err := idemriver.Work(ctx, jobRow(t, client, ReceiptArgs{Order: 2}), o, work)
	var cancel *river.JobCancelError
	if !errors.As(err, &cancel) || !errors.Is(err, idem.ErrMismatch) {
		t.Fatalf("other arguments under the key: %v; want a cancel with ErrMismatch", err)
	}
	check("a cancel for other arguments", err)
	// Nested under a held key: the plain error of a claim of its own.
	other := o
	other.Key = func(*rivertype.JobRow) string { return key + "/2" }
	outer := jobRow(t, client, ReceiptArgs{Order: 3})
	var nested error
	if err := idemriver.Work(ctx, outer, other, func(ctx context.Context, _ idem.LeaseClaim) error {
		nested = idemriver.Work(ctx, jobRow(t, client, ReceiptArgs{Order: 4}), other, work)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	hash = idem.KeyHash(idemriver.DefaultPrincipal, key+"/2")
	check("a nested job under the held key", nested)
}

// TestKeyHashIsTheLogsForm: idem.KeyHash is the 12 hex digits the middleware logs as key_hash,
// the same for one principal and key, different for another principal.
func TestKeyHashIsTheLogsForm(t *testing.T) {
	t.Parallel()
	a, b := idem.KeyHash("alice", "k-1"), idem.KeyHash("bob", "k-1")
	if len(a) != 12 || strings.Trim(a, "0123456789abcdef") != "" || a != idem.KeyHash("alice", "k-1") || a == b {
		t.Fatalf("KeyHash: %q and %q", a, b)
	}
}

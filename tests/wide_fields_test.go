package tests

import (
	"context"
	"testing"
	"time"

	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestAMismatchOfManyFieldsIsLinear: a key stored with thousands of field hashes of long names
// (a caller of the SQL API that does not bound them, as the Go library does) took seconds of
// CPU for every mismatch, and for idem_key, growing with the square of the stored form's size:
// each name was cut from the stored form, compressed in the row, which substr decompressed up
// to its offset every time. With 10,000 names of 200 characters: 1.8 s and 11.2 s before, 0.2 s
// and 0.13 s now; the bound, at twice as many names, tells the two apart.
func TestAMismatchOfManyFieldsIsLinear(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	app := pgtest.Connect(t, pgtest.LoginRole(t, db, "idem_app"))
	ops := pgtest.Connect(t, pgtest.LoginRole(t, db, "idem_operator"))
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	fields := func(hash string) string {
		return `(SELECT jsonb_object_agg(repeat('n', 200) || i, '` + hash + `') FROM generate_series(1, 20000) i)`
	}
	var outcome string
	if err := app.QueryRow(ctx, `SELECT outcome FROM idem.idem_begin('p', 'wide', 'a', sha256('one'), p_lease => '1 minute',
		p_request_fields => `+fields("aaaaaaaaaaaaaaaa")+`)`).Scan(&outcome); err != nil || outcome != "claimed" {
		t.Fatalf("the claim: %s %v", outcome, err)
	}
	start := time.Now()
	var changed int
	if err := app.QueryRow(ctx, `SELECT outcome, cardinality(changed_fields) FROM idem.idem_begin('p', 'wide', 'a', sha256('two'),
		p_lease => '1 minute', p_request_fields => `+fields("bbbbbbbbbbbbbbbb")+`)`).Scan(&outcome, &changed); err != nil ||
		outcome != "mismatch" || changed != 20000 {
		t.Fatalf("the mismatch: %s, %d changed fields, %v; want mismatch naming 20000", outcome, changed, err)
	}
	mismatch := time.Since(start)
	start = time.Now()
	var names int
	if err := ops.QueryRow(ctx, `SELECT cardinality(field_names) FROM idem.idem_key('p', 'wide')`).Scan(&names); err != nil || names != 20000 {
		t.Fatalf("idem_key: %d names, %v", names, err)
	}
	key := time.Since(start)
	if mismatch > 2*time.Second || key > 2*time.Second {
		t.Fatalf("20,000 stored field names: the mismatch took %s, idem_key %s; want well under 2 s each", mismatch, key)
	}

	// Names longer than the 1 KiB window the decoding looks in first: its first build searched
	// a copy of the rest of the form for each; the window doubles now.
	if err := app.QueryRow(ctx, `SELECT outcome FROM idem.idem_begin('p', 'long', 'a', sha256('one'), p_lease => '1 minute',
		p_request_fields => (SELECT jsonb_object_agg(lpad(i::text, 1100, 'n'), 'aaaaaaaaaaaaaaaa') FROM generate_series(1, 20000) i))`).
		Scan(&outcome); err != nil || outcome != "claimed" {
		t.Fatalf("the claim of long names: %s %v", outcome, err)
	}
	start = time.Now()
	if err := ops.QueryRow(ctx, `SELECT cardinality(field_names) FROM idem.idem_key('p', 'long')`).Scan(&names); err != nil || names != 20000 {
		t.Fatalf("idem_key of long names: %d names, %v", names, err)
	}
	// 0.9 s here, 10 s with the first build's search.
	if key = time.Since(start); key > 4*time.Second {
		t.Fatalf("20,000 stored field names of 1,100 bytes: idem_key took %s; want well under 4 s", key)
	}
}

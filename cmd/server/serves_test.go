package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestLedgerNewerWithoutItsOwnServesIsRefused: docs/operations.md, "serve ... refuse a
// database whose schema or functions belong to another release ... with one exception: a
// database that a newer release migrated and that says it still serves this release
// (idem.idem_serves_version and ledger.serves_version, written by every migrate)"; D204 "a
// release without the function, or one that answers no, is refused as before". The newer
// release's migrate commits its ledger migrations (tern, one transaction each) and writes
// ledger.serves_version only afterwards, in a statement of its own (migrate.go: migrateLedger,
// then ledgerServes). Between the two (or for good, when that migrate dies there) the function
// is this release's, which answers for its own range, and this server takes it as the newer
// ledger's word.
func TestLedgerNewerWithoutItsOwnServesIsRefused(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := startServer(t, nil)
	appURL := pgtest.LoginRole(t, s.db, "idem_app")
	var log bytes.Buffer
	old := serveWith(t, appURL, s.db, nil, &log)
	// The next release's ledger migration committed; its ledger.serves_version not yet written.
	pgtest.Exec(t, s.pool, fmt.Sprintf(`UPDATE ledger.schema_version SET version = %d`, countMigrations(ledgerFS())+1))
	var ownTop bool
	if err := s.pool.QueryRow(ctx, `SELECT ledger.serves_version($1)`, countMigrations(ledgerFS())+1).Scan(&ownTop); err != nil {
		t.Fatal(err)
	}
	if err := checkMigrated(ctx, s.pool); !errors.Is(err, errNewer) {
		t.Errorf("checkMigrated on a ledger one migration on, whose serves_version is still this release's (it does not serve the ledger's own version: %v): %v; want errNewer", ownTop, err)
	}
	if h := old.call("GET", "/healthz", "", "", ""); h.status != 503 {
		t.Errorf("/healthz: %d %s; want 503", h.status, h.body)
	}
}

// TestHealthzReasonWhenServesAnswersNothing: /healthz "answers 503 with the reason"
// (docs/operations.md). A newer release whose serves function (idem's or the ledger's) answers
// NULL, raises, or may not be called by the role was refused, but /healthz said "the database
// does not answer", and serve's start returned a database error rather than errNewer.
func TestHealthzReasonWhenServesAnswersNothing(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	appURL := pgtest.LoginRole(t, s.db, "idem_app")
	var log bytes.Buffer
	old := serveWith(t, appURL, s.db, nil, &log)
	const raises = `LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$ BEGIN RAISE EXCEPTION 'broken'; END $$`
	for _, c := range []struct{ name, fn, body string }{
		{"the ledger's answers NULL", "ledger.serves_version",
			`LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$ SELECT NULL::boolean $$`},
		{"the ledger's may not be called", "ledger.serves_version",
			`LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$ SELECT true $$;
			REVOKE EXECUTE ON FUNCTION ledger.serves_version(integer) FROM idem_app`},
		{"the ledger's raises", "ledger.serves_version", raises},
		{"idem's raises", "idem.idem_serves_version", raises},
	} {
		asNextRelease(t, s, idem.SchemaVersion(), countMigrations(ledgerFS()))
		pgtest.Exec(t, s.pool, `CREATE OR REPLACE FUNCTION `+c.fn+`(p_version integer) RETURNS boolean `+c.body)
		h := old.call("GET", "/healthz", "", "", "")
		if h.status != 503 || !strings.Contains(h.body, "newer than this server") {
			t.Errorf("/healthz on a newer release whose %s: %d %s; want 503 saying the database is newer", c.name, h.status, h.body)
		}
		pgtest.Exec(t, s.pool, `GRANT EXECUTE ON FUNCTION ledger.serves_version(integer) TO idem_app`)
	}
}

// TestServesEachHalfAndTheOperator: the ledger newer (serving) with idem equal, and the reverse: both
// /healthz 200 with a note; a ledger newer that serves no more with idem newer serving: 503;
// `server keys` as idem_operator on a newer idem that serves it works.
func TestServesEachHalfAndTheOperator(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := startServer(t, nil)
	appURL := pgtest.LoginRole(t, s.db, "idem_app")
	var log bytes.Buffer
	old := serveWith(t, appURL, s.db, nil, &log)
	want, wantLedger := idem.SchemaVersion(), countMigrations(ledgerFS())
	setIdem := func(v, from int) {
		pgtest.Exec(t, s.pool, fmt.Sprintf(`
		UPDATE idem.schema_version SET version = %[1]d;
		CREATE OR REPLACE FUNCTION idem.idem_version(OUT functions_version integer, OUT schema_version integer)
			LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
			AS $$ SELECT %[1]d, (SELECT v.version FROM idem.schema_version AS v) $$;
		CREATE OR REPLACE FUNCTION idem.idem_serves_version(p_version integer) RETURNS boolean
			LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$ SELECT p_version BETWEEN %[2]d AND %[1]d $$`, v, from))
	}
	setLedger := func(v, from int) {
		pgtest.Exec(t, s.pool, fmt.Sprintf(`UPDATE ledger.schema_version SET version = %[1]d;
		CREATE OR REPLACE FUNCTION ledger.serves_version(p_version integer) RETURNS boolean
			LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$ SELECT p_version BETWEEN %[2]d AND %[1]d $$`, v, from))
	}
	setLedger(wantLedger+1, 5)
	if h := old.call("GET", "/healthz", "", "", ""); h.status != 200 || !strings.Contains(h.body, "note") {
		t.Errorf("ledger newer (serving), idem equal: %d %s", h.status, h.body)
	}
	setLedger(wantLedger, 5)
	setIdem(want+1, 5)
	if h := old.call("GET", "/healthz", "", "", ""); h.status != 200 || !strings.Contains(h.body, "note") {
		t.Errorf("idem newer (serving), ledger equal: %d %s", h.status, h.body)
	}
	setLedger(wantLedger+1, wantLedger+1)
	if h := old.call("GET", "/healthz", "", "", ""); h.status != 503 {
		t.Errorf("idem newer (serving), ledger newer (not serving): %d %s", h.status, h.body)
	}
	setLedger(wantLedger-1, 5)
	if h := old.call("GET", "/healthz", "", "", ""); h.status != 503 || !strings.Contains(h.body, "not migrated") {
		t.Errorf("idem newer (serving), ledger older: %d %s", h.status, h.body)
	}
	setLedger(wantLedger, 5)
	opURL := pgtest.LoginRole(t, s.db, "idem_operator")
	out, errOut, err := runMain(t, []string{"keys"}, serverEnv(opURL, nil))
	if err != nil || !strings.Contains(out, "principal") {
		t.Errorf("server keys as idem_operator on a newer idem that serves this one: %v\n%s%s", err, out, errOut)
	}
	_ = ctx
}

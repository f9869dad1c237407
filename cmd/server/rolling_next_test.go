package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"testing"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// asNextRelease leaves the database as the next release's migrate would: schema idem and the
// ledger one version on, idem's functions reporting it, and each saying from which version on
// it still serves older code (idem.idem_serves_version, ledger.serves_version).
func asNextRelease(t *testing.T, s *testServer, idemFrom, ledgerFrom int) {
	t.Helper()
	next, nextLedger := idem.SchemaVersion()+1, countMigrations(ledgerFS())+1
	pgtest.Exec(t, s.pool, fmt.Sprintf(`
		UPDATE idem.schema_version SET version = %[1]d;
		CREATE OR REPLACE FUNCTION idem.idem_version(OUT functions_version integer, OUT schema_version integer)
			LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
			AS $$ SELECT %[1]d, (SELECT v.version FROM idem.schema_version AS v) $$;
		CREATE OR REPLACE FUNCTION idem.idem_serves_version(p_version integer) RETURNS boolean
			LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$ SELECT p_version BETWEEN %[2]d AND %[1]d $$;
		UPDATE ledger.schema_version SET version = %[3]d;
		CREATE OR REPLACE FUNCTION ledger.serves_version(p_version integer) RETURNS boolean
			LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$ SELECT p_version BETWEEN %[4]d AND %[3]d $$`,
		next, idemFrom, nextLedger, ledgerFrom))
}

// TestThisServerServesThroughTheNextReleasesMigrate: a rolling upgrade's first step is the
// next release's migrate while this release's servers serve. They answered /healthz 503
// ("the database is newer than this server") from that moment, so a load balancer took every
// one of them out before a server of the new release was up, and one that restarted refused to
// start. A newer release says which older code it serves: this server, as the application
// role, keeps answering /healthz 200 (with a note that it is due to be replaced), serving keyed
// requests and replays, and starts again; once the newer release serves it no more (a contract
// step), /healthz is 503 and a start is refused.
func TestThisServerServesThroughTheNextReleasesMigrate(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	appURL := pgtest.LoginRole(t, s.db, "idem_app")
	var log bytes.Buffer
	old := serveWith(t, appURL, s.db, nil, &log)
	_, token := s.principal("rolling")
	id := int(old.call("POST", "/v1/accounts", token, "", `{"name":"a","currency":"EUR"}`).json(t)["id"].(float64))
	before := old.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", id), token, "before", `{"amount":5}`)
	if before.status != 201 {
		t.Fatalf("a deposit before the migrate: %+v", before)
	}

	asNextRelease(t, s, idem.SchemaVersion(), countMigrations(ledgerFS()))
	h := old.call("GET", "/healthz", "", "", "")
	if h.status != 200 || !strings.Contains(h.body, "newer release") {
		t.Fatalf("/healthz after the next release's migrate: %d %s; want 200 with a note", h.status, h.body)
	}
	if r := old.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", id), token, "before", `{"amount":5}`); r.status != 201 ||
		r.header.Get("Idempotent-Replayed") != "true" || r.body != before.body {
		t.Fatalf("a replay after the migrate: %+v", r)
	}
	if r := old.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", id), token, "after", `{"amount":7}`); r.status != 201 {
		t.Fatalf("a deposit after the migrate: %+v", r)
	}
	var restartLog bytes.Buffer
	again := serveWith(t, appURL, s.db, nil, &restartLog)
	if h := again.call("GET", "/healthz", "", "", ""); h.status != 200 || !strings.Contains(restartLog.String(), "newer release") {
		t.Fatalf("a restart of this release's server: /healthz %d %s; log:\n%s", h.status, h.body, restartLog.String())
	}

	for _, c := range []struct{ name, what string }{
		{"idem", "idem"},
		{"ledger", "ledger"},
	} {
		idemFrom, ledgerFrom := idem.SchemaVersion(), countMigrations(ledgerFS())
		if c.what == "idem" {
			idemFrom++
		} else {
			ledgerFrom++
		}
		asNextRelease(t, s, idemFrom, ledgerFrom)
		if h := old.call("GET", "/healthz", "", "", ""); h.status != 503 || !strings.Contains(h.body, "newer than this server") {
			t.Errorf("%s serves this server no more: /healthz %d %s; want 503", c.name, h.status, h.body)
		}
		m := NewMain(io.Discard, io.Discard)
		if err := m.ParseFlags(nil, serverEnv(appURL, nil)); err != nil {
			t.Fatal(err)
		}
		err := m.Run(context.Background())
		_ = m.Close()
		if !errors.Is(err, errNewer) {
			t.Errorf("%s serves this server no more: a start returned %v; want errNewer", c.name, err)
		}
	}
	pgtest.Exec(t, s.pool, `DROP FUNCTION idem.idem_serves_version(integer)`)
	if h := old.call("GET", "/healthz", "", "", ""); h.status != 503 {
		t.Errorf("a newer release that does not say what it serves: /healthz %d %s; want 503", h.status, h.body)
	}
}

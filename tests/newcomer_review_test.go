package tests

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/idem/idemmigrate"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestPgRepackBesideANonSuperuserOwner runs docs/operations.md's pg_repack recipe ("To rebuild
// a bloated key table online") as the roles it names, where the owner of schema idem is no
// superuser (the deployment docs/sql-api.md recommends): the extension created and pg_repack
// run by a superuser. The recipe said the schema's owner runs it, which fails ("permission
// denied for schema repack"); TestPgRepackUnderTraffic runs it where the superuser owns the
// schema. After it, the owner's functions still claim and replay, and every key is there.
func TestPgRepackBesideANonSuperuserOwner(t *testing.T) {
	t.Parallel()
	repack, err := exec.LookPath("pg_repack")
	if err != nil {
		t.Fatal("pg_repack not found: apt-get install postgresql-15-repack")
	}
	ctx := context.Background()
	db := pgtest.NewEmptyDB(t)
	ownerURL := pgtest.OwnerRole(t, db)
	if err := migrateURL(ctx, ownerURL, idemmigrate.Options{}); err != nil {
		t.Fatalf("install as the owner: %v", err)
	}
	admin := pgtest.Connect(t, db)
	pgtest.Exec(t, admin, `CREATE EXTENSION IF NOT EXISTS pg_repack`)
	owner := pgtest.Connect(t, ownerURL)
	var super bool
	if err := owner.QueryRow(ctx, `SELECT rolsuper FROM pg_roles WHERE rolname = current_user`).Scan(&super); err != nil || super {
		t.Fatalf("the owner role is a superuser (%v, %v)", super, err)
	}
	pgtest.Exec(t, owner, `INSERT INTO idem.idempotency_keys (expires_at, attempt, action_hash, state, principal_id, key,
		request_sha256, response_status, response_headers, response_body)
		SELECT now() + interval '1 day', nextval('idem.token_seq'), 0, 'c', 'p', 'k-' || g, sha256(g::text::bytea),
		       201, '{}', convert_to(repeat('x', 200), 'UTF8')
		  FROM generate_series(1, 2000) AS g`)
	cfg, err := pgx.ParseConfig(db)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(repack, "--no-kill-backend", "--wait-timeout=5", "--table=idem.idempotency_keys", "--dbname="+cfg.Database)
	cmd.Env = append(os.Environ(), "PGHOST="+cfg.Host, fmt.Sprintf("PGPORT=%d", cfg.Port), "PGUSER="+cfg.User,
		"PGPASSWORD="+cfg.Password)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("docs/operations.md's pg_repack command as a superuser: %v\n%s", err, out)
	}
	if n := pgtest.Count(t, admin, `SELECT count(*) FROM idem.idempotency_keys`); n != 2000 {
		t.Fatalf("%d keys after pg_repack, want 2000", n)
	}
	app := pgtest.Connect(t, pgtest.LoginRole(t, db, "idem_app"))
	var outcome string
	if err := app.QueryRow(ctx, `SELECT outcome FROM idem.idem_begin('p', 'after-repack', 'a', sha256('x'), p_lease => interval '1 minute')`).Scan(&outcome); err != nil || outcome != "claimed" {
		t.Fatalf("a claim after pg_repack: %q %v", outcome, err)
	}
}

// TestReadmeInstallsWhatTheTestsNeed: README.md gives the apt-get line that sets a Debian
// machine up for `make test` ("what `.ci/run` does"). Every package .ci/run installs for the
// tests must be in it: postgresql-15-repack was not, and without it TestPgRepackUnderTraffic
// failed ("pg_repack not found") on a machine set up as the README said.
func TestReadmeInstallsWhatTheTestsNeed(t *testing.T) {
	readme, err := os.ReadFile("../README.md")
	if err != nil {
		t.Fatal(err)
	}
	ci, err := os.ReadFile("../.ci/run")
	if err != nil {
		t.Fatal(err)
	}
	_, line, _ := strings.Cut(string(readme), "apt-get update && apt-get install -y")
	line, _, _ = strings.Cut(line, "```")
	_, list, _ := strings.Cut(string(ci), "for pkg in ")
	list, _, _ = strings.Cut(list, "; do")
	for _, pkg := range strings.Fields(strings.ReplaceAll(list, `\`, " ")) {
		if !slices.Contains(strings.Fields(strings.ReplaceAll(line, `\`, " ")), pkg) {
			t.Errorf(".ci/run installs %s for the tests; README.md's apt-get line does not", pkg)
		}
	}
}

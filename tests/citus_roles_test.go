//go:build citus

// The SQL API on a real Citus cluster as the least-privilege roles the docs name: the
// application role, the operator role, and an owner of schema idem that is no superuser.

package tests

import (
	"context"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/internal/pgtest"
)

// citusPoolOf is a pool on url (a login of the test's own).
func citusPoolOf(t *testing.T, url string) *pgxpool.Pool {
	t.Helper()
	pool, err := pgxpool.New(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// TestCitusStuckProviderKeyAsOperator: docs/sql-api.md ("For operators"): idem_stuck lists
// "the provider key of its request (what an outside provider saw)", and docs/scale-out.md says the
// operators' functions "work on the coordinator and report the whole cluster". On a coordinator
// the claim (delegated to the principal's worker) handed the application one provider key, and
// the operator's idem_stuck (run on the coordinator, not delegated) listed another one for the
// very same claim: distribute.sql wrote the lists of the installation's secrets again on the
// workers only, so the coordinator took a worker's tokens for the previous release's (label v2,
// no secret). It writes them on the coordinator too now.
func TestCitusStuckProviderKeyAsOperator(t *testing.T) {
	db, _ := citusDB(t)
	ctx := context.Background()
	app := citusPoolOf(t, pgtest.LoginRole(t, db, "idem_app"))
	ops := citusPoolOf(t, pgtest.LoginRole(t, db, "idem_operator"))

	for _, principal := range []string{"alice", "bob", "carol", "dave"} { // shards on both workers
		var outcome, claimKey string
		var attempt int64
		if err := app.QueryRow(ctx, `SELECT outcome, attempt, provider_key FROM idem.idem_begin_steps(
			p_principal => $1, p_key => 'stuck-1', p_action => 'POST /v1/payouts',
			p_request_sha256 => sha256('x'::bytea), p_lease => '1 hour')`, principal).Scan(&outcome, &attempt, &claimKey); err != nil || outcome != "claimed" {
			t.Fatalf("%s: a lease claim as the application role: %s %v", principal, outcome, err)
		}
		var listedAttempt int64
		var listedKey string
		if err := ops.QueryRow(ctx, `SELECT attempt, provider_key FROM idem.idem_stuck()
			WHERE principal_id = $1 AND key = 'stuck-1'`, principal).Scan(&listedAttempt, &listedKey); err != nil {
			t.Fatalf("%s: idem_stuck as the operator role: %v", principal, err)
		}
		if listedAttempt != attempt || listedKey != claimKey {
			t.Errorf("%s: the claim (token %d) handed out provider key %s; the operator's idem_stuck on the coordinator lists token %d with provider key %s",
				principal, attempt, claimKey, listedAttempt, listedKey)
		}
	}
}

// citusOwnerDB: a Citus database (CitusDB) owned, on every node, by a login role that is no
// superuser, made by a superuser beforehand as docs/sql-api.md "Installing without a superuser"
// says (CREATE ROLE ... LOGIN, then the database OWNER it); returns the database's URL
// (superuser) and the owner's. (Not pgtest.OwnerRole: its cleanup, REASSIGN OWNED BY / DROP
// OWNED BY in a database with the citus extension, segfaulted the Citus 13.2.2 coordinator.)
func citusOwnerDB(t *testing.T) (db, owner string) {
	t.Helper()
	base := pgtest.CitusURL(t)
	coordinator, workers := pgtest.CitusNodes(t)
	nodes := append([]pgtest.CitusNode{coordinator}, workers...)
	// A name that SQL must quote (upper case, a hyphen): distribute.sql quoted the owner's name
	// twice, and stopped on the workers with "role ... does not exist".
	name := fmt.Sprintf("Citus-Owner_%d_%d", os.Getpid(), time.Now().UnixNano()%1000000)
	quoted := pgx.Identifier{name}.Sanitize()
	t.Cleanup(func() { // after the database is dropped (cleanups run last-registered first)
		for _, n := range nodes {
			c, err := pgx.Connect(context.Background(), pgtest.CitusNodeURL(t, base, n))
			if err != nil {
				continue
			}
			_, _ = c.Exec(context.Background(), `DROP ROLE IF EXISTS `+quoted)
			_ = c.Close(context.Background())
		}
	})
	for _, n := range nodes {
		c := pgtest.Connect(t, pgtest.CitusNodeURL(t, base, n))
		pgtest.Exec(t, c, `SET citus.enable_ddl_propagation = off`)
		pgtest.Exec(t, c, `CREATE ROLE `+quoted+` LOGIN PASSWORD 'owner-secret' NOSUPERUSER NOCREATEDB NOCREATEROLE`)
	}
	db = pgtest.CitusDB(t)
	dbName := db[strings.LastIndex(db, "/")+1:]
	if i := strings.IndexByte(dbName, '?'); i >= 0 {
		dbName = dbName[:i]
	}
	for _, n := range nodes {
		c := pgtest.Connect(t, pgtest.CitusNodeURL(t, base, n))
		pgtest.Exec(t, c, `SET citus.enable_ddl_propagation = off`)
		pgtest.Exec(t, c, `ALTER DATABASE `+dbName+` OWNER TO `+quoted)
	}
	return db, pgtest.AsRole(t, db, name, "owner-secret")
}

// psqlOut runs psql -X -v ON_ERROR_STOP=1 -f file against url from the repository's root and
// returns its output and error (pgtest.Psql fails the test instead).
func psqlOut(url string, args ...string) (string, error) {
	cmd := exec.Command("psql", append([]string{"-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", url}, args...)...)
	cmd.Dir = ".."
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// TestCitusOwnerInstallsAndTheApplicationClaims: docs/scale-out.md, step 4, with an owner of
// schema idem that is no superuser (docs/sql-api.md, "Installing without a superuser"). The
// owner's install failed on the coordinator with 42501 "must be superuser to alter superuser
// roles or change superuser attribute" (Citus creates on the workers the roles that a
// distributed object's grant names, which only a superuser may): the doc's superuser step (the
// citus-roles block) makes Citus know them first. Then distribute.sql, run as a superuser,
// created the workers' sequences as that superuser, and every claim of the application role
// failed with 42501 "permission denied for sequence token_seq": the SECURITY DEFINER functions
// run as the owner. The script hands the sequences to the owner of schema idem now.
func TestCitusOwnerInstallsAndTheApplicationClaims(t *testing.T) {
	db, owner := citusOwnerDB(t)
	ctx := context.Background()
	raw, err := os.ReadFile("../docs/scale-out.md")
	if err != nil {
		t.Fatal(err)
	}
	_, block := replaceBlock(t, string(raw), "<!-- citus-roles:begin", "<!-- citus-roles:end -->", "")
	block = strings.TrimSpace(block)
	block = strings.TrimSuffix(strings.TrimPrefix(block, "```sql"), "```")
	if out, err := psqlOut(db, "-c", strings.ReplaceAll(block, "shop_owner", pgx.Identifier{userOf(t, owner)}.Sanitize())); err != nil {
		t.Fatalf("the doc's superuser step: %v\n%s", err, lastLines(out, 6))
	}
	if out, err := psqlOut(owner, "-f", "sql/idem.sql"); err != nil {
		t.Fatalf("sql/idem.sql as the owner (no superuser) on a Citus coordinator: %v\n%s", err, lastLines(out, 6))
	}
	pgtest.CitusDistribute(t, db) // as a superuser

	app := citusPoolOf(t, pgtest.LoginRole(t, db, "idem_app"))
	for _, principal := range []string{"alice", "bob", "carol", "dave"} { // shards on both workers
		tx, err := app.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		var outcome string
		var attempt int64
		err = tx.QueryRow(ctx, `SELECT outcome, attempt FROM idem.idem_begin(p_principal => $1, p_key => 'k1',
			p_action => 'POST /x', p_request_sha256 => sha256('x'::bytea))`, principal).Scan(&outcome, &attempt)
		if err == nil {
			_, err = tx.Exec(ctx, `SELECT idem.idem_complete($1, 'k1', $2, 201, '{}', 'done')`, principal, attempt)
		}
		if err == nil {
			err = tx.Commit(ctx)
		}
		_ = tx.Rollback(ctx)
		if err != nil {
			t.Fatalf("%s: a claim of the application role through the coordinator, schema idem owned by a role that is no superuser: %v", principal, err)
		}
	}
}

func userOf(t *testing.T, u string) string {
	t.Helper()
	p, err := url.Parse(u)
	if err != nil || p.User == nil {
		t.Fatalf("no user in %q", u)
	}
	return p.User.Username()
}

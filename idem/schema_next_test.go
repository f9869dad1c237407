package idem_test

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestCheckSchemaAcceptsANewerReleaseThatServesThisOne: after the next release's migrate (a
// rolling upgrade's first step) this release's services start and serve while that release
// says it serves their version (idem.idem_serves_version); they were refused (ErrSchemaNewer)
// from the migrate on, so a process that restarted during the rollout could not start. Once
// the newer release serves this version no more, or does not say, they are refused.
func TestCheckSchemaAcceptsANewerReleaseThatServesThisOne(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	owner, url := pgtest.NewPool(t, 4)
	app := newPool(t, pgtest.LoginRole(t, url, "idem_app"))
	want := idem.SchemaVersion()
	next := func(from int) {
		pgtest.Exec(t, owner, fmt.Sprintf(`
			UPDATE idem.schema_version SET version = %[1]d;
			CREATE OR REPLACE FUNCTION idem.idem_version(OUT functions_version integer, OUT schema_version integer)
				LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
				AS $$ SELECT %[1]d, (SELECT v.version FROM idem.schema_version AS v) $$;
			CREATE OR REPLACE FUNCTION idem.idem_serves_version(p_version integer) RETURNS boolean
				LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$ SELECT p_version BETWEEN %[2]d AND %[1]d $$`,
			want+1, from))
	}
	var served bool
	if err := app.QueryRow(ctx, `SELECT idem.idem_serves_version($1)`, want).Scan(&served); err != nil || !served {
		t.Fatalf("this release's idem_serves_version(%d) as idem_app: %v %v", want, served, err)
	}
	next(want)
	if _, err := idem.New(ctx, idem.Options{DB: app, Principal: alice}); err != nil {
		t.Fatalf("New on the next release's schema, which serves this one: %v", err)
	}
	job := idem.Job{Principal: "alice", Key: "next-release", Action: "a"}
	n, _, err := idem.Do(ctx, app, job, idem.TxOptions{}, func(context.Context, pgx.Tx) (int, error) { return 1, nil })
	if err != nil || n != 1 {
		t.Fatalf("Do on the next release's schema: %d %v", n, err)
	}
	next(want + 1)
	var se *idem.SchemaError
	if err := idem.CheckSchema(ctx, app); !errors.Is(err, idem.ErrSchemaNewer) || !errors.As(err, &se) || se.Schema != want+1 {
		t.Fatalf("CheckSchema on a newer release that serves this one no more: %v", err)
	}
	pgtest.Exec(t, owner, `DROP FUNCTION idem.idem_serves_version(integer)`)
	if _, err := idem.New(ctx, idem.Options{DB: app, Principal: alice}); !errors.Is(err, idem.ErrSchemaNewer) {
		t.Fatalf("New on a newer release that does not say what it serves: %v", err)
	}
}

package idem_test

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// servesNext leaves the database as a newer release's install would, schema and functions at
// want+1; serves, when not "", is the body of that release's idem_serves_version (SQL
// returning boolean, p_version the argument).
func servesNext(t *testing.T, owner *pgxpool.Pool, schema, functions int, serves string) {
	t.Helper()
	pgtest.Exec(t, owner, fmt.Sprintf(`
		UPDATE idem.schema_version SET version = %[1]d;
		CREATE OR REPLACE FUNCTION idem.idem_version(OUT functions_version integer, OUT schema_version integer)
			LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
			AS $$ SELECT %[2]d, (SELECT v.version FROM idem.schema_version AS v) $$`, schema, functions))
	if serves != "" {
		pgtest.Exec(t, owner, `CREATE OR REPLACE FUNCTION idem.idem_serves_version(p_version integer) RETURNS boolean
			LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$ BEGIN `+serves+` END $$`)
	}
}

// TestCheckSchemaNewerServesNULLIsSchemaNewer: a newer release whose idem_serves_version
// answers NULL does not say it serves this code: a *SchemaError (ErrSchemaNewer), as for any
// newer schema that does not serve it. It was "cannot scan NULL into *bool".
func TestCheckSchemaNewerServesNULLIsSchemaNewer(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	owner, url := pgtest.NewPool(t, 4)
	app := newPool(t, pgtest.LoginRole(t, url, "idem_app"))
	want := idem.SchemaVersion()
	servesNext(t, owner, want+1, want+1, `RETURN NULL;`)
	err := idem.CheckSchema(ctx, app)
	var se *idem.SchemaError
	if !errors.Is(err, idem.ErrSchemaNewer) || !errors.As(err, &se) {
		t.Errorf("CheckSchema on a newer release whose idem_serves_version answers NULL: %v (unavailable: %v); want a *SchemaError, ErrSchemaNewer",
			err, idem.IsUnavailable(err))
	}
}

// TestCheckSchemaNewerServesWithoutExecuteIsPermissionDenied: CheckSchema's doc promises "an
// error wrapping ErrPermissionDenied, naming the GRANT it lacks, when q's role may not call the
// SQL API". A role that may call idem_version but not idem_serves_version (docs/sql-api.md:
// granted to idem_app and idem_operator) on a newer release got a plain database error.
func TestCheckSchemaNewerServesWithoutExecuteIsPermissionDenied(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	owner, url := pgtest.NewPool(t, 4)
	app := newPool(t, pgtest.LoginRole(t, url, "idem_app"))
	want := idem.SchemaVersion()
	servesNext(t, owner, want+1, want+1, `RETURN p_version BETWEEN 5 AND `+fmt.Sprint(want+1)+`;`)
	pgtest.Exec(t, owner, `REVOKE EXECUTE ON FUNCTION idem.idem_serves_version(integer) FROM idem_app`)
	if err := idem.CheckSchema(ctx, app); !errors.Is(err, idem.ErrPermissionDenied) {
		t.Errorf("CheckSchema as a role without EXECUTE on idem_serves_version: %v; want ErrPermissionDenied", err)
	}
}

// TestCheckSchemaNewerReleaseThatDoesNotAnswerIsRefused: D204 "a release without the function,
// or one that answers no, is refused as before (ErrSchemaNewer)". Installs never drop
// idem_serves_version, so a newer release that does not (re)write it leaves this release's own,
// which answers for this release's range (5..want) and not for the installed schema: the check
// took this release's word about a newer release. It counts an answer only from a function
// that serves its own installed version too.
func TestCheckSchemaNewerReleaseThatDoesNotAnswerIsRefused(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	owner, url := pgtest.NewPool(t, 4)
	app := newPool(t, pgtest.LoginRole(t, url, "idem_app"))
	want := idem.SchemaVersion()
	servesNext(t, owner, want+1, want+1, "") // this release's idem_serves_version stays
	var own bool
	if err := app.QueryRow(ctx, `SELECT idem.idem_serves_version($1)`, want+1).Scan(&own); err != nil {
		t.Fatal(err)
	}
	err := idem.CheckSchema(ctx, app)
	if !errors.Is(err, idem.ErrSchemaNewer) {
		t.Errorf("CheckSchema on schema %d whose idem_serves_version is release %d's (it does not serve its own version: %v): %v; want ErrSchemaNewer",
			want+1, want, own, err)
	}
}

// TestCheckSchemaHalfInstallsStayRefused: a newer schema whose functions are not its own (the
// migrations alone), functions newer than the schema, an older schema: refused as before, even
// though idem_serves_version says yes.
func TestCheckSchemaHalfInstallsStayRefused(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	want := idem.SchemaVersion()
	yes := `RETURN true;`
	for _, c := range []struct {
		name              string
		schema, functions int
		is                error
	}{
		{"schema only", want + 1, want, idem.ErrSchemaNewer},
		{"functions only", want, want + 1, idem.ErrNotMigrated},
		{"both older", want - 1, want - 1, idem.ErrNotMigrated},
		{"schema newer, functions older", want + 1, want - 1, idem.ErrSchemaNewer},
		{"schema +2, functions +1", want + 2, want + 1, idem.ErrSchemaNewer},
	} {
		t.Run(c.name, func(t *testing.T) {
			owner, url := pgtest.NewPool(t, 2)
			app := newPool(t, pgtest.LoginRole(t, url, "idem_app"))
			servesNext(t, owner, c.schema, c.functions, yes)
			if err := idem.CheckSchema(ctx, app); !errors.Is(err, c.is) {
				t.Errorf("schema %d functions %d: %v; want %v", c.schema, c.functions, err, c.is)
			}
		})
	}
	// idem_operator may ask too (server keys).
	owner, url := pgtest.NewPool(t, 2)
	op := newPool(t, pgtest.LoginRole(t, url, "idem_operator"))
	servesNext(t, owner, want+1, want+1, `RETURN p_version BETWEEN `+fmt.Sprint(want)+` AND `+fmt.Sprint(want+1)+`;`)
	if err := idem.CheckSchema(ctx, op); err != nil {
		t.Errorf("CheckSchema as idem_operator on a newer release that serves this one: %v", err)
	}
}

// TestCheckSchemaInATransactionChangesNothing: CheckSchema "changes nothing (the application
// role may call it)": on a newer release without idem_serves_version it must not leave the
// caller's transaction aborted.
func TestCheckSchemaInATransactionChangesNothing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	owner, url := pgtest.NewPool(t, 4)
	app := newPool(t, pgtest.LoginRole(t, url, "idem_app"))
	want := idem.SchemaVersion()
	servesNext(t, owner, want+1, want+1, "")
	pgtest.Exec(t, owner, `DROP FUNCTION idem.idem_serves_version(integer)`)
	tx, err := app.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if err := idem.CheckSchema(ctx, tx); !errors.Is(err, idem.ErrSchemaNewer) {
		t.Fatalf("CheckSchema: %v", err)
	}
	if _, err := tx.Exec(ctx, `SELECT 1`); err != nil {
		t.Errorf("the caller's transaction after CheckSchema refused a newer schema: %v", err)
	}
}

package idem_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/idem/idemmigrate"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestCheckSchemaKeepsCallersSameNameSavepoint (D207): CheckSchema "changes
// nothing" and leaves a caller's transaction as it was. A caller whose transaction already has
// a savepoint named idem_check_schema (the name D207's savepoint uses) rolls back to its own
// savepoint after CheckSchema, both when the newer release's idem_serves_version raises and
// when it serves this code.
func TestCheckSchemaKeepsCallersSameNameSavepoint(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	owner, url := pgtest.NewPool(t, 4)
	app := newPool(t, pgtest.LoginRole(t, url, "idem_app"))
	want := idem.SchemaVersion()
	for _, c := range []struct {
		name, serves string
		ok           bool
	}{
		{"raising", `RAISE EXCEPTION 'broken';`, false},
		{"serving", `RETURN p_version BETWEEN 1 AND 1000;`, true},
	} {
		servesNext(t, owner, want+1, want+1, c.serves)
		tx, err := app.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		for _, s := range []string{
			`CREATE TEMP TABLE mine (v int) ON COMMIT DROP`,
			`INSERT INTO mine VALUES (1)`,
			`SAVEPOINT idem_check_schema`,
			`INSERT INTO mine VALUES (2)`,
		} {
			if _, err := tx.Exec(ctx, s); err != nil {
				t.Fatalf("%s: %s: %v", c.name, s, err)
			}
		}
		err = idem.CheckSchema(ctx, tx)
		if c.ok && err != nil || !c.ok && !errors.Is(err, idem.ErrSchemaNewer) {
			t.Errorf("%s: CheckSchema: %v", c.name, err)
		}
		if _, err := tx.Exec(ctx, `INSERT INTO mine VALUES (3)`); err != nil {
			t.Fatalf("%s: the caller's transaction after CheckSchema: %v", c.name, err)
		}
		if _, err := tx.Exec(ctx, `ROLLBACK TO SAVEPOINT idem_check_schema`); err != nil {
			t.Fatalf("%s: the caller's own savepoint after CheckSchema: %v", c.name, err)
		}
		var got string
		if err := tx.QueryRow(ctx, `SELECT string_agg(v::text, ',' ORDER BY v) FROM mine`).Scan(&got); err != nil {
			t.Fatal(err)
		}
		if got != "1" {
			t.Errorf("%s: after ROLLBACK TO the caller's savepoint idem_check_schema: rows %q, want \"1\"", c.name, got)
		}
		_ = tx.Rollback(ctx)
	}
}

// poolWrapper hides a *pgxpool.Pool behind idem.Querier, as a tracing wrapper would.
type poolWrapper struct{ idem.Querier }

// TestCheckSchemaWrappedPoolLeavesNothingOpen (D207): behind a wrapper that hides
// a pool, CheckSchema's savepoint asks (25P01 outside a block) and changes nothing: the answer
// is the serves function's, and no connection of the pool is left in a transaction.
func TestCheckSchemaWrappedPoolLeavesNothingOpen(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	owner, url := pgtest.NewPool(t, 4)
	appURL := pgtest.LoginRole(t, url, "idem_app")
	app := newPool(t, appURL)
	want := idem.SchemaVersion()
	servesNext(t, owner, want+1, want+1, `RETURN true;`)
	for i := range 5 {
		if err := idem.CheckSchema(ctx, poolWrapper{app}); err != nil {
			t.Fatalf("run %d: CheckSchema behind a pool wrapper, serving: %v", i, err)
		}
	}
	servesNext(t, owner, want+1, want+1, `RAISE EXCEPTION 'broken';`)
	if err := idem.CheckSchema(ctx, poolWrapper{app}); !errors.Is(err, idem.ErrSchemaNewer) {
		t.Errorf("behind a pool wrapper, raising: %v, want ErrSchemaNewer", err)
	}
	if n := pgtest.Count(t, owner, `SELECT count(*) FROM pg_stat_activity WHERE usename = $1 AND state LIKE 'idle in transaction%'`,
		roleOf(t, appURL)); n != 0 {
		t.Errorf("%d connections of the pool left idle in a transaction", n)
	}
}

// TestStartChecksCustomAppRole (D209): the start checks ask has_function_privilege,
// not the role's name: a database migrated with a custom AppRole (idemmigrate.Options.AppRole)
// serves a member of that role through New, StartCleaner and Do, and still refuses a member of
// the operator role alone.
func TestStartChecksCustomAppRole(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.NewEmptyDB(t)
	admin := pgtest.Connect(t, url)
	role := fmt.Sprintf("custom_app_%d_%d", os.Getpid(), time.Now().UnixNano()%1e6)
	pgtest.Exec(t, admin, `CREATE ROLE `+role+` NOLOGIN`)
	t.Cleanup(func() {
		c, err := pgx.Connect(context.Background(), url)
		if err != nil {
			return
		}
		defer c.Close(context.Background())
		_, _ = c.Exec(context.Background(), `DROP OWNED BY `+role+`; DROP ROLE `+role)
	})
	if err := idemmigrate.Migrate(ctx, admin, idemmigrate.Options{AppRole: role}); err != nil {
		t.Fatal(err)
	}
	app := newPool(t, pgtest.LoginRole(t, url, role))
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	if _, err := idem.New(ctx, idem.Options{DB: app, Principal: alice, Logger: quiet}); err != nil {
		t.Errorf("New as a member of the custom app role: %v", err)
	}
	if c, err := idem.StartCleaner(ctx, app, idem.CleanerOptions{Interval: time.Hour, Logger: quiet}); err != nil {
		t.Errorf("StartCleaner as a member of the custom app role: %v", err)
	} else {
		c.Stop()
	}
	job := idem.Job{Principal: "p", Key: "k", Action: "a"}
	if v, _, err := idem.Do(ctx, app, job, idem.TxOptions{}, func(context.Context, pgx.Tx) (int, error) { return 1, nil }); err != nil || v != 1 {
		t.Errorf("Do as a member of the custom app role: %d %v", v, err)
	}
	ops := newPool(t, pgtest.LoginRole(t, url, "idem_operator"))
	if _, err := idem.New(ctx, idem.Options{DB: ops, Principal: alice, Logger: quiet}); !errors.Is(err, idem.ErrPermissionDenied) {
		t.Errorf("New as a member of idem_operator alone: %v, want ErrPermissionDenied", err)
	}
}

// TestSerializableStillHonoured (D210): RunTx and Do begin READ COMMITTED only
// when TxOptions name no level: TxOptions{IsoLevel: Serializable} still runs SERIALIZABLE,
// under a role whose default is REPEATABLE READ.
func TestSerializableStillHonoured(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.NewDB(t)
	appURL := pgtest.LoginRole(t, db, "idem_app")
	admin := pgtest.Connect(t, db)
	pgtest.Exec(t, admin, `ALTER ROLE `+roleOf(t, appURL)+` SET default_transaction_isolation = 'repeatable read'`)
	app := newPool(t, appURL)
	var level string
	opts := idem.TxOptions{TxOptions: pgx.TxOptions{IsoLevel: pgx.Serializable}}
	job := idem.Job{Principal: "p", Key: "ser-1", Action: "a"}
	if _, _, err := idem.Do(ctx, app, job, opts, func(ctx context.Context, tx pgx.Tx) (int, error) {
		return 1, tx.QueryRow(ctx, `SELECT current_setting('transaction_isolation')`).Scan(&level)
	}); err != nil {
		t.Fatal(err)
	}
	if level != "serializable" {
		t.Errorf("Do with TxOptions{IsoLevel: Serializable} ran at %q", level)
	}
	level = ""
	if err := idem.RunTx(ctx, app, opts, func(tx *idem.Tx) error {
		return tx.QueryRow(ctx, `SELECT current_setting('transaction_isolation')`).Scan(&level)
	}); err != nil {
		t.Fatal(err)
	}
	if level != "serializable" {
		t.Errorf("RunTx with TxOptions{IsoLevel: Serializable} ran at %q", level)
	}
}

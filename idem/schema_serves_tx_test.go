package idem_test

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// wrappedQuerier hides the connection behind idem.Querier's methods, as a tracing wrapper
// would: CheckSchema cannot see whether it runs in a transaction.
type wrappedQuerier struct{ idem.Querier }

// TestCheckSchemaRaisingServesLeavesCallersTx: CheckSchema changes nothing, so it leaves a
// caller's transaction as it was, also when a newer release's idem_serves_version raises
// (which serves nothing: ErrSchemaNewer). The caller's transaction was aborted (25P02), in a
// pgx.Tx, a transaction opened by hand on a *pgx.Conn and one behind a wrapper; the statements
// the transaction ran before stay.
func TestCheckSchemaRaisingServesLeavesCallersTx(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	owner, url := pgtest.NewPool(t, 4)
	appURL := pgtest.LoginRole(t, url, "idem_app")
	app := newPool(t, appURL)
	want := idem.SchemaVersion()
	servesNext(t, owner, want+1, want+1, `RAISE EXCEPTION 'broken';`)
	check := func(name string, q idem.Querier) {
		t.Helper()
		if _, err := q.Exec(ctx, `CREATE TEMP TABLE mine ON COMMIT DROP AS SELECT 7 AS v`); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if err := idem.CheckSchema(ctx, q); !errors.Is(err, idem.ErrSchemaNewer) {
			t.Errorf("%s: CheckSchema: %v; want ErrSchemaNewer", name, err)
		}
		var v int
		if err := q.QueryRow(ctx, `SELECT v FROM mine`).Scan(&v); err != nil || v != 7 {
			t.Errorf("%s: the caller's transaction after CheckSchema met a raising idem_serves_version: %d, %v; want its own row, usable", name, v, err)
		}
	}

	tx, err := app.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	check("pgx.Tx", tx)

	conn, err := pgx.Connect(ctx, appURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, `BEGIN`); err != nil {
		t.Fatal(err)
	}
	check("BEGIN on a *pgx.Conn", conn)
	if _, err := conn.Exec(ctx, `ROLLBACK`); err != nil {
		t.Fatal(err)
	}

	wtx, err := app.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer wtx.Rollback(ctx)
	check("a wrapped pgx.Tx", wrappedQuerier{wtx})

	// Outside a transaction nothing is left open either: the next statement on the connection
	// runs on its own (a savepoint there would have failed, 25P01).
	if err := idem.CheckSchema(ctx, wrappedQuerier{conn}); !errors.Is(err, idem.ErrSchemaNewer) {
		t.Errorf("a wrapped *pgx.Conn outside a transaction: CheckSchema: %v; want ErrSchemaNewer", err)
	}
	if conn.PgConn().TxStatus() != 'I' {
		t.Errorf("a wrapped *pgx.Conn outside a transaction: left in transaction state %q", conn.PgConn().TxStatus())
	}
}

// TestServesVersionArguments: idem_serves_version, as idem_app and as idem_operator, answers
// true exactly from 5 (release 0.2.0's version) to this release's, false around them, and
// refuses a NULL version with 22004 as every required argument of the API is refused (it
// answered NULL, which a caller could read as "not false").
func TestServesVersionArguments(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, url := pgtest.NewPool(t, 2)
	for _, role := range []string{"idem_app", "idem_operator"} {
		p := newPool(t, pgtest.LoginRole(t, url, role))
		var got *bool
		err := p.QueryRow(ctx, `SELECT idem.idem_serves_version(NULL)`).Scan(&got)
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "22004" {
			t.Errorf("%s: idem_serves_version(NULL) = %v, %v; want SQLSTATE 22004", role, got, err)
		}
		for _, c := range []struct {
			arg  int32
			want bool
		}{
			{4, false}, {5, true}, {int32(idem.SchemaVersion()), true}, {int32(idem.SchemaVersion()) + 1, false},
			{-1, false}, {-2147483648, false}, {2147483647, false},
		} {
			if err := p.QueryRow(ctx, `SELECT idem.idem_serves_version($1)`, c.arg).Scan(&got); err != nil {
				t.Errorf("%s: idem_serves_version(%d): %v", role, c.arg, err)
				continue
			}
			if got == nil || *got != c.want {
				t.Errorf("%s: idem_serves_version(%d) = %v; want %v", role, c.arg, fmt.Sprint(got), c.want)
			}
		}
	}
}

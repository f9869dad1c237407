package tests

// Hostile input, round two: the SQL API as idem_app and idem_operator see it. Every
// argument of every granted function NULL in turn (docs/sql-api.md, "SQLSTATEs": 22004 is
// raised by "all but idem_defaults" when "a required argument is NULL"), and nothing written.

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/internal/pgtest"
)

type argCall struct {
	fn       string   // how the call is written, %s for each argument
	args     []string // good values
	optional []bool   // NULL is a documented value (a default) for this argument
	valid    string   // what the call with good values gives: "ok" or a SQLSTATE
}

func sqlstateOf(ctx context.Context, c *pgx.Conn, sql string) string {
	tx, err := c.Begin(ctx)
	if err != nil {
		return "begin: " + err.Error()
	}
	defer tx.Rollback(ctx)
	rows, err := tx.Query(ctx, sql)
	if err == nil {
		for rows.Next() {
		}
		rows.Close()
		err = rows.Err()
	}
	if err != nil {
		return sqlCode(err)
	}
	return "ok"
}

// TestEveryRequiredArgumentNull: each argument of each function NULL in turn, as the role that
// may call it (22004), and principals and keys out of range (22023); nothing written. Passes:
// it pins the whole table at once.
func TestEveryRequiredArgumentNull(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	app, admin, url, _ := appSession(t, false)
	ops := pgtest.Connect(t, pgtest.LoginRole(t, url, "idem_operator"))
	appCalls := []argCall{
		{fn: `SELECT * FROM idem.idem_begin(%s, %s, %s, %s, %s, %s, %s, %s)`,
			args:     []string{`'p'`, `'k'`, `'a'`, `sha256('x')`, `'1 hour'`, `'1 minute'`, `'{}'`, `'1 s'`},
			optional: []bool{false, false, false, false, true, true, true, true}, valid: "ok"},
		{fn: `SELECT * FROM idem.idem_begin_steps(%s, %s, %s, %s, %s, %s, %s, %s)`,
			args:     []string{`'p'`, `'k'`, `'a'`, `sha256('x')`, `'1 hour'`, `'1 minute'`, `'{}'`, `'1 s'`},
			optional: []bool{false, false, false, false, true, true, true, true}, valid: "ok"},
		{fn: `SELECT idem.idem_complete(%s, %s, %s, %s, %s, %s, %s, %s)`,
			args:     []string{`'p'`, `'k'`, `1`, `200`, `'{}'`, `'b'`, `'r'`, `NULL`},
			optional: []bool{false, false, false, false, false, true, true, true}, valid: "55000"},
		{fn: `SELECT idem.idem_save_final(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)`,
			args:     []string{`'p'`, `'k'`, `'a'`, `sha256('x')`, `'1 hour'`, `404`, `'{}'`, `'b'`, `'{}'`, `NULL`, `'r'`},
			optional: []bool{false, false, false, false, true, false, false, true, true, true, true}, valid: "ok"},
		{fn: `SELECT idem.idem_release(%s, %s, %s)`, args: []string{`'p'`, `'k'`, `1`}, optional: []bool{false, false, false}, valid: "ok"},
		{fn: `SELECT idem.idem_yield(%s, %s, %s)`, args: []string{`'p'`, `'k'`, `1`}, optional: []bool{false, false, false}, valid: "ok"},
		{fn: `SELECT idem.idem_extend(%s, %s, %s, %s)`, args: []string{`'p'`, `'k'`, `1`, `'1 minute'`}, optional: []bool{false, false, false, false}, valid: "55000"},
		{fn: `SELECT idem.idem_step(%s, %s, %s, %s, %s)`, args: []string{`'p'`, `'k'`, `1`, `'s'`, `'1'`}, optional: []bool{false, false, false, false, true}, valid: "55000"},
		{fn: `SELECT * FROM idem.idem_recovery(%s, %s, %s)`, args: []string{`'p'`, `'k'`, `1`}, optional: []bool{false, false, false}, valid: "55000"},
		{fn: `SELECT idem.idem_cleanup(%s)`, args: []string{`10`}, optional: []bool{false}, valid: "ok"},
		{fn: `SELECT * FROM idem.idem_cleanup_workers(%s, %s, %s)`, args: []string{`10`, `1`, `'1 s'`}, optional: []bool{false, false, false}, valid: "ok"},
		{fn: `SELECT * FROM idem.idem_key(%s, %s)`, args: []string{`'p'`, `'k'`}, optional: []bool{false, false}, valid: "ok"},
	}
	opsCalls := []argCall{
		{fn: `SELECT idem.idem_key_body(%s, %s)`, args: []string{`'p'`, `'k'`}, optional: []bool{false, false}, valid: "ok"},
		{fn: `SELECT * FROM idem.idem_stuck(%s, %s)`, args: []string{`'0'`, `10`}, optional: []bool{false, false}, valid: "ok"},
		{fn: `SELECT idem.idem_release_stuck(%s, %s, %s, %s)`, args: []string{`'p'`, `'k'`, `1`, `'why'`}, optional: []bool{false, false, false, true}, valid: "55000"},
	}
	var bad []string
	check := func(conn *pgx.Conn, calls []argCall) {
		for _, c := range calls {
			render := func(null int) string {
				a := make([]any, len(c.args))
				for i, v := range c.args {
					a[i] = v
					if i == null {
						a[i] = "NULL"
					}
				}
				return fmt.Sprintf(c.fn, a...)
			}
			if got := sqlstateOf(ctx, conn, render(-1)); got != c.valid {
				t.Fatalf("%s: %s, want %s (the test's own good call)", render(-1), got, c.valid)
			}
			for i := range c.args {
				if c.args[i] == "NULL" {
					continue
				}
				sql := render(i)
				got := sqlstateOf(ctx, conn, sql)
				switch {
				case c.optional[i] && got != c.valid && got != "ok":
					bad = append(bad, fmt.Sprintf("%s: %s, want %s (NULL is this argument's default)", sql, got, c.valid))
				case !c.optional[i] && got != "22004":
					bad = append(bad, fmt.Sprintf("%s: %s, want 22004 (a required argument is NULL)", sql, got))
				}
			}
		}
	}
	check(app, appCalls)
	check(ops, opsCalls)
	// Out of range, for every function that takes a principal and a key: 22023, as the table's
	// "empty or over-long principal; key that is empty, over 255 bytes or not visible ASCII".
	for _, set := range []struct {
		conn  *pgx.Conn
		calls []argCall
	}{{app, appCalls}, {ops, opsCalls}} {
		for _, c := range set.calls {
			if len(c.args) < 2 || c.args[0] != `'p'` || c.args[1] != `'k'` {
				continue
			}
			for _, pk := range [][2]string{
				{`repeat('é', 256)`, `'k'`}, {`''`, `'k'`}, {`'p'`, `repeat('k', 256)`}, {`'p'`, `''`},
				{`'p'`, `'k k'`}, {`'p'`, `'ké'`}, {`'p'`, `E'k\x7f'`}, {`'p'`, `E'\u200bk'`},
			} {
				a := make([]any, len(c.args))
				for i, v := range c.args {
					a[i] = v
				}
				a[0], a[1] = pk[0], pk[1]
				sql := fmt.Sprintf(c.fn, a...)
				if got := sqlstateOf(ctx, set.conn, sql); got != "22023" {
					bad = append(bad, fmt.Sprintf("%s: %s, want 22023 (out of range)", sql, got))
				}
			}
		}
	}
	if n := pgtest.Count(t, admin, `SELECT count(*) FROM idem.idempotency_keys`); n != 0 {
		t.Errorf("%d rows written by calls that all rolled back", n)
	}
	if len(bad) > 0 {
		t.Errorf("%d calls with a NULL or out-of-range argument did not raise the documented SQLSTATE:\n%s", len(bad), strings.Join(bad, "\n"))
	}
}

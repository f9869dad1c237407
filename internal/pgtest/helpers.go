package pgtest

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Querier is what the helpers need: a pool, a connection or a transaction.
type Querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// Count runs a query that returns one integer and fails the test on an error.
func Count(t testing.TB, q Querier, sql string, args ...any) int {
	t.Helper()
	var n int
	if err := q.QueryRow(context.Background(), sql, args...).Scan(&n); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	return n
}

// Exec runs a statement and fails the test on an error.
func Exec(t testing.TB, q Querier, sql string, args ...any) {
	t.Helper()
	if _, err := q.Exec(context.Background(), sql, args...); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}

// InsertExpired writes n completed keys of principal, named old-1 to old-n, whose TTL ran
// out a day ago (expires_at one millisecond apart, oldest first), straight into the key
// table (the test's role owns it).
func InsertExpired(t testing.TB, q Querier, principal string, n int) {
	t.Helper()
	Exec(t, q, `INSERT INTO idem.idempotency_keys (expires_at, attempt, action_hash, state, principal_id, key,
		request_sha256, response_status, response_headers)
		SELECT now() - interval '1 day' + i * interval '1 ms', nextval('idem.token_seq'), 0, 'c', $1, 'old-' || i,
		       sha256(i::text::bytea), 200, '{}'
		  FROM generate_series(1, $2) AS i`, principal, n)
}

// WaitUntilBlocked returns once the backend pid waits on a lock (pg_stat_activity says so),
// and fails the test after 10 seconds.
func WaitUntilBlocked(t testing.TB, q Querier, pid uint32) {
	t.Helper()
	WaitFor(t, q, `SELECT count(*) FROM pg_stat_activity WHERE pid = $1 AND wait_event_type = 'Lock'`, pid)
}

// KeyWaiters counts the other sessions of the test's database whose idem_begin has waited on
// a lock for more than 100 ms: a claim's second try, which waits on another holder of the key
// (the Gate's first try, its probe, gives up after 5 ms). Wait for it with WaitFor before a
// step that must find the claim in that wait (the wait, not the statement, counts:
// pg_locks.waitstart).
const KeyWaiters = `SELECT count(*) FROM pg_stat_activity AS a JOIN pg_locks AS l ON l.pid = a.pid AND NOT l.granted
	WHERE a.datname = current_database() AND a.query LIKE '%idem_begin%' AND a.pid <> pg_backend_pid()
	AND clock_timestamp() - l.waitstart > interval '100 ms'`

// WaitFor polls a query that returns an integer until it is above zero, and fails the test
// after 10 seconds. Each poll reads fresh statistics: inside a transaction, pg_stat_activity's
// state and query are otherwise a snapshot of its first read (only the wait events are live).
func WaitFor(t testing.TB, q Querier, sql string, args ...any) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		_, _ = q.Exec(context.Background(), `SELECT pg_stat_clear_snapshot()`)
		if Count(t, q, sql, args...) > 0 {
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
	t.Fatalf("never true: %s %v%s", sql, args, activity(q))
}

// activity is what the sessions of q's database are doing, for a failure's message.
func activity(q Querier) string {
	_, _ = q.Exec(context.Background(), `SELECT pg_stat_clear_snapshot()`)
	var list string
	err := q.QueryRow(context.Background(), `SELECT coalesce(string_agg(format(E'\n  %s %s %s %s', pid, state,
		wait_event_type || '/' || wait_event, left(regexp_replace(query, '\s+', ' ', 'g'), 100)), '' ORDER BY pid), '')
		  FROM pg_stat_activity WHERE datname = current_database()`).Scan(&list)
	if err != nil {
		return fmt.Sprintf("\n(the sessions could not be listed: %v)", err)
	}
	return "\nthe sessions of the database (pid, state, wait, query):" + list
}

// CitusStandIn makes the test's database behave, for cleanup and for the operators' figures,
// as a Citus coordinator with two workers (groups 1 and 2) whose key relations are
// idem.keys_w1 and idem.keys_w2 (created here, of the key table's shape): it replaces the
// functions that read Citus' catalog or reach the workers (idem.node_group,
// idem.worker_groups, idem.key_relations, idem.cleanup_on_workers,
// idem.cleanup_pass_on_workers, idem.figures_on_workers) with stand-ins. A "worker" is the
// same database with idem.test_group set to its group: cleanup_on_workers and
// figures_on_workers run its cleanup_share or key_figures in the calling session;
// cleanup_pass_on_workers sends the command a coordinator sends (CALL idem.cleanup_node) to
// two sessions of their own at once, through dblink (created here), as Citus does, so that
// they commit batch by batch. Everything else, the fan-outs of idem_cleanup,
// idem_cleanup_workers, idem_health and idem_summary included, is the real code. q is a
// *pgx.Conn, a *pgxpool.Pool or a pgx.Tx (its connection string reaches the "workers").
func CitusStandIn(t testing.TB, q Querier) {
	t.Helper()
	var url string
	switch c := q.(type) {
	case *pgx.Conn:
		url = c.Config().ConnString()
	case *pgxpool.Pool:
		url = c.Config().ConnConfig.ConnString()
	case pgx.Tx:
		url = c.Conn().Config().ConnString()
	default:
		t.Fatalf("pgtest.CitusStandIn: %T: want a *pgx.Conn, a *pgxpool.Pool or a pgx.Tx", q)
	}
	Exec(t, q, `CREATE EXTENSION IF NOT EXISTS dblink;
		CREATE TABLE idem.keys_w1 (LIKE idem.idempotency_keys INCLUDING ALL);
		CREATE TABLE idem.keys_w2 (LIKE idem.idempotency_keys INCLUDING ALL);
		CREATE OR REPLACE FUNCTION idem.node_group() RETURNS integer LANGUAGE sql STABLE
			AS $$ SELECT coalesce(nullif(current_setting('idem.test_group', true), ''), '0')::integer $$;
		CREATE OR REPLACE FUNCTION idem.worker_groups() RETURNS integer[] LANGUAGE sql STABLE
			AS $$ SELECT CASE WHEN idem.node_group() = 0 THEN '{1,2}'::integer[] ELSE '{}' END $$;
		CREATE OR REPLACE FUNCTION idem.key_relations() RETURNS regclass[] LANGUAGE sql STABLE
			AS $$ SELECT CASE idem.node_group() WHEN 1 THEN ARRAY['idem.keys_w1'::regclass]
			                                     WHEN 2 THEN ARRAY['idem.keys_w2'::regclass] ELSE '{}' END $$;
		CREATE OR REPLACE FUNCTION idem.cleanup_on_workers(p_shares jsonb) RETURNS SETOF text LANGUAGE plpgsql AS $$
		DECLARE
			v_group integer;
			v_result text;
		BEGIN
			FOREACH v_group IN ARRAY ARRAY[1, 2] LOOP
				PERFORM set_config('idem.test_group', v_group::text, true);
				v_result := idem.cleanup_share(p_shares);
				RETURN NEXT v_result;
			END LOOP;
			PERFORM set_config('idem.test_group', '0', true);
		END $$;
		CREATE OR REPLACE FUNCTION idem.figures_on_workers(p_counts boolean) RETURNS SETOF jsonb LANGUAGE plpgsql AS $$
		DECLARE
			v_group integer;
			v_result jsonb;
		BEGIN
			FOREACH v_group IN ARRAY ARRAY[1, 2] LOOP
				PERFORM set_config('idem.test_group', v_group::text, true);
				v_result := idem.key_figures(idem.key_relations(), p_counts);
				RETURN NEXT v_result;
			END LOOP;
			PERFORM set_config('idem.test_group', '0', true);
		END $$`)
	Exec(t, q, fmt.Sprintf(`CREATE OR REPLACE FUNCTION idem.cleanup_pass_on_workers(p_batch_size integer, p_duty double precision,
			p_seconds double precision) RETURNS SETOF text LANGUAGE plpgsql AS $f$
		DECLARE
			v_group integer;
			v_result text;
		BEGIN
			FOREACH v_group IN ARRAY ARRAY[1, 2] LOOP
				PERFORM public.dblink_connect('idem_w' || v_group, %[1]s);
				PERFORM public.dblink_exec('idem_w' || v_group, format('SET idem.test_group = %%s', v_group));
				PERFORM public.dblink_send_query('idem_w' || v_group,
					format('CALL idem.cleanup_node(%%s, %%L::float8, %%L::float8)', p_batch_size, p_duty, p_seconds));
			END LOOP;
			FOREACH v_group IN ARRAY ARRAY[1, 2] LOOP
				SELECT r.p_result INTO v_result FROM public.dblink_get_result('idem_w' || v_group) AS r(p_result text);
				PERFORM public.dblink_disconnect('idem_w' || v_group);
				RETURN NEXT v_result;
			END LOOP;
		END $f$`, quoteLiteral(url)))
}

// quoteLiteral quotes s as an SQL string literal.
func quoteLiteral(s string) string {
	return "'" + strings.ReplaceAll(s, "'", "''") + "'"
}

// InsertKeys writes n completed keys of principal into rel (idem.idempotency_keys or a
// relation of its shape), named prefix-1 to prefix-n, expired a day ago when expired, else
// live for a day.
func InsertKeys(t testing.TB, q Querier, rel, principal, prefix string, n int, expired bool) {
	t.Helper()
	at := "now() + interval '1 day'"
	if expired {
		at = "now() - interval '1 day' + i * interval '1 ms'"
	}
	Exec(t, q, `INSERT INTO `+rel+` (expires_at, attempt, action_hash, state, principal_id, key,
		request_sha256, response_status, response_headers)
		SELECT `+at+`, nextval('idem.token_seq'), 0, 'c', $1, $2 || '-' || i, sha256(i::text::bytea), 200, '{}'
		  FROM generate_series(1, $3) AS i`, principal, prefix, n)
}

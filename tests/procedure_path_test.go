package tests

import (
	"context"
	"fmt"
	"testing"

	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestProceduresPinTheirPath: the three procedures that commit (and so carry no SET clause) run
// as whoever calls them: the owner, for idem_new_installation_secret and cleanup_node. A
// function or operator that another role put in a schema on the caller's search_path, and that
// matches one of their calls more exactly than PostgreSQL's own (format(text, text),
// ||(text[], text), >(double precision, integer)), ran with the caller's rights: a role allowed
// to create in public got the owner to grant it the key table. Each procedure now pins
// search_path for each of its transactions. Asserted: with such objects planted in public (on
// the default search_path), every procedure completes and none of the planted ones ran; the
// caller's search_path is its own again after each call. D252; before it,
// idem_new_installation_secret and cleanup_node raised the planted functions' errors.
func TestProceduresPinTheirPath(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := pgtest.NewDB(t)
	conn := pgtest.Connect(t, url)
	pgtest.Exec(t, conn, `
CREATE FUNCTION public.format(a text, b text) RETURNS text LANGUAGE plpgsql AS
  $$BEGIN RAISE EXCEPTION 'planted format(text, text) ran as %', current_user; END$$;
CREATE FUNCTION public.planted_cat(a text[], b text) RETURNS text[] LANGUAGE plpgsql AS
  $$BEGIN RAISE EXCEPTION 'planted ||(text[], text) ran as %', current_user; END$$;
CREATE OPERATOR public.|| (LEFTARG = text[], RIGHTARG = text, FUNCTION = public.planted_cat);
CREATE FUNCTION public.planted_gt(a double precision, b integer) RETURNS boolean LANGUAGE plpgsql AS
  $$BEGIN RAISE EXCEPTION 'planted >(double precision, integer) ran as %', current_user; END$$;
CREATE OPERATOR public.> (LEFTARG = double precision, RIGHTARG = integer, FUNCTION = public.planted_gt);
CREATE FUNCTION public.planted_oideq(a oid, b integer) RETURNS boolean LANGUAGE plpgsql AS
  $$BEGIN RAISE EXCEPTION 'planted =(oid, integer) ran as %', current_user; END$$;
CREATE OPERATOR public.= (LEFTARG = oid, RIGHTARG = integer, FUNCTION = public.planted_oideq);
CREATE FUNCTION public.planted_lt(a double precision, b integer) RETURNS boolean LANGUAGE plpgsql AS
  $$BEGIN RAISE EXCEPTION 'planted <(double precision, integer) ran as %', current_user; END$$;
CREATE OPERATOR public.< (LEFTARG = double precision, RIGHTARG = integer, FUNCTION = public.planted_lt);`)
	// Every routine of the schema pins its path: a SET clause, or (a procedure that commits)
	// a set_config in each transaction, first thing and right after every COMMIT; answer_expires_at qualifies every name instead (an
	// IMMUTABLE SQL function the planner inlines, which a SET clause would stop).
	var unpinned []string
	rows, err := conn.Query(ctx, `SELECT p.oid::regprocedure::text FROM pg_proc AS p
		WHERE p.pronamespace = 'idem'::regnamespace AND p.proname <> 'answer_expires_at'
		  AND NOT coalesce('search_path=pg_catalog, pg_temp' = ANY (p.proconfig), false)
		  AND NOT (p.prokind = 'p'
		           -- first thing, and again after every COMMIT
		           AND p.prosrc ~ '\mBEGIN\s+PERFORM pg_catalog\.set_config\(''search_path'', ''pg_catalog, pg_temp'', true\);'
		           AND (SELECT count(*) FROM regexp_matches(p.prosrc, '\mCOMMIT;', 'g'))
		               = (SELECT count(*) FROM regexp_matches(p.prosrc, '\mCOMMIT;(\s*--[^\n]*)?\s*PERFORM pg_catalog\.set_config\(''search_path'', ''pg_catalog, pg_temp'', true\);', 'g')))
		ORDER BY 1`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var name string
		if err := rows.Scan(&name); err != nil {
			t.Fatal(err)
		}
		unpinned = append(unpinned, name)
	}
	if rows.Err() != nil || len(unpinned) > 0 {
		t.Errorf("routines of schema idem that pin no search_path: %s (%v)", fmt.Sprint(unpinned), rows.Err())
	}
	// The planted objects are found where the caller's path reaches them: the test would prove
	// nothing if they were not.
	var path string
	if err := conn.QueryRow(ctx, `SHOW search_path`).Scan(&path); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, `SELECT ARRAY['a'] || 'b'::text`); err == nil {
		t.Fatalf("the planted operator is not reached on the search_path %q", path)
	}
	// More expired keys than a batch: cleanup_node and idem_cleanup_all go through several
	// transactions, each after a COMMIT (cleanup_node's pause between batches compares
	// double precision with integer: the planted < above).
	pgtest.InsertExpired(t, conn, "alice", 35)
	for _, call := range []string{
		`CALL idem.idem_new_installation_secret(p_wait => interval '30 seconds')`,
		`CALL idem.cleanup_node(10, 0.5, 1, NULL)`,
		`CALL idem.idem_cleanup_all(10)`,
	} {
		if call == `CALL idem.idem_cleanup_all(10)` {
			pgtest.InsertExpired(t, conn, "bob", 35)
		}
		if _, err := conn.Exec(ctx, call); err != nil {
			t.Errorf("%s with objects planted in public: %v", call, err)
		}
		var after string
		if err := conn.QueryRow(ctx, `SHOW search_path`).Scan(&after); err != nil || after != path {
			t.Errorf("after %s the session's search_path is %q (%v), want its own %q", call, after, err, path)
		}
	}
	// Each cleanup went through its batches, each its own transaction after a COMMIT.
	if n := pgtest.Count(t, conn, `SELECT count(*) FROM idem.idempotency_keys`); n != 0 {
		t.Errorf("%d expired keys left: the cleanups did not run batch after batch", n)
	}
}

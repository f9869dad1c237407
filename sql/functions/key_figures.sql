-- The figures of the keys that idem_health and idem_summary report, node by node: on plain
-- PostgreSQL the key table's; on a Citus coordinator its own shards' (usually none) and every
-- worker's, asked in one round (figures_on_workers) and added up by the caller. So the
-- operators' view is of the whole cluster on a coordinator (on a worker: that worker's shards').

-- key_figures: the cheap figures of the keys in these relations (key_relations() of this
-- node), as jsonb: the lease claims in progress, those whose lease ran out, the oldest
-- claim's time (through the index on claimed_at, which holds lease claims only), the
-- expired keys waiting for cleanup (through the index on expires_at, counted up to a million
-- over all the relations), and their size (indexes and TOAST included) and estimated rows.
-- Without p_counts only the size and the estimate (no index is read). Internal (not
-- granted): it accepts only tables in schema idem.
--
-- On a Citus node, Citus hides the shards from an ordinary session's pg_class: when a query
-- that reads pg_class is planned, it adds a filter that drops every shard, unless
-- citus.override_table_visibility is off (or the session's application_name is one of
-- citus.show_shards_for_app_name_prefixes; Citus' own sessions, such as run_command_on_workers',
-- see them). On a worker the estimate of its shards read 0 and the check of p_relations let
-- them through unchecked. So where the setting exists, the function turns it off for its own
-- queries of pg_class and sets it back to what it was before it returns (set_config's local
-- value would last until the end of the caller's transaction; an error rolls it back anyway).
-- Not a SET clause of the function: on PostgreSQL without Citus it would be a placeholder that
-- only a superuser may attach to a function (the owner of schema idem need not be one). The
-- estimate is planned at each call (EXECUTE), with the setting as it is then.
CREATE OR REPLACE FUNCTION idem.key_figures(p_relations regclass[], p_counts boolean)
RETURNS jsonb
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_problem     text;
    v_now         timestamptz := clock_timestamp();
    v_rel         regclass;
    v_in_progress bigint := 0::bigint;
    v_run_out     bigint := 0::bigint;
    v_oldest      timestamptz;
    v_backlog     bigint := 0::bigint;
    v_n           bigint;
    v_r           bigint;
    v_min         timestamptz;
    v_visibility  text := current_setting('citus.override_table_visibility', true); -- NULL without Citus
    v_estimate    bigint;
BEGIN
    IF v_visibility IS NOT NULL THEN
        PERFORM set_config('citus.override_table_visibility', 'off', true);
    END IF;
    v_problem := CASE
        WHEN p_relations IS NULL OR p_counts IS NULL
            THEN '22004 p_relations and p_counts must not be NULL'
        WHEN EXISTS (SELECT FROM unnest(p_relations) AS r JOIN pg_catalog.pg_class AS c ON c.oid = r
                      WHERE c.relnamespace <> 'idem'::regnamespace OR c.relkind <> 'r')
            THEN '22023 p_relations must name tables in schema idem'
    END;
{{ template "include/raise.sql" "key_figures" }}
    IF p_counts THEN
        FOREACH v_rel IN ARRAY p_relations LOOP
            EXECUTE format($q$
                SELECT count(*), count(*) FILTER (WHERE k.lease_expires_at <= $1), min(k.claimed_at)
                  FROM %s AS k
                 WHERE k.claimed_at IS NOT NULL AND k.state = 'p' AND (k.expires_at > $1 OR k.lease_expires_at > $1)
                $q$, v_rel) USING v_now INTO v_n, v_r, v_min;
            v_in_progress := v_in_progress + v_n;
            v_run_out := v_run_out + v_r;
            v_oldest := least(v_oldest, v_min);
            IF v_backlog < 1000000 THEN
                EXECUTE format($q$
                    SELECT count(*)
                      FROM (SELECT 1 FROM %s AS k
                             WHERE k.expires_at <= $1 AND (k.lease_expires_at IS NULL OR k.lease_expires_at <= $1)
                               AND k.uncompleted IS NULL
                             LIMIT $2) AS backlog
                    $q$, v_rel) USING v_now, 1000000 - v_backlog INTO v_n;
                v_backlog := v_backlog + v_n;
            END IF;
        END LOOP;
    END IF;
    EXECUTE $q$
        SELECT coalesce(sum(greatest(c.reltuples, 0)), 0)::bigint
          FROM unnest($1) AS r JOIN pg_catalog.pg_class AS c ON c.oid = r
        $q$ USING p_relations INTO v_estimate;
    IF v_visibility IS NOT NULL THEN
        PERFORM set_config('citus.override_table_visibility', v_visibility, true);
    END IF;
    RETURN jsonb_build_object(
        'in_progress', v_in_progress,
        'leases_run_out', v_run_out,
        'oldest_in_progress_at', v_oldest,
        'cleanup_backlog', v_backlog,
        'table_bytes', (SELECT coalesce(sum(pg_catalog.pg_total_relation_size(r)), 0)::bigint FROM unnest(p_relations) AS r),
        'estimated_keys', v_estimate);
END
$$;

COMMENT ON FUNCTION idem.key_figures(regclass[], boolean) IS
    'Internal: the cheap figures of the keys in these relations of schema idem (claims in progress, leases run out, the oldest, the cleanup backlog up to a million, size, estimated rows), as jsonb. Used by idem_health and idem_summary.';

-- figures_on_workers: asks every active primary Citus worker for the figures of the key
-- relations it holds (run_command_on_workers: one new session on each, in parallel) and
-- returns them; raises when one of them failed. It runs nothing else there. Internal.
CREATE OR REPLACE FUNCTION idem.figures_on_workers(p_counts boolean)
RETURNS SETOF jsonb
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_node    text;
    v_port    integer;
    v_success boolean;
    v_result  text;
BEGIN
    FOR v_node, v_port, v_success, v_result IN
        EXECUTE format('SELECT nodename::text, nodeport::integer, success, result FROM %I($1)', 'run_command_on_workers')
        USING format('SELECT idem.key_figures(idem.key_relations(), %L)', p_counts) LOOP
        IF NOT v_success THEN
            RAISE EXCEPTION 'idem: the worker %:% failed to report its keys'' figures: %', v_node, v_port, v_result
                USING ERRCODE = '58000';
        END IF;
        RETURN NEXT v_result::jsonb;
    END LOOP;
END
$$;

COMMENT ON FUNCTION idem.figures_on_workers(boolean) IS
    'Internal: every Citus worker''s key_figures of the key relations it holds; raises when one fails. Used by cluster_figures.';

-- cluster_figures: the figures of this node's key relations and, on a Citus coordinator whose
-- workers hold the key table, every worker's: one row per node. Internal.
CREATE OR REPLACE FUNCTION idem.cluster_figures(p_counts boolean)
RETURNS SETOF jsonb
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN NEXT idem.key_figures(idem.key_relations(), p_counts);
    IF cardinality(idem.worker_groups()) > 0 THEN
        RETURN QUERY SELECT f FROM idem.figures_on_workers(p_counts) AS f;
    END IF;
END
$$;

COMMENT ON FUNCTION idem.cluster_figures(boolean) IS
    'Internal: key_figures of this node and, on a Citus coordinator, of every worker, one row each. Used by idem_health and idem_summary.';

-- Cleanup: delete expired keys in batches.
--
-- idem.key_relations() names the relations that hold keys on this node: the table itself on
-- plain PostgreSQL; on a Citus node, each shard of it stored here. idem.cleanup_relations()
-- is the one code path that deletes from them; idem_cleanup() runs it on key_relations(),
-- and on a Citus coordinator also asks every worker for its share of the batch
-- (cleanup_workers), so the same call cleans a whole cluster. A row is expired when its TTL
-- has run out and no lease on it still runs (nor the time an answer is kept, D45).

-- key_relations: the key table, or its local shards when Citus distributes it. Not granted
-- to anyone: the functions that need it run as its owner.
CREATE OR REPLACE FUNCTION idem.key_relations()
RETURNS regclass[]
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_rels regclass[];
BEGIN
    IF EXISTS (SELECT FROM pg_catalog.pg_extension WHERE extname = 'citus') THEN
        -- Dynamic, names included: the Citus catalog exists only where the extension does
        -- (and plpgsql_check would look for it). NULL when the key table is not distributed.
        EXECUTE format($q$
            SELECT CASE WHEN EXISTS (SELECT FROM pg_catalog.%I
                                      WHERE logicalrelid = 'idem.idempotency_keys'::regclass)
                   THEN coalesce(array_agg(local.r ORDER BY local.r::text), '{}') END
              FROM (SELECT to_regclass(format('idem.%%I', 'idempotency_keys_' || s.shardid)) AS r
                      FROM pg_catalog.%I AS s
                     WHERE s.logicalrelid = 'idem.idempotency_keys'::regclass) AS local
             WHERE local.r IS NOT NULL
        $q$, 'pg_dist_partition', 'pg_dist_shard') INTO v_rels;
        IF v_rels IS NOT NULL THEN
            RETURN v_rels;
        END IF;
    END IF;
    RETURN ARRAY['idem.idempotency_keys'::regclass];
END
$$;

COMMENT ON FUNCTION idem.key_relations() IS
    'The relations that hold idempotency keys on this node: the table, or its local Citus shards. Used by idem_cleanup.';

-- cleanup_relations: delete at most p_batch_size expired rows from these relations, each
-- relation oldest expires_at first, skipping rows that other transactions hold, and return how
-- many. A transactional claim in progress is never expired: only its own transaction sees it
-- (uncompleted), and a cleanup called in that transaction must not delete it, or the
-- transaction would commit its work without its key. A relation that gives fewer rows than asked is drained; the next one is asked for the
-- rest. Internal (not granted): it accepts only tables in schema idem.
--
-- A batch reads the oldest expired rows from the expires_at index and deletes those, by ctid,
-- whatever the statistics say. The planner otherwise chooses by its estimate of how
-- many rows have expired, and the estimate is smallest exactly when cleanup matters: a table
-- analyzed while it was nearly empty, or before a backlog grew. With a small estimate it read
-- and sorted every expired row to pick the batch, or found the batch's rows for the DELETE by
-- walking every expired row of the index, so each batch cost the whole backlog (300,000
-- expired keys under load: 4,000 rows/s instead of 100,000; TestCleanupWalksTheIndex). The
-- DELETE needs no second expiry test: the subquery locked the rows it returns (FOR UPDATE
-- re-tests a row changed since the scan, on its newest version), so none of them can change
-- before the DELETE removes it. A row that another transaction changed and committed after
-- this statement began, and that is still expired, is locked but not deleted (its newest
-- version is not in the statement's snapshot): the batch comes back short, which a caller
-- reads as drained, and the next pass deletes it.
CREATE OR REPLACE FUNCTION idem.cleanup_relations(p_relations regclass[], p_batch_size integer)
RETURNS integer
{{ template "include/attributes.sql" . }}
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_sort = off
AS $$
DECLARE
    v_problem text;
    v_now     timestamptz;
    v_rel     regclass;
    v_n       integer;
    v_deleted integer := 0;
BEGIN
    v_problem := CASE
        WHEN p_batch_size IS NULL OR p_relations IS NULL
            THEN '22004 p_relations and p_batch_size must not be NULL'
        WHEN p_batch_size < 1
            THEN format('22023 p_batch_size must be at least 1, got %s', p_batch_size)
        WHEN EXISTS (SELECT FROM unnest(p_relations) AS r JOIN pg_catalog.pg_class AS c ON c.oid = r
                      WHERE c.relnamespace <> 'idem'::regnamespace OR c.relkind <> 'r')
            THEN '22023 p_relations must name tables in schema idem'
    END;
{{ template "include/raise.sql" "cleanup_relations" }}
    v_now := clock_timestamp();
    FOREACH v_rel IN ARRAY p_relations LOOP
        EXECUTE format($q$
            DELETE FROM %1$s AS k
             WHERE k.ctid = ANY (ARRAY(
                    SELECT c.ctid FROM %1$s AS c
                     WHERE c.expires_at <= $1 AND (c.lease_expires_at IS NULL OR c.lease_expires_at <= $1)
                       AND c.uncompleted IS NULL
                     ORDER BY c.expires_at
                     LIMIT $2
                       FOR UPDATE SKIP LOCKED))
            $q$, v_rel) USING v_now, p_batch_size - v_deleted;
        GET DIAGNOSTICS v_n = ROW_COUNT;
        v_deleted := v_deleted + v_n;
        EXIT WHEN v_deleted >= p_batch_size;
    END LOOP;
    RETURN v_deleted;
END
$$;

COMMENT ON FUNCTION idem.cleanup_relations(regclass[], integer) IS
    'Internal: deletes at most p_batch_size expired keys from these tables of schema idem. Use idem_cleanup.';

-- node_group: this node's Citus group (0 on the coordinator); NULL without Citus. Internal.
CREATE OR REPLACE FUNCTION idem.node_group()
RETURNS integer
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_group integer;
BEGIN
    IF EXISTS (SELECT FROM pg_catalog.pg_extension WHERE extname = 'citus') THEN
        EXECUTE format('SELECT groupid FROM pg_catalog.%I', 'pg_dist_local_group') INTO v_group;
    END IF;
    RETURN v_group;
END
$$;

COMMENT ON FUNCTION idem.node_group() IS
    'Internal: this node''s Citus group (0 on the coordinator), NULL without Citus. Used by cleanup.';

-- worker_groups: on a Citus coordinator where the key table is distributed, the groups of the
-- active primary workers, which hold its shards; '{}' on plain PostgreSQL and on a worker.
-- Internal.
CREATE OR REPLACE FUNCTION idem.worker_groups()
RETURNS integer[]
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_groups integer[] := '{}'::integer[];
    v_group  integer;
BEGIN
    IF idem.node_group() IS DISTINCT FROM 0 THEN
        RETURN v_groups;
    END IF;
    FOR v_group IN EXECUTE format($q$
        SELECT DISTINCT n.groupid::integer
          FROM pg_catalog.%I AS n
         WHERE n.isactive AND n.noderole = 'primary' AND n.groupid <> 0
           AND EXISTS (SELECT FROM pg_catalog.%I AS p WHERE p.logicalrelid = 'idem.idempotency_keys'::regclass)
         ORDER BY 1
    $q$, 'pg_dist_node', 'pg_dist_partition') LOOP
        v_groups := v_groups || v_group;
    END LOOP;
    RETURN v_groups;
END
$$;

COMMENT ON FUNCTION idem.worker_groups() IS
    'Internal: on a Citus coordinator, the groups of the workers that hold the key table''s shards; {} elsewhere. Used by cleanup.';

-- cleanup_on_workers: asks every active primary worker (Citus' run_command_on_workers: a
-- connection and a transaction of its own on each) to delete its share of a batch (p_shares,
-- cleanup_share) and returns their 'group:deleted' answers; raises when one of them failed.
-- It runs nothing else: on a worker where it is callable by mistake (a worker added and not
-- yet set up by sql/citus/distribute.sql), it can only clean up. Internal.
CREATE OR REPLACE FUNCTION idem.cleanup_on_workers(p_shares jsonb)
RETURNS SETOF text
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
-- @plpgsql_check_options: performance_warnings = false
-- (it runs commands that write on the workers: VOLATILE, which the dynamic SQL hides)
DECLARE
    v_node    text;
    v_port    integer;
    v_success boolean;
    v_result  text;
BEGIN
    FOR v_node, v_port, v_success, v_result IN
        EXECUTE format('SELECT nodename::text, nodeport::integer, success, result FROM %I($1)', 'run_command_on_workers')
        USING format('SELECT idem.cleanup_share(%L::jsonb)', p_shares) LOOP
        IF NOT v_success THEN
            RAISE EXCEPTION 'idem cleanup: the worker %:% failed: %', v_node, v_port, v_result
                USING ERRCODE = '58000';
        END IF;
        RETURN NEXT v_result;
    END LOOP;
END
$$;

COMMENT ON FUNCTION idem.cleanup_on_workers(jsonb) IS
    'Internal: asks every Citus worker to delete its share of a cleanup batch and returns their answers; raises when one fails. Used by cleanup.';

-- cleanup_share: on a worker, deletes up to its share of a batch (p_shares: {"group": rows})
-- from the key relations it holds, and returns 'group:deleted'. Internal.
CREATE OR REPLACE FUNCTION idem.cleanup_share(p_shares jsonb)
RETURNS text
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_group integer;
    v_share integer;
BEGIN
    v_group := coalesce(idem.node_group(), 0);
    v_share := coalesce((p_shares ->> v_group::text)::integer, 0);
    IF v_share < 1 THEN
        RETURN v_group || ':0';
    END IF;
    RETURN v_group || ':' || idem.cleanup_relations(idem.key_relations(), v_share);
END
$$;

COMMENT ON FUNCTION idem.cleanup_share(jsonb) IS
    'Internal: on a Citus worker, deletes up to its share of a cleanup batch and returns group:deleted. Used by cleanup.';

-- cleanup_workers: deletes at most p_batch_size expired keys across the workers p_groups,
-- round by round: each round asks every worker that may still have some for an equal share
-- of what is left (the first ones one more), and a worker that deletes fewer than it was
-- asked for is drained. So the result is below p_batch_size only when every worker is
-- drained, as idem_cleanup promises. Each worker deletes in a transaction of its own. Internal.
CREATE OR REPLACE FUNCTION idem.cleanup_workers(p_groups integer[], p_batch_size integer)
RETURNS integer
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_active  integer[] := p_groups;
    v_next    integer[];
    v_deleted integer := 0;
    v_left    integer;
    v_shares  jsonb;
    v_result  text;
    v_group   integer;
    v_n       integer;
BEGIN
    WHILE v_deleted < p_batch_size AND cardinality(v_active) > 0 LOOP
        v_left := p_batch_size - v_deleted;
        SELECT jsonb_object_agg(g.group_id::text, v_left / cardinality(v_active) + (g.pos <= v_left % cardinality(v_active))::integer)
          INTO v_shares
          FROM unnest(v_active) WITH ORDINALITY AS g(group_id, pos);
        v_next := '{}';
        FOR v_result IN SELECT r FROM idem.cleanup_on_workers(v_shares) AS r LOOP
            v_group := split_part(v_result, ':', 1)::integer;
            v_n := split_part(v_result, ':', 2)::integer;
            v_deleted := v_deleted + v_n;
            IF v_group = ANY (v_active) AND v_n >= (v_shares ->> v_group::text)::integer THEN
                v_next := v_next || v_group;
            END IF;
        END LOOP;
        v_active := v_next;
    END LOOP;
    RETURN v_deleted;
END
$$;

COMMENT ON FUNCTION idem.cleanup_workers(integer[], integer) IS
    'Internal: deletes at most p_batch_size expired keys across these Citus workers, in rounds of equal shares. Used by idem_cleanup.';

-- cleanup_node: on this node, deletes expired keys from the relations that hold them here,
-- batch after batch, each batch committed, until a batch comes back short (drained) or
-- p_seconds have passed (at least one batch); after each batch it pauses so that its batches
-- take at most p_duty of the time (below 0.01 counts as 0.01, as dbidem.Pace). Returns
-- 'group:deleted:drained'. What each Citus worker runs for idem_cleanup_workers, through
-- cleanup_pass_on_workers: a procedure (so that it can commit), called outside any
-- transaction block. Internal: SECURITY INVOKER without SET clauses (a procedure with either
-- cannot commit); it pins search_path for each of its transactions instead (first thing and
-- after each COMMIT: include/pin_path.sql, D252), and calls only the schema-qualified internal
-- functions, which run as the owner, and only the owner may call those.
CREATE OR REPLACE PROCEDURE idem.cleanup_node(
    p_batch_size integer,
    p_duty       double precision,
    p_seconds    double precision,
    INOUT p_result text DEFAULT NULL)
LANGUAGE plpgsql
AS $$
DECLARE
    v_problem text;
    v_until   timestamptz;
    v_duty    double precision;
    v_began   timestamptz;
    v_pause   double precision;
    v_n       integer;
    v_deleted bigint := 0::bigint;
BEGIN
{{ template "include/pin_path.sql" }}
    v_problem := CASE
        WHEN p_batch_size IS NULL OR p_duty IS NULL OR p_seconds IS NULL
            THEN '22004 p_batch_size, p_duty and p_seconds must not be NULL'
        WHEN p_batch_size < 1 OR NOT (p_duty > 0 AND p_duty <= 1) OR NOT (p_seconds > 0 AND p_seconds <= 3600)
            THEN format('22023 p_batch_size must be at least 1, p_duty in (0, 1] and p_seconds in (0, 3600], got %s, %s, %s',
                        p_batch_size, p_duty, p_seconds)
    END;
{{ template "include/raise.sql" "cleanup_node" }}
    v_until := clock_timestamp() + make_interval(secs => p_seconds);
    v_duty := greatest(p_duty, 0.01);
    -- The coordinator waits on this session for the whole pass. Citus cancels the command
    -- when the coordinator's statement is cancelled or its session ends; when the coordinator
    -- goes away without a word (a crash, a lost network), end within a second, at the next
    -- check, instead of cleaning on until p_seconds have passed.
    PERFORM pg_catalog.set_config('client_connection_check_interval', '1000', false);
    LOOP
        v_began := clock_timestamp();
        v_n := idem.cleanup_relations(idem.key_relations(), p_batch_size);
        v_deleted := v_deleted + v_n;
        COMMIT;
{{ template "include/pin_path.sql" }}
        EXIT WHEN v_n < p_batch_size OR clock_timestamp() >= v_until;
        IF v_duty < 1 THEN
            v_pause := least(extract(epoch FROM clock_timestamp() - v_began)::double precision * (1 - v_duty) / v_duty,
                             extract(epoch FROM v_until - clock_timestamp())::double precision);
            PERFORM pg_catalog.pg_sleep(v_pause);
            COMMIT; -- no snapshot held between batches
{{ template "include/pin_path.sql" }}
            EXIT WHEN clock_timestamp() >= v_until;
        END IF;
    END LOOP;
    p_result := coalesce(idem.node_group(), 0) || ':' || v_deleted || ':' || (v_n < p_batch_size);
END
$$;

COMMENT ON PROCEDURE idem.cleanup_node(integer, double precision, double precision, text) IS
    'Internal: on this node, deletes expired keys batch after batch, each committed and paced to p_duty, until drained or p_seconds have passed; returns group:deleted:drained. Run on every Citus worker by idem_cleanup_workers.';

-- cleanup_pass_on_workers: asks every active primary worker to run cleanup_node (Citus'
-- run_command_on_workers: the workers in parallel, each in a session of its own, outside any
-- transaction block, so that it commits batch by batch) and returns their answers; raises when
-- one of them failed. One round of new connections for the whole pass, not one per batch. As
-- cleanup_on_workers, it runs nothing but cleanup there. Internal.
CREATE OR REPLACE FUNCTION idem.cleanup_pass_on_workers(p_batch_size integer, p_duty double precision, p_seconds double precision)
RETURNS SETOF text
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
-- @plpgsql_check_options: performance_warnings = false
-- (it runs commands that write on the workers: VOLATILE, which the dynamic SQL hides)
DECLARE
    v_node    text;
    v_port    integer;
    v_success boolean;
    v_result  text;
BEGIN
    FOR v_node, v_port, v_success, v_result IN
        EXECUTE format('SELECT nodename::text, nodeport::integer, success, result FROM %I($1)', 'run_command_on_workers')
        USING format('CALL idem.cleanup_node(%s, %L::float8, %L::float8)', p_batch_size, p_duty, p_seconds) LOOP
        IF NOT v_success THEN
            RAISE EXCEPTION 'idem cleanup: the worker %:% failed: %', v_node, v_port, v_result
                USING ERRCODE = '58000';
        END IF;
        RETURN NEXT v_result;
    END LOOP;
END
$$;

COMMENT ON FUNCTION idem.cleanup_pass_on_workers(integer, double precision, double precision) IS
    'Internal: has every Citus worker run cleanup_node, in parallel, and returns their answers; raises when one fails. Used by idem_cleanup_workers.';

-- idem_cleanup_workers: on a Citus coordinator, one pass of cleanup over the whole cluster:
-- every worker deletes the expired keys of its own shards, batch after batch (each batch its
-- own transaction there, paced to p_duty), until it is drained or p_max_time has passed, the
-- workers in parallel, with one connection each for the whole pass (cleanup_node); shards on
-- the coordinator itself lose one batch per call, in the caller's transaction. One row:
-- how many keys it deleted, and done when every node is drained (call it again while not
-- done). No row where there are no workers to ask (plain PostgreSQL, a Citus worker): call
-- idem_cleanup there. So a caller can try this first everywhere.
CREATE OR REPLACE FUNCTION idem.idem_cleanup_workers(
    p_batch_size integer          DEFAULT {{ template "default_batch_size" }},
    p_duty       double precision DEFAULT 1,
    p_max_time   interval         DEFAULT interval '10 seconds',
    OUT deleted  bigint,
    OUT done     boolean)
RETURNS SETOF record
{{ template "include/attributes.sql" . }}
AS $$
-- @plpgsql_check_options: performance_warnings = false
DECLARE
    v_problem text;
    v_result  text;
BEGIN
    v_problem := CASE
        WHEN p_batch_size IS NULL OR p_duty IS NULL OR p_max_time IS NULL
            THEN '22004 p_batch_size, p_duty and p_max_time must not be NULL'
        WHEN p_batch_size < 1
            THEN format('22023 p_batch_size must be at least 1, got %s', p_batch_size)
        WHEN NOT (p_duty > 0 AND p_duty <= 1)
            THEN format('22023 p_duty must be above 0 and at most 1, got %s', p_duty)
        WHEN p_max_time <= interval '0' OR p_max_time > interval '1 hour'
            THEN format('22023 p_max_time must be above 0 and at most 1 hour, got %s', p_max_time)
    END;
{{ template "include/raise.sql" "idem_cleanup_workers" }}
    IF cardinality(idem.worker_groups()) = 0 THEN
        RETURN;
    END IF;
    deleted := idem.cleanup_relations(idem.key_relations(), p_batch_size);
    done := deleted < p_batch_size;
    FOR v_result IN SELECT r FROM idem.cleanup_pass_on_workers(p_batch_size, p_duty,
                                                               extract(epoch FROM p_max_time)::double precision) AS r LOOP
        deleted := deleted + split_part(v_result, ':', 2)::bigint;
        done := done AND split_part(v_result, ':', 3)::boolean;
    END LOOP;
    RETURN NEXT;
END
$$;

COMMENT ON FUNCTION idem.idem_cleanup_workers(integer, double precision, interval) IS
    'On a Citus coordinator: every worker cleans its shards in batches, paced to p_duty, until drained or p_max_time has passed, in parallel; returns deleted and done. No row elsewhere (use idem_cleanup). See docs/sql-api.md.';

-- idem_cleanup: one batch: from the relations that hold keys on this node and, on a Citus
-- coordinator, from the workers' (cleanup_workers). Returns how many rows it deleted; call it
-- again until the count is smaller than the batch size. Safe to run from several sessions at
-- once.
CREATE OR REPLACE FUNCTION idem.idem_cleanup(p_batch_size integer DEFAULT {{ template "default_batch_size" }})
RETURNS integer
{{ template "include/attributes.sql" . }}
AS $$
DECLARE
    v_problem text;
    v_deleted integer;
    v_groups  integer[];
BEGIN
    v_problem := CASE
        WHEN p_batch_size IS NULL
            THEN '22004 p_batch_size must not be NULL'
        WHEN p_batch_size < 1
            THEN format('22023 p_batch_size must be at least 1, got %s', p_batch_size)
    END;
{{ template "include/raise.sql" "idem_cleanup" }}
    v_deleted := idem.cleanup_relations(idem.key_relations(), p_batch_size);
    IF v_deleted < p_batch_size THEN
        v_groups := idem.worker_groups();
        IF cardinality(v_groups) > 0 THEN
            v_deleted := v_deleted + idem.cleanup_workers(v_groups, p_batch_size - v_deleted);
        END IF;
    END IF;
    RETURN v_deleted;
END
$$;

COMMENT ON FUNCTION idem.idem_cleanup(integer) IS
    'Deletes at most p_batch_size expired keys (oldest first, SKIP LOCKED; on a Citus coordinator, from every worker) and returns how many; repeat until the count is below the batch size. See docs/sql-api.md.';

-- idem_cleanup_leased: one batch of a cleanup pass that holds the cleanup lease (migration
-- 008), so that one pass, not only one batch, runs at a time across processes: the scheduled
-- cleaner's batch, and idem_cleanup_all's. p_pass names the pass (the same UUID for each of
-- its batches). Under the cleanup lock (taken here for the transaction, if the caller has not
-- taken it already), it reads the lease: when another pass holds it and it has not run out, the
-- batch deletes nothing and returns NULL (as it does when another transaction holds the lock,
-- except for the pass that holds the lease, which waits up to 2 seconds for the lock),
-- unless p_take_over (a pass by hand, which must run to its end: the other pass stops at its
-- next batch). Otherwise it deletes at most p_batch_size expired keys (idem_cleanup), and then
-- frees the lease when the batch came back short (the pass is over), or keeps it for this pass
-- for twice the pause that p_duty asks after a batch that took this long (took × (1 - p_duty) /
-- p_duty, at most an hour, as the Go cleaner's pause), and 10 seconds more:
-- a pass whose process dies holds the lease until it runs out, and the next pass then runs.
CREATE OR REPLACE FUNCTION idem.idem_cleanup_leased(
    p_pass       uuid,
    p_batch_size integer          DEFAULT {{ template "default_batch_size" }},
    p_duty       double precision DEFAULT 1,
    p_take_over  boolean          DEFAULT false)
RETURNS integer
{{ template "include/attributes.sql" . }}
AS $$
DECLARE
    v_problem text;
    v_start   timestamptz := clock_timestamp();
    v_wait_end timestamptz := v_start + interval '2 seconds';
    v_pass    uuid;
    v_until   timestamptz;
    v_deleted integer;
BEGIN
    v_problem := CASE
        WHEN p_pass IS NULL OR p_batch_size IS NULL OR p_duty IS NULL OR p_take_over IS NULL
            THEN '22004 p_pass, p_batch_size, p_duty and p_take_over must not be NULL'
        WHEN p_batch_size < 1
            THEN format('22023 p_batch_size must be at least 1, got %s', p_batch_size)
        WHEN NOT (p_duty >= 0.01 AND p_duty <= 1)
            THEN format('22023 p_duty must be from 0.01 to 1, got %s', p_duty)
    END;
{{ template "include/raise.sql" "idem_cleanup_leased" }}
    IF NOT pg_try_advisory_xact_lock({{ template "cleanup_lock" }}) THEN
        -- Another transaction holds the lock. A batch of another pass leaves: that is another
        -- pass running. The pass that holds the lease (its own while no other pass has taken
        -- it, run out or not), or takes it over, waits for it, for at most 2 seconds: what
        -- holds it then is a moment's work (another cleaner's first statement, a batch of
        -- release 0.2.0's cleaner), not another pass, which would need the lease. It polls,
        -- every 10 ms: a wait bounded by lock_timeout would need an EXCEPTION block (a
        -- subtransaction) to end without an error, and the API has none.
        IF NOT p_take_over AND NOT EXISTS (SELECT FROM idem.cleanup_lease AS l WHERE l.pass = p_pass) THEN
            RETURN NULL;
        END IF;
        -- Half a statement_timeout at most: a maintenance window then ends the batch with NULL,
        -- as it should, not with the timeout's error.
        IF current_setting('statement_timeout') NOT IN ('0', '0ms') THEN
            v_wait_end := least(v_wait_end, statement_timestamp() + current_setting('statement_timeout')::interval / 2);
        END IF;
        LOOP
            PERFORM pg_sleep(0.01);
            EXIT WHEN pg_try_advisory_xact_lock({{ template "cleanup_lock" }});
            IF clock_timestamp() > v_wait_end THEN
                RETURN NULL; -- a maintenance window holds it: the pass stops here
            END IF;
        END LOOP;
    END IF;
    SELECT l.pass, l.until INTO v_pass, v_until FROM idem.cleanup_lease AS l FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'idem_cleanup_leased: the lease''s row is missing from idem.cleanup_lease'
            USING ERRCODE = '55000', HINT = 'INSERT INTO idem.cleanup_lease DEFAULT VALUES, as the table''s owner.';
    END IF;
    IF v_pass IS DISTINCT FROM p_pass AND v_until > clock_timestamp() AND NOT p_take_over THEN
        RETURN NULL;
    END IF;
    v_deleted := idem.idem_cleanup(p_batch_size);
    UPDATE idem.cleanup_lease
       SET pass = p_pass,
           until = CASE WHEN v_deleted < p_batch_size THEN '-infinity'::timestamptz
                        ELSE clock_timestamp() + interval '10 seconds'
                             + 2 * least((clock_timestamp() - v_start) * ((1 - p_duty) / p_duty), interval '1 hour') END;
    RETURN v_deleted;
END
$$;

COMMENT ON FUNCTION idem.idem_cleanup_leased(uuid, integer, double precision, boolean) IS
    'One batch of the cleanup pass p_pass under the cleanup lease: NULL when another pass holds the lock or the lease (unless p_take_over), else idem_cleanup(p_batch_size); frees the lease when the batch comes back short. See docs/sql-api.md.';

-- idem_cleanup_all: every expired key, batch by batch, each batch its own transaction (a
-- procedure that commits), each under the cleanup lock (idem.CleanupLock in Go,
-- 29665259344325742), which it waits for, as `server cleanup` does, and batch by batch
-- (idem_cleanup_leased) it takes the cleanup lease over, as `server cleanup` does: a server's
-- scheduled pass stops at its next batch, the others skip until this one ends (on a Citus
-- worker, which has no lease, it calls idem_cleanup), and a maintenance window that holds the
-- lock pauses it. For pg_cron and psql: CALL idem.idem_cleanup_all(5000); outside a
-- transaction block. On a Citus coordinator, passes of idem_cleanup_workers (each worker
-- cleans its own shards, in parallel) until every node is drained; elsewhere idem_cleanup,
-- batch after batch. SECURITY INVOKER without SET clauses, because a procedure with either
-- cannot commit; it calls only the schema-qualified idem_cleanup_workers and idem_cleanup,
-- which run as the owner, and names every other function, operator and type with its schema
-- (pg_catalog): the caller's search_path picks none of them. It pins search_path for each of
-- its transactions all the same (include/pin_path.sql, D252).
CREATE OR REPLACE PROCEDURE idem.idem_cleanup_all(
    p_batch_size integer DEFAULT {{ template "default_batch_size" }},
    INOUT p_deleted bigint DEFAULT NULL)
LANGUAGE plpgsql
AS $$
DECLARE
    v_n       integer;
    v_deleted bigint;
    v_done    boolean;
    v_problem pg_catalog.text;
    v_pass    pg_catalog.uuid := pg_catalog.gen_random_uuid();
    -- The cleanup lease is migration 008's, on the node where the migrations ran; a Citus
    -- worker (run_command_on_workers) has none, and cleans its shards without it.
    v_leased  pg_catalog.bool := pg_catalog.to_regclass('idem.cleanup_lease') IS NOT NULL;
BEGIN
{{ template "include/pin_path.sql" }}
    v_problem := CASE
        WHEN p_batch_size IS NULL
            THEN '22004 p_batch_size must not be NULL'
        WHEN p_batch_size OPERATOR(pg_catalog.<) 1
            THEN pg_catalog.format('22023 p_batch_size must be at least 1, got %s', p_batch_size)
    END;
    IF v_problem IS NOT NULL THEN
        RAISE EXCEPTION 'idem_cleanup_all: %', pg_catalog.substr(v_problem, 7)
            USING ERRCODE = pg_catalog.left(v_problem, 5);
    END IF;
    p_deleted := 0;
    LOOP
        -- The wait lasts the maintenance window, whatever lock_timeout the session has (a
        -- procedure that commits can have no SET clause); reset at this batch's COMMIT.
        PERFORM pg_catalog.set_config('lock_timeout', '0', true);
{{ template "include/pin_path.sql" }}
        PERFORM pg_catalog.pg_advisory_xact_lock({{ template "cleanup_lock" }});
        SELECT w.deleted, w.done INTO v_deleted, v_done
          FROM idem.idem_cleanup_workers(p_batch_size, 1, interval '1 minute') AS w;
        EXIT WHEN NOT FOUND; -- no workers here: batch by batch, below
        p_deleted := p_deleted OPERATOR(pg_catalog.+) v_deleted;
        COMMIT;
{{ template "include/pin_path.sql" }}
        IF v_done THEN
            RETURN;
        END IF;
    END LOOP;
    LOOP
        -- The wait lasts the maintenance window, whatever lock_timeout the session has (a
        -- procedure that commits can have no SET clause); reset at this batch's COMMIT.
        PERFORM pg_catalog.set_config('lock_timeout', '0', true);
{{ template "include/pin_path.sql" }}
        PERFORM pg_catalog.pg_advisory_xact_lock({{ template "cleanup_lock" }});
        IF v_leased THEN
            v_n := idem.idem_cleanup_leased(v_pass, p_batch_size, 1, true);
        ELSE
            v_n := idem.idem_cleanup(p_batch_size);
        END IF;
        p_deleted := p_deleted OPERATOR(pg_catalog.+) v_n;
        COMMIT;
{{ template "include/pin_path.sql" }}
        EXIT WHEN v_n OPERATOR(pg_catalog.<) p_batch_size;
    END LOOP;
END
$$;

COMMENT ON PROCEDURE idem.idem_cleanup_all(integer, bigint) IS
    'Deletes every expired key in batches of p_batch_size, committing after each; call it outside a transaction block (pg_cron, psql). See docs/sql-api.md.';

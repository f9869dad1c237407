-- Cleanup: delete expired keys in batches.
--
-- idem.key_relations() names the relations that hold keys on this node: the table itself on
-- plain PostgreSQL; on a Citus node, each shard of it stored here. idem.cleanup_relations()
-- is the one code path that deletes from them; idem_cleanup() runs it on key_relations().
-- A row is expired when its TTL has run out and no lease on it still runs.

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
-- many. A relation that gives fewer rows than asked is drained; the next one is asked for the
-- rest. Internal (not granted): it accepts only tables in schema idem.
CREATE OR REPLACE FUNCTION idem.cleanup_relations(p_relations regclass[], p_batch_size integer)
RETURNS integer
{{ template "include/attributes.sql" . }}
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
                     ORDER BY c.expires_at
                     LIMIT $2
                       FOR UPDATE SKIP LOCKED))
               AND k.expires_at <= $1 AND (k.lease_expires_at IS NULL OR k.lease_expires_at <= $1)
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

-- idem_cleanup: one batch from the relations that hold keys on this node. Returns how many
-- rows it deleted; call it again until the count is smaller than the batch size. Safe to run
-- from several sessions at once.
CREATE OR REPLACE FUNCTION idem.idem_cleanup(p_batch_size integer DEFAULT {{ template "default_batch_size" }})
RETURNS integer
{{ template "include/attributes.sql" . }}
AS $$
BEGIN
    RETURN idem.cleanup_relations(idem.key_relations(), p_batch_size);
END
$$;

COMMENT ON FUNCTION idem.idem_cleanup(integer) IS
    'Deletes at most p_batch_size expired keys (oldest first, SKIP LOCKED) and returns how many; repeat until the count is below the batch size. See docs/sql-api.md.';

-- idem_cleanup_all: every expired key, batch by batch, each batch its own transaction (a
-- procedure that commits). For pg_cron and psql: CALL idem.idem_cleanup_all(5000); outside a
-- transaction block. SECURITY INVOKER without SET clauses, because a procedure with either
-- cannot commit; it calls only the schema-qualified idem_cleanup, which runs as the owner.
CREATE OR REPLACE PROCEDURE idem.idem_cleanup_all(
    p_batch_size integer DEFAULT {{ template "default_batch_size" }},
    INOUT p_deleted bigint DEFAULT NULL)
LANGUAGE plpgsql
AS $$
DECLARE
    v_n integer;
BEGIN
    p_deleted := 0;
    LOOP
        v_n := idem.idem_cleanup(p_batch_size);
        p_deleted := p_deleted + v_n;
        COMMIT;
        EXIT WHEN v_n < p_batch_size;
    END LOOP;
END
$$;

COMMENT ON PROCEDURE idem.idem_cleanup_all(integer, bigint) IS
    'Deletes every expired key in batches of p_batch_size, committing after each; call it outside a transaction block (pg_cron, psql). See docs/sql-api.md.';

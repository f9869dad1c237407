-- Distribute the idem SQL API over a Citus cluster, by principal.
--
-- Run once, on the coordinator, as the role that owns schema idem (a superuser on a test
-- cluster), after the API is installed there (psql -f sql/idem.sql, or server migrate) and
-- the workers are added (citus_add_node):
--
--     psql -v ON_ERROR_STOP=1 -f sql/citus/distribute.sql
--
-- docs/scale-out.md explains every step. Nothing here changes the API: callers keep calling
-- idem.idem_begin and the others on the coordinator; Citus runs each call on the worker that
-- holds the principal's shard.
\set ON_ERROR_STOP 1

-- 1. The commit guard's always-empty table, on every node (a reference table), so that the
--    deferred foreign key from every shard of the key table finds it locally.
SELECT create_reference_table('idem.claim_guard');

-- 2. The key table, distributed by principal: all keys of a principal live on one shard.
SELECT create_distributed_table('idem.idempotency_keys', 'principal_id', shard_count => 32);

-- 3. Distribution keeps the table's own storage settings on the shards but drops the TOAST
--    one; set it again on every shard.
SELECT run_command_on_shards('idem.idempotency_keys',
    $$ALTER TABLE %s SET (toast.autovacuum_vacuum_scale_factor = 0.02)$$);

-- 4. Fencing tokens come from idem.attempt_seq on the node that runs the call. Every worker
--    gets its own range (its group id in the top 16 bits), so no two nodes ever hand out the
--    same token, and a shard that moves to another worker still never sees a token again.
SELECT run_command_on_workers($cmd$
DO $do$
DECLARE
    v_start bigint := ((SELECT groupid FROM pg_catalog.pg_dist_local_group)::bigint << 48) + 1;
BEGIN
    IF to_regclass('idem.attempt_seq') IS NULL THEN
        EXECUTE format('CREATE SEQUENCE idem.attempt_seq AS bigint MINVALUE %s START %s', v_start, v_start);
    ELSE
        EXECUTE format('ALTER SEQUENCE idem.attempt_seq MINVALUE %s RESTART %s', v_start, v_start);
    END IF;
END
$do$
$cmd$);

-- 5. The API: each claim, completion, final answer and release runs on the worker that holds
--    p_principal's shard, in the caller's transaction (force_delegation).
SELECT create_distributed_function('idem.idem_begin(text,text,text,bytea,interval,interval,jsonb,interval)',
    distribution_arg_name => 'p_principal', colocate_with => 'idem.idempotency_keys', force_delegation => true);
SELECT create_distributed_function('idem.idem_complete(text,text,bigint,integer,jsonb,bytea,text,text)',
    distribution_arg_name => 'p_principal', colocate_with => 'idem.idempotency_keys', force_delegation => true);
SELECT create_distributed_function('idem.idem_save_final(text,text,text,bytea,interval,integer,jsonb,bytea,jsonb,text,text)',
    distribution_arg_name => 'p_principal', colocate_with => 'idem.idempotency_keys', force_delegation => true);
SELECT create_distributed_function('idem.idem_release(text,text,bigint)',
    distribution_arg_name => 'p_principal', colocate_with => 'idem.idempotency_keys', force_delegation => true);

-- 6. Cleanup and the defaults exist on every worker too; cleanup runs there, per worker, on
--    the shards stored there (idem.key_relations() reads them from Citus' metadata).
SELECT create_distributed_function('idem.key_relations()');
SELECT create_distributed_function('idem.cleanup_relations(regclass[],integer)');
SELECT create_distributed_function('idem.idem_cleanup(integer)');
SELECT create_distributed_function('idem.idem_cleanup_all(integer,bigint)');
SELECT create_distributed_function('idem.idem_defaults()');

-- 7. Check: every worker has the functions, the sequence and the shards it should.
SELECT nodename, nodeport, success, result
  FROM run_command_on_workers($$SELECT count(*) || ' local shards' FROM unnest(idem.key_relations())$$);

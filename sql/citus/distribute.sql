-- Distribute the idem SQL API over a Citus cluster, by principal.
--
-- Run on the coordinator, as a superuser (replicate_reference_tables and the commands on the
-- workers are a superuser's), after the workers are added (citus_add_node) and the API is installed there (psql -f
-- sql/idem.sql, or server migrate):
--
--     psql -v ON_ERROR_STOP=1 -f sql/citus/distribute.sql
--
-- It can be run again, and must be: right after a worker is added (until then the worker's copies
-- of the functions are executable by every role), after shards are moved or rebalanced, after
-- sql/idem.sql is run again and after a Citus upgrade. Every step checks what is already done,
-- and no step hands out a fencing token twice. docs/scale-out.md explains every step. Nothing here changes the API:
-- callers keep calling idem.idem_begin and the others on the coordinator; Citus runs each call
-- on the worker that holds the principal's shard.
\set ON_ERROR_STOP 1

-- 1. The commit guard's always-empty table, on every node (a reference table), so that the
--    deferred foreign key from every shard of the key table finds it locally.
-- (Citus may have added a table to its metadata as a "local table" already, because of a foreign
-- key: only a reference table counts as done.)
SELECT create_reference_table('idem.claim_guard')
 WHERE NOT EXISTS (SELECT FROM pg_dist_partition
                    WHERE logicalrelid = 'idem.claim_guard'::regclass AND partmethod = 'n' AND repmodel = 't');

-- 2. The key table, distributed by principal: all keys of a principal live on one shard.
--    (Step 1 makes it a Citus "local table", because of its foreign key to claim_guard: only a
--    hash-distributed table counts as done.)
SELECT create_distributed_table('idem.idempotency_keys', 'principal_id', shard_count => 32)
 WHERE NOT EXISTS (SELECT FROM pg_dist_partition
                    WHERE logicalrelid = 'idem.idempotency_keys'::regclass AND partmethod = 'h');

-- The installation's secrets for provider keys (migration 006), on every node: a worker computes
-- the provider key of the claims it runs.
SELECT create_reference_table('idem.installation_secrets')
 WHERE NOT EXISTS (SELECT FROM pg_dist_partition
                    WHERE logicalrelid = 'idem.installation_secrets'::regclass AND partmethod = 'n' AND repmodel = 't');

-- Reference tables on every node, a worker added since included (a shard cannot move to a
-- node without them). block_writes: the default mode needs wal_level = logical.
SELECT replicate_reference_tables('block_writes');

-- 3. Distribution keeps the table's own storage settings on the shards but drops the TOAST
--    ones, and so does moving a shard; set them again on every shard.
SELECT run_command_on_shards('idem.idempotency_keys',
    $$ALTER TABLE %s SET (toast.autovacuum_vacuum_scale_factor = 0.02, toast.vacuum_truncate = false)$$);

-- 4. Fencing tokens come from idem.attempt_seq on the node that runs the call. Every worker
--    gets its own range (its group id in the top 16 bits), so no two nodes ever hand out the
--    same token, and a shard that moves to another worker still never sees a token again. A
--    worker whose sequence is already in its range keeps it where it is: moving it back would
--    hand out tokens again.
SELECT run_command_on_workers($cmd$
DO $do$
DECLARE
    v_start bigint := ((SELECT groupid FROM pg_catalog.pg_dist_local_group)::bigint << 48) + 1;
BEGIN
    IF to_regclass('idem.attempt_seq') IS NULL THEN
        EXECUTE format('CREATE SEQUENCE idem.attempt_seq AS bigint MINVALUE %s START %s', v_start, v_start);
    ELSIF (SELECT last_value FROM idem.attempt_seq) < v_start THEN
        EXECUTE format('ALTER SEQUENCE idem.attempt_seq MINVALUE %s RESTART %s', v_start, v_start);
    END IF;
    -- The owner of schema idem owns it, whoever runs this script: the functions, SECURITY
    -- DEFINER, draw from it as that owner (created by a superuser, it refused every claim of
    -- the application role with 42501 where the owner is no superuser).
    EXECUTE format('ALTER SEQUENCE idem.attempt_seq OWNER TO %s', -- regrole's text is quoted already
                   (SELECT nspowner::regrole::text FROM pg_catalog.pg_namespace WHERE nspname = 'idem'));
END
$do$
$cmd$);

-- 4b. Since migration 006 tokens come from idem.token_seq: on every worker, in the worker's own
--     range, above every token its idem.attempt_seq gave (the previous release's generations keep
--     their provider keys). Each worker's first new token gets a row of the installation's secret,
--     so that the generations it starts take the secret, and those before it do not. (Not run on
--     a Citus cluster by CI: `make test-citus` covers it.)
SELECT run_command_on_workers($cmd$
DO $do$
DECLARE
    v_group bigint := (SELECT groupid FROM pg_catalog.pg_dist_local_group);
    v_start bigint;
BEGIN
    v_start := greatest((SELECT last_value FROM idem.attempt_seq) + 4294967296, (v_group << 48) + 1);
    IF to_regclass('idem.token_seq') IS NULL THEN
        EXECUTE format('CREATE SEQUENCE idem.token_seq AS bigint MINVALUE %s START %s', v_start, v_start);
    ELSIF (SELECT last_value FROM idem.token_seq) < (v_group << 48) + 1 THEN
        EXECUTE format('ALTER SEQUENCE idem.token_seq MINVALUE %s RESTART %s', v_start, v_start);
    END IF;
    EXECUTE format('ALTER SEQUENCE idem.token_seq OWNER TO %s',
                   (SELECT nspowner::regrole::text FROM pg_catalog.pg_namespace WHERE nspname = 'idem'));
END
$do$
$cmd$);
-- The coordinator's current secret, for each worker's range: a row for the worker's first new
-- token, pointing at the same four sequences, whose values every worker is given (each worker's
-- own install made a random secret of its own; where the API was installed through the
-- coordinator only, Citus did not create the secret's sequences on the workers, and they are
-- created here); then each worker writes its lists of secrets again (as the install does) and
-- compiles the functions that compute provider keys anew. Run this script before the cluster
-- serves keys. (Not run by CI, which has no Citus.)
INSERT INTO idem.installation_secrets (from_token, secret_seqs)
SELECT w.result::bigint, (SELECT s.secret_seqs FROM idem.installation_secrets AS s ORDER BY s.from_token DESC LIMIT 1)
  FROM run_command_on_workers($$SELECT min_value FROM pg_catalog.pg_sequences
                                 WHERE schemaname = 'idem' AND sequencename = 'token_seq'$$) AS w
 WHERE w.success AND w.result <> ''
ON CONFLICT (from_token) DO NOTHING;
SELECT set_config('idem.publish_secrets', format($cmd$
DO $do$
BEGIN
    SET LOCAL citus.enable_ddl_propagation = off;
    EXECUTE (SELECT coalesce(string_agg(format('CREATE SEQUENCE IF NOT EXISTS %%s AS bigint MINVALUE -9223372036854775808 START 0', u.q), '; '), '')
               FROM unnest(%1$L::text[]) AS u(q));
    PERFORM setval(u.q::regclass, u.v, true)
       FROM unnest(%1$L::text[], %2$L::bigint[]) AS u(q, v);
    -- Owned by the owner of schema idem (which reads them, in its SECURITY DEFINER functions),
    -- and readable by nobody else, as the install leaves them.
    EXECUTE (SELECT coalesce(string_agg(format('ALTER SEQUENCE %%s OWNER TO %%s; REVOKE ALL ON SEQUENCE %%s FROM PUBLIC',
                                               u.q, (SELECT nspowner::regrole::text FROM pg_catalog.pg_namespace WHERE nspname = 'idem'), u.q), '; '), '')
               FROM unnest(%1$L::text[]) AS u(q));
    EXECUTE format($fn$CREATE OR REPLACE FUNCTION idem.installation_secret_tokens() RETURNS bigint[]
        LANGUAGE sql IMMUTABLE SECURITY INVOKER SET search_path = pg_catalog, pg_temp AS %%L$fn$,
        format('SELECT %%L::bigint[]', (SELECT coalesce(array_agg(s.from_token ORDER BY s.from_token), '{}')
                                          FROM idem.installation_secrets AS s)));
    EXECUTE format($fn$CREATE OR REPLACE FUNCTION idem.installation_secret_seqs() RETURNS regclass[]
        LANGUAGE sql IMMUTABLE SECURITY INVOKER SET search_path = pg_catalog, pg_temp AS %%L$fn$,
        format('SELECT %%L::regclass[]', (SELECT coalesce(array_agg(u.q ORDER BY s.from_token, u.o), '{}')
                                            FROM idem.installation_secrets AS s,
                                                 unnest(s.secret_seqs) WITH ORDINALITY AS u(q, o))));
    ALTER FUNCTION idem.idem_begin(text, text, text, bytea, interval, interval, jsonb, interval) COST 100;
    ALTER FUNCTION idem.idem_stuck(interval, integer) COST 100;
END
$do$
$cmd$, (SELECT array_agg(q ORDER BY q) FROM idem.installation_secrets AS s, unnest(s.secret_seqs) AS q),
       (SELECT array_agg(pg_sequence_last_value(q::regclass) ORDER BY q) FROM idem.installation_secrets AS s, unnest(s.secret_seqs) AS q)),
       false) IS NOT NULL AS published \gset
SELECT run_command_on_workers(current_setting('idem.publish_secrets'));
-- And on the coordinator, whose idem_stuck computes the provider keys of the claims it lists:
-- with the install's lists only, it took a worker's tokens for the previous release's and
-- listed a provider key that no claim had handed out.
DO $do$
BEGIN
    EXECUTE current_setting('idem.publish_secrets');
END
$do$;
-- The command holds the secret's values: not left in the session.
SELECT set_config('idem.publish_secrets', '', false) IS NOT NULL AS forgotten \gset

-- 5. The API: each claim, completion, final answer, release, lease extension, yield, step and
--    read of the steps runs on the worker that holds p_principal's shard, in the caller's
--    transaction (force_delegation), with the function's own lock_timeout.
SELECT create_distributed_function('idem.idem_begin(text,text,text,bytea,interval,interval,jsonb,interval)',
    distribution_arg_name => 'p_principal', colocate_with => 'idem.idempotency_keys', force_delegation => true);
SELECT create_distributed_function('idem.idem_complete(text,text,bigint,integer,jsonb,bytea,text,text)',
    distribution_arg_name => 'p_principal', colocate_with => 'idem.idempotency_keys', force_delegation => true);
SELECT create_distributed_function('idem.idem_save_final(text,text,text,bytea,interval,integer,jsonb,bytea,jsonb,text,text)',
    distribution_arg_name => 'p_principal', colocate_with => 'idem.idempotency_keys', force_delegation => true);
SELECT create_distributed_function('idem.idem_release(text,text,bigint)',
    distribution_arg_name => 'p_principal', colocate_with => 'idem.idempotency_keys', force_delegation => true);
SELECT create_distributed_function('idem.idem_extend(text,text,bigint,interval)',
    distribution_arg_name => 'p_principal', colocate_with => 'idem.idempotency_keys', force_delegation => true);
SELECT create_distributed_function('idem.idem_begin_steps(text,text,text,bytea,interval,interval,jsonb,interval)',
    distribution_arg_name => 'p_principal', colocate_with => 'idem.idempotency_keys', force_delegation => true);
SELECT create_distributed_function('idem.idem_step(text,text,bigint,text,jsonb)',
    distribution_arg_name => 'p_principal', colocate_with => 'idem.idempotency_keys', force_delegation => true);
SELECT create_distributed_function('idem.idem_recovery(text,text,bigint)',
    distribution_arg_name => 'p_principal', colocate_with => 'idem.idempotency_keys', force_delegation => true);
SELECT create_distributed_function('idem.idem_yield(text,text,bigint)',
    distribution_arg_name => 'p_principal', colocate_with => 'idem.idempotency_keys', force_delegation => true);

-- 6. The privileges, again, on every worker. Citus creates the API's functions on the workers
--    (on a worker added after the install, when it is added) without the REVOKE FROM PUBLIC
--    of sql/idem.sql: without this step, any role could call them there.
--    (A worker refuses these statements as "not allowed on this node" unless they stay local.)
SELECT run_command_on_workers($cmd$
DO $do$
BEGIN
    SET LOCAL citus.enable_ddl_propagation = off;
    REVOKE ALL ON ALL FUNCTIONS IN SCHEMA idem FROM PUBLIC;
    REVOKE ALL ON ALL PROCEDURES IN SCHEMA idem FROM PUBLIC;
    REVOKE ALL ON SCHEMA idem FROM PUBLIC;
END
$do$
$cmd$);
SELECT run_command_on_workers(format($cmd$
DO $do$
BEGIN
    SET LOCAL citus.enable_ddl_propagation = off;
    GRANT USAGE ON SCHEMA idem TO %1$I;
    GRANT EXECUTE ON FUNCTION idem.idem_begin, idem.idem_complete, idem.idem_save_final, idem.idem_release,
        idem.idem_extend, idem.idem_yield, idem.idem_step, idem.idem_recovery, idem.idem_begin_steps, idem.idem_cleanup, idem.idem_cleanup_workers, idem.idem_defaults, idem.idem_version,
        idem.idem_serves_version TO %1$I;
    GRANT EXECUTE ON PROCEDURE idem.idem_cleanup_all TO %1$I;
END
$do$
$cmd$, r.rolname))
  FROM pg_proc AS p, aclexplode(p.proacl) AS a, pg_roles AS r
 WHERE p.oid = 'idem.idem_begin(text,text,text,bytea,interval,interval,jsonb,interval)'::regprocedure
   AND a.privilege_type = 'EXECUTE' AND a.grantee <> p.proowner AND r.oid = a.grantee;

-- The functions that are not delegated run on the node they are called on: cleanup (on the
-- coordinator it asks every worker for its share, idem.cleanup_share, or to clean its shards,
-- idem.cleanup_node), the keys' figures (each worker reports its shards', idem.key_figures),
-- the defaults and the version. Citus creates them on every worker with the others; this
-- makes sure of it (a NOTICE says when one is distributed already).
SELECT create_distributed_function(f::regprocedure)
  FROM unnest(ARRAY['idem.key_relations()', 'idem.cleanup_relations(regclass[],integer)', 'idem.node_group()',
                    'idem.worker_groups()', 'idem.cleanup_on_workers(jsonb)', 'idem.cleanup_share(jsonb)',
                    'idem.installation_secret_values()', 'idem.provider_key_bounds()', 'idem.provider_key_prefixes()',
                    'idem.cleanup_workers(integer[],integer)', 'idem.idem_cleanup(integer)',
                    'idem.cleanup_node(integer,double precision,double precision,text)',
                    'idem.cleanup_pass_on_workers(integer,double precision,double precision)',
                    'idem.idem_cleanup_workers(integer,double precision,interval)',
                    'idem.key_figures(regclass[],boolean)', 'idem.figures_on_workers(boolean)',
                    'idem.cluster_figures(boolean)',
                    'idem.idem_cleanup_all(integer,bigint)', 'idem.idem_defaults()', 'idem.idem_version()',
                    'idem.idem_serves_version(integer)',
                    'idem.answer_expires_at(timestamptz,timestamptz,timestamptz)']) AS f;

-- 7. Citus 13.2.1 and 13.2.2 leak the cached plans of statements that a delegated function
--    runs on a worker's shard (about 45 kB per call, never freed while the session lasts:
--    upstream PR #8371, fixed by #8824). On those versions every worker plans custom plans in
--    this database; that costs no throughput there (more, in the measurement of
--    docs/scale-out.md). Other versions are left alone: see docs/scale-out.md to check yours.
SELECT run_command_on_workers(format($cmd$
DO $do$
BEGIN
    IF substring(citus_version() FROM 'Citus ([0-9.]+)') IN ('13.2.1', '13.2.2') THEN
        SET LOCAL citus.enable_ddl_propagation = off;
        ALTER DATABASE %I SET plan_cache_mode = force_custom_plan;
    END IF;
END
$do$
$cmd$, current_database()));

-- 8. Check: every worker has the functions, the sequence and the shards it should.
SELECT nodename, nodeport, success, result
  FROM run_command_on_workers($$SELECT count(*) || ' local shards, tokens from ' || (SELECT min_value FROM pg_sequences
       WHERE schemaname = 'idem' AND sequencename = 'token_seq') || ', plan_cache_mode ' || current_setting('plan_cache_mode')
       FROM unnest(idem.key_relations())$$);

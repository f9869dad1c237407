-- idem_app may call the API and nothing else; PUBLIC may call nothing; no role but the
-- owner may touch the key table, so the functions are its only writers.
BEGIN;
SELECT plan(37);

CREATE ROLE idem_test_stranger NOLOGIN;

SELECT ok(has_function_privilege('idem_app', f, 'EXECUTE'), 'idem_app may execute ' || f)
  FROM unnest(ARRAY[
    'idem.idem_begin(text,text,text,bytea,interval,interval,jsonb,interval)',
    'idem.idem_complete(text,text,bigint,integer,jsonb,bytea,text,text)',
    'idem.idem_save_final(text,text,text,bytea,interval,integer,jsonb,bytea,jsonb,text,text)',
    'idem.idem_release(text,text,bigint)',
    'idem.idem_extend(text,text,bigint,interval)',
    'idem.idem_version()',
    'idem.idem_summary(boolean)',
    'idem.idem_health()',
    'idem.idem_replication()',
    'idem.idem_recovery(text,text,bigint)',
    'idem.idem_begin_steps(text,text,text,bytea,interval,interval,jsonb,interval)',
    'idem.idem_key(text,text)',
    'idem.idem_cleanup(integer)',
    'idem.idem_cleanup_all(integer,bigint)',
    'idem.idem_cleanup_workers(integer,double precision,interval)',
    'idem.idem_cleanup_leased(uuid,integer,double precision,boolean)',
    'idem.idem_defaults()']) AS f;
SELECT ok(NOT has_function_privilege('idem_app', f, 'EXECUTE'), 'idem_app may not execute the internal ' || f)
  FROM unnest(ARRAY['idem.cleanup_relations(regclass[],integer)', 'idem.key_relations()', 'idem.cleanup_share(jsonb)',
                    'idem.cleanup_workers(integer[],integer)', 'idem.cleanup_on_workers(jsonb)', 'idem.worker_groups()',
                    'idem.node_group()', 'idem.answer_expires_at(timestamptz,timestamptz,timestamptz)',
                    'idem.cleanup_node(integer,double precision,double precision,text)',
                    'idem.cleanup_pass_on_workers(integer,double precision,double precision)',
                    'idem.key_figures(regclass[],boolean)', 'idem.figures_on_workers(boolean)',
                    'idem.cluster_figures(boolean)']) AS f;
SELECT is((SELECT count(*) FROM pg_class c, aclexplode(c.relacl) a
            WHERE c.relnamespace = 'idem'::regnamespace AND c.relkind IN ('r', 'S') AND a.grantee <> c.relowner), 0::bigint,
    'no role but the owner holds any privilege on a table or sequence of schema idem');
SELECT ok(NOT has_table_privilege('idem_app', 'idem.idempotency_keys', 'SELECT, INSERT, UPDATE, DELETE, TRUNCATE'),
    'idem_app has no privilege on the table');

SET LOCAL ROLE idem_app;
SELECT is(outcome, 'claimed', 'idem_app claims through the function')
  FROM idem.idem_begin('p', 'k', 'a', sha256('x'));
SELECT throws_ok('SELECT * FROM idem.idempotency_keys', '42501', NULL, 'idem_app cannot read the table');
SELECT throws_ok($$UPDATE idem.idempotency_keys SET state = 'c'$$, '42501', NULL, 'idem_app cannot write the table');
RESET ROLE;

SET LOCAL ROLE idem_test_stranger;
SELECT throws_ok($$SELECT idem.idem_begin('p', 'k2', 'a', sha256('x'))$$, '42501', NULL,
    'a role without the grant (PUBLIC) cannot call the API');
RESET ROLE;
SELECT is((SELECT count(*) FROM pg_proc p, aclexplode(coalesce(p.proacl, acldefault('f', p.proowner))) a
            WHERE p.pronamespace = 'idem'::regnamespace AND a.grantee = 0), 0::bigint,
    'no function in schema idem is granted to PUBLIC');

SELECT * FROM finish();
ROLLBACK;

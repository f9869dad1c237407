-- idem_replication (issue 38), a function of its own so that idem_health keeps release 0.2.0's
-- columns (a migrate replaces it in place under a serving 0.2.0); on a server without
-- standbys, to the application's and the operators' roles: 'none', no standby, no warning. (Synchronous, asynchronous and standby are
-- proven on a real primary and standby: cmd/server/failover_test.go.)
BEGIN;
SELECT plan(6);

SELECT is((SELECT proargnames FROM pg_proc WHERE oid = 'idem.idem_health()'::regprocedure),
    ARRAY['in_progress', 'leases_run_out', 'oldest_in_progress_at', 'oldest_in_progress_age', 'cleanup_backlog',
          'table_bytes', 'estimated_keys'],
    'idem_health keeps release 0.2.0''s columns in their order');
SELECT is((SELECT array_agg(format_type(t, NULL) ORDER BY i)
             FROM pg_proc, unnest(proallargtypes) WITH ORDINALITY AS a(t, i)
            WHERE oid = 'idem.idem_replication()'::regprocedure),
    ARRAY['text', 'integer', 'text'], 'idem_replication: replication text, standbys integer, replication_warning text');
SELECT is(replication || '/' || standbys || '/' || coalesce(replication_warning, '(none)'), 'none/0/(none)',
    'a server without standbys: replication none, no warning') FROM idem.idem_replication();

SET LOCAL ROLE idem_app;
SELECT is(replication || '/' || standbys || '/' || coalesce(replication_warning, '(none)'), 'none/0/(none)',
    'idem_app reads the replication') FROM idem.idem_replication();
RESET ROLE;
SET LOCAL ROLE idem_operator;
SELECT is(replication || '/' || standbys || '/' || coalesce(replication_warning, '(none)'), 'none/0/(none)',
    'idem_operator reads the replication') FROM idem.idem_replication();
RESET ROLE;

-- synchronous_commit is the asking session's: off, no commit waits for a standby, and with no
-- synchronous_standby_names none would anyway.
SET LOCAL synchronous_commit = off;
SELECT is(replication, 'none', 'synchronous_commit off and no standby: none') FROM idem.idem_replication();

SELECT * FROM finish();
ROLLBACK;

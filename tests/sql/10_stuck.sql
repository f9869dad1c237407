-- idem_stuck: the lease claims in progress an operator may have to release, with what
-- idem_release_stuck takes; and who may call it.
BEGIN;
\ir lib/helpers.sql
SELECT plan(17);

-- A lease claim of now, one made 20 minutes ago whose lease ran out (its process died), one
-- made 10 minutes ago still running, a completed key and a transactional claim of another
-- principal.
SELECT pg_temp.b('ops', 'fresh', 'POST /jobs', sha256('j0'), p_lease => '10 minutes');
SELECT pg_temp.b('other', 'dead', 'POST /jobs', sha256('j1'), p_lease => '10 minutes');
SELECT attempt AS dead, provider_key AS dead_provider FROM r \gset
UPDATE idem.idempotency_keys SET claimed_at = now() - interval '20 minutes', lease_expires_at = now() - interval '1 minute'
 WHERE key = 'dead';
SELECT pg_temp.b('ops', 'slow', 'POST /jobs', sha256('j2'), p_lease => '1 hour');
UPDATE idem.idempotency_keys SET claimed_at = now() - interval '10 minutes' WHERE key = 'slow';
SELECT pg_temp.b('ops', 'done', 'POST /t', sha256('done'));
SELECT idem.idem_complete('ops', 'done', (SELECT attempt FROM r), 201, '{}', '{}');

SELECT is(array_agg(principal_id || '/' || key ORDER BY claimed_at), ARRAY['other/dead', 'ops/slow', 'ops/fresh'],
    'every lease claim in progress, oldest first; never a completed key')
  FROM idem.idem_stuck();
SELECT is(array_agg(key), ARRAY['dead', 'slow'], 'older than an age') FROM idem.idem_stuck(p_older_than => '5 minutes');
SELECT is(array_agg(key), ARRAY['dead'], 'at most p_limit') FROM idem.idem_stuck(p_older_than => '5 minutes', p_limit => 1);
SELECT is(attempt, :dead::bigint, 'the token idem_release_stuck takes') FROM idem.idem_stuck('15 minutes');
SELECT is(provider_key, :'dead_provider', 'the provider key its request gave the provider') FROM idem.idem_stuck('15 minutes');
SELECT ok(lease_run_out AND lease_expires_at < now() AND age >= interval '20 minutes' AND claimed_at <= now() - interval '20 minutes',
    'its lease ran out; its age and claim time') FROM idem.idem_stuck('15 minutes');
SELECT ok(NOT lease_run_out, 'a lease that still runs says so') FROM idem.idem_stuck() WHERE key = 'slow';
SELECT throws_ok($$SELECT * FROM idem.idem_stuck('-1 minute')$$, '22023', NULL, 'a negative age is refused');
SELECT throws_ok($$SELECT * FROM idem.idem_stuck(NULL)$$, '22004', NULL, 'a NULL age is refused');
SELECT throws_ok($$SELECT * FROM idem.idem_stuck('-1 month 31 days')$$, '22023', NULL, 'an age with a negative part is refused');
SELECT throws_ok($$SELECT * FROM idem.idem_stuck('300000 years')$$, '22023', NULL, 'an age beyond 10 years is refused, by idem_stuck itself');
SELECT lives_ok($$SELECT * FROM idem.idem_stuck('10 years')$$, 'an age of 10 years is taken');
SELECT throws_ok($$CALL idem.idem_new_installation_secret(NULL)$$, '22004', NULL, 'idem_new_installation_secret: a NULL wait is refused as NULL');
SELECT throws_ok($$SELECT * FROM idem.idem_stuck('0', 0)$$, '22023', NULL, 'a limit below 1 is refused');

-- The release flow starts from it: the token read from the list releases the claim.
SELECT lives_ok(format($$SELECT idem.idem_release_stuck('other', 'dead', %s, 'process killed')$$,
    (SELECT attempt FROM idem.idem_stuck('15 minutes'))), 'the listed token releases the dead claim');

-- Who may call it: operators; not the application (it names keys and tokens).
SET LOCAL ROLE idem_operator;
SELECT is((SELECT count(*) FROM idem.idem_stuck()), 2::bigint,
    'the operator role lists the claims (not the released one: it is not stuck work any more)');
RESET ROLE;
SET LOCAL ROLE idem_app;
SELECT throws_ok($$SELECT * FROM idem.idem_stuck()$$, '42501', NULL, 'the application role may not');
RESET ROLE;

SELECT * FROM finish();
ROLLBACK;

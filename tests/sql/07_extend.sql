-- idem_extend: only the current holder of an in-progress lease claim moves its lease, and the
-- key's expiry with it; never earlier; a stale token, a completed, released or transactional
-- claim raise 55000 and change nothing.
BEGIN;
\ir lib/helpers.sql
SELECT plan(24);

SELECT pg_temp.b('ext', 'job', 'POST /jobs', sha256('job'), p_lease => '1 minute', p_ttl => '1 hour');
SELECT attempt AS a1 FROM r \gset
SELECT lease_expires_at AS lease0, expires_at AS exp0 FROM idem.idempotency_keys WHERE key = 'job' \gset

SELECT ok(idem.idem_extend('ext', 'job', :a1, '10 minutes') > clock_timestamp() + interval '9 minutes',
    'the holder extends its lease and learns its new end');
SELECT ok(lease_expires_at > :'lease0'::timestamptz + interval '8 minutes', 'the lease moved')
  FROM idem.idempotency_keys WHERE key = 'job';
SELECT is(expires_at - lease_expires_at, interval '1 hour', 'the key moved with it: it still lives the TTL past the lease')
  FROM idem.idempotency_keys WHERE key = 'job';
SELECT lease_expires_at AS lease1, expires_at AS exp1 FROM idem.idempotency_keys WHERE key = 'job' \gset
SELECT is(idem.idem_extend('ext', 'job', :a1, '1 second'), :'lease1'::timestamptz, 'a shorter extension leaves the lease as it is');
SELECT is((SELECT expires_at FROM idem.idempotency_keys WHERE key = 'job'), :'exp1'::timestamptz, 'and the key''s expiry too');
SELECT pg_temp.b('ext', 'job', 'POST /jobs', sha256('job'), p_lease => '1 minute', p_ttl => '1 hour');
SELECT is(outcome, 'in_progress', 'a duplicate sees the work in progress') FROM r;
SELECT ok(retry_after > interval '9 minutes', 'and is told to come back when the extended lease ends') FROM r;

-- Taken over: the old token is stale.
UPDATE idem.idempotency_keys SET lease_expires_at = clock_timestamp() - interval '1 second' WHERE key = 'job';
SELECT pg_temp.b('ext', 'job', 'POST /jobs', sha256('job'), p_lease => '1 minute', p_ttl => '1 hour');
SELECT attempt AS a2 FROM r \gset
SELECT lease_expires_at AS lease2 FROM idem.idempotency_keys WHERE key = 'job' \gset
SELECT throws_ok(format($$SELECT idem.idem_extend('ext', 'job', %s, '10 minutes')$$, :a1), '55000', NULL,
    'a stale token cannot extend');
SELECT is((SELECT lease_expires_at FROM idem.idempotency_keys WHERE key = 'job'), :'lease2'::timestamptz,
    'the refused extension changed nothing');
SELECT lives_ok(format($$SELECT idem.idem_extend('ext', 'job', %s, '10 minutes')$$, :a2), 'the new holder can');

-- Completed, released and transactional claims cannot be extended.
SELECT idem.idem_complete('ext', 'job', :a2, 200, '{}', 'done');
SELECT throws_ok(format($$SELECT idem.idem_extend('ext', 'job', %s, '10 minutes')$$, :a2), '55000', NULL,
    'a completed claim cannot be extended');
SELECT pg_temp.b('ext', 'rel', 'POST /jobs', sha256('rel'), p_lease => '1 minute');
SELECT attempt AS a3 FROM r \gset
SELECT idem.idem_release('ext', 'rel', :a3);
SELECT throws_ok(format($$SELECT idem.idem_extend('ext', 'rel', %s, '10 minutes')$$, :a3), '55000', NULL,
    'a released claim cannot be extended');
SELECT pg_temp.b('ext', 'tx', 'POST /t', sha256('tx'));
SELECT throws_ok(format($$SELECT idem.idem_extend('ext', 'tx', %s, '10 minutes')$$, (SELECT attempt FROM r)), '55000', NULL,
    'a transactional claim cannot be extended');
SELECT idem.idem_complete('ext', 'tx', (SELECT attempt FROM r), 200, '{}', NULL);

-- An expired lease claim (its TTL ran out past the lease's end) is absent for its holder as
-- for everyone, whether cleanup came by or not: nothing the holder does revives the key.
SELECT pg_temp.b('ext', 'gone', 'POST /payouts', sha256('gone'), p_lease => '1 minute', p_ttl => '1 minute');
SELECT attempt AS g1, provider_key AS gpk FROM r \gset
UPDATE idem.idempotency_keys SET lease_expires_at = clock_timestamp() - interval '2 minutes',
       expires_at = clock_timestamp() - interval '1 minute' WHERE principal_id = 'ext' AND key = 'gone';
CREATE TEMP TABLE gone_row AS SELECT * FROM idem.idempotency_keys WHERE principal_id = 'ext' AND key = 'gone';
SELECT throws_ok(format($$SELECT idem.idem_extend('ext', 'gone', %s, '10 minutes')$$, :g1), '55000', NULL,
    'the holder of an expired lease claim cannot extend it');
SELECT throws_ok(format($$SELECT idem.idem_complete('ext', 'gone', %s, 200, '{}', 'late')$$, :g1), '55000', NULL,
    'nor answer it');
SELECT throws_ok(format($$SELECT idem.idem_step('ext', 'gone', %s, 's')$$, :g1), '55000', NULL, 'nor record a step');
SELECT throws_ok(format($$SELECT * FROM idem.idem_recovery('ext', 'gone', %s)$$, :g1), '55000', NULL, 'nor read its steps');
SELECT is(idem.idem_yield('ext', 'gone', :g1), false, 'nor yield it');
SELECT is(idem.idem_release('ext', 'gone', :g1), false, 'nor release it');
SELECT is((SELECT count(*) FROM (SELECT * FROM idem.idempotency_keys WHERE principal_id = 'ext' AND key = 'gone'
                                 INTERSECT TABLE gone_row) AS d), 1::bigint, 'the row is as it was');
SELECT pg_temp.b('ext', 'gone', 'POST /payouts', sha256('another request'), p_lease => '1 minute');
SELECT is(outcome || ' ' || (provider_key <> :'gpk')::text, 'claimed true', 'another request claims it: a new generation') FROM r;

-- Bad input.
SELECT throws_ok($$SELECT idem.idem_extend('ext', 'job', NULL, '1 minute')$$, '22004', NULL, 'NULL token');
SELECT throws_ok($$SELECT idem.idem_extend('ext', 'job', 1, '-1 minute')$$, '22023', NULL, 'a lease that is not positive');
SELECT throws_ok($$SELECT idem.idem_extend('ext', 'a b', 1, '1 minute')$$, '22023', NULL, 'a malformed key');

SELECT * FROM finish();
ROLLBACK;

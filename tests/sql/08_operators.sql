-- The operators' view and lever: idem_summary, idem_health, idem_key, idem_release_stuck, and
-- who may call which.
BEGIN;
\ir lib/helpers.sql
SELECT plan(30);

-- A completed key with fields, a one-time secret, a lease in progress, a lease that ran out
-- (its process died), an expired key.
SELECT pg_temp.b('ops', 'done', 'POST /t', sha256('done'), jsonb_build_object('amount', pg_temp.h('1'), 'to', pg_temp.h('2')));
SELECT idem.idem_complete('ops', 'done', (SELECT attempt FROM r), 201, '{"Content-Type":"application/json"}', '{"id":1}', '1');
SELECT pg_temp.b('ops', 'secret', 'POST /tokens', sha256('s'));
SELECT idem.idem_complete('ops', 'secret', (SELECT attempt FROM r), 201, '{}', NULL, '9', 'one_time_secret');
SELECT pg_temp.b('ops', 'running', 'POST /jobs', sha256('j1'), p_lease => '10 minutes');
SELECT pg_temp.b('other', 'stuck', 'POST /jobs', sha256('j2'), p_lease => '10 minutes');
SELECT attempt AS stuck FROM r \gset
UPDATE idem.idempotency_keys SET claimed_at = now() - interval '20 minutes', lease_expires_at = now() - interval '1 minute'
 WHERE key = 'stuck';
SELECT pg_temp.expired('ops', 'old', 3);

SELECT is(keys || '/' || in_progress || '/' || completed || '/' || released || '/' || expired || '/' || leases_run_out,
          '7/2/5/0/3/1', 'the summary counts the keys by state, the backlog and the leases that ran out')
  FROM idem.idem_summary();
SELECT ok(oldest_in_progress_age >= interval '20 minutes' AND table_bytes > 0, 'the oldest claim in progress and the table''s size')
  FROM idem.idem_summary();
SELECT is(array_agg(principal_id || ':' || keys ORDER BY principal_id), ARRAY['ops:6', 'other:1'], 'per principal on request')
  FROM idem.idem_summary(p_by_principal => true);
SELECT ok(principal_id IS NULL AND keys = 7 AND table_bytes > 0, 'NULL asks for the default: one row for all, with the size')
  FROM idem.idem_summary(NULL);
SELECT is(in_progress || '/' || leases_run_out || '/' || cleanup_backlog, '2/1/3', 'the health check sees the same, cheaply')
  FROM idem.idem_health();
SELECT ok(oldest_in_progress_age >= interval '20 minutes', 'and the oldest claim''s age') FROM idem.idem_health();

-- One key's story.
SELECT is(state || '/' || expired::text || '/' || response_status || '/' || body_bytes || '/' || resource_id,
          'completed/false/201/8/1', 'a completed key: state, status, body size, resource id')
  FROM idem.idem_key('ops', 'done');
SELECT is(field_names, ARRAY['amount', 'to'], 'the names of the stored fields, never their values') FROM idem.idem_key('ops', 'done');
SELECT is(convert_from(idem.idem_key_body('ops', 'done'), 'UTF8'), '{"id":1}', 'the body when an operator asks for it');
SELECT ok(kept_until > now() + interval '23 hours' AND claimed_at IS NULL AND lease_expires_at IS NULL,
    'a transactional key: kept the TTL after its answer, no claim time stored') FROM idem.idem_key('ops', 'done');
SELECT is(withheld || '/' || coalesce(encode(idem.idem_key_body('ops', 'secret'), 'hex'), 'none'), 'one_time_secret/none',
    'a one-time secret has no body to show, even when asked') FROM idem.idem_key('ops', 'secret');
SELECT is(state || '/' || (lease_expires_at < now())::text || '/' || attempt, 'in_progress/true/' || :stuck,
    'a stuck lease: in progress, its lease run out, its token') FROM idem.idem_key('other', 'stuck');
SELECT ok(claimed_at <= now() - interval '20 minutes', 'and when it was claimed') FROM idem.idem_key('other', 'stuck');
SELECT is(state || '/' || expired::text, 'completed/true', 'an expired key not yet cleaned up') FROM idem.idem_key('ops', 'old-1');
SELECT is((SELECT count(*) FROM idem.idem_key('ops', 'nothing')), 0::bigint, 'no row for a key that does not exist');

-- The lever.
SELECT throws_ok(format($$SELECT idem.idem_release_stuck('other', 'stuck', %s, 'process killed')$$, :stuck + 1000000),
    '55000', NULL, 'a token that is not the claim''s releases nothing');
SELECT throws_ok($$SELECT idem.idem_release_stuck('ops', 'done', 1, 'x')$$, '55000', NULL, 'a completed key cannot be released');
SELECT throws_ok(format($$SELECT idem.idem_release_stuck('other', 'stuck', %s, repeat('x', 1001))$$, :stuck),
    '22023', NULL, 'a reason over 1000 characters is refused, before anything changes');
SELECT throws_like($$SELECT idem.idem_release_stuck('ops', 'done', 1, 'x')$$, '%completed%', 'and says so');
SELECT lives_ok(format($$SELECT idem.idem_release_stuck('other', 'stuck', %s, 'process killed')$$, :stuck),
    'the stuck lease is released with its token');
SELECT pg_temp.b('other', 'stuck', 'POST /jobs', sha256('j2'), p_lease => '10 minutes');
SELECT is(outcome, 'claimed', 'and the client''s retry runs') FROM r;
-- A lease whose process hangs (its lease still runs): the release ends the lease now; the
-- retry of the same request takes it over with the hung attempt's provider key, and another
-- request under the key is still refused.
SELECT pg_temp.b('other', 'hung', 'POST /jobs', sha256('j3'), p_lease => '10 minutes');
SELECT attempt AS hung, provider_key AS hung_pk FROM r \gset
SELECT idem.idem_release_stuck('other', 'hung', :hung, 'process hangs');
SELECT pg_temp.b('other', 'hung', 'POST /jobs', sha256('another request'), p_lease => '10 minutes');
SELECT is(outcome, 'mismatch', 'a released stuck key still refuses another request') FROM r;
SELECT pg_temp.b('other', 'hung', 'POST /jobs', sha256('j3'), p_lease => '10 minutes');
SELECT is(outcome || ' ' || provider_key, 'claimed ' || :'hung_pk', 'the retry runs at once, with the hung attempt''s provider key') FROM r;

-- Who may call which.
SET LOCAL ROLE idem_app;
SELECT is((SELECT keys FROM idem.idem_summary()), 8::bigint, 'the application role reads the summary');
SELECT is((SELECT state FROM idem.idem_key('ops', 'done')), 'completed', 'and a key''s story');
SELECT throws_ok($$SELECT idem.idem_key_body('ops', 'done')$$, '42501', NULL, 'but not its body');
SELECT throws_ok($$SELECT idem.idem_release_stuck('ops', 'running', 1)$$, '42501', NULL,
    'and it may not release what another process holds');
RESET ROLE;
SET LOCAL ROLE idem_operator;
SELECT is(convert_from(idem.idem_key_body('ops', 'done'), 'UTF8'), '{"id":1}', 'the operator role reads bodies');
SELECT throws_ok($$SELECT idem.idem_begin('ops', 'x', 'a', sha256('x'))$$, '42501', NULL,
    'but cannot claim keys: it is not the application');
RESET ROLE;

-- A run-out lease taken over by a transactional claim keeps no claim time either.
SELECT pg_temp.b('ops', 'ranout', 'POST /jobs', sha256('j3'), p_lease => '10 minutes');
UPDATE idem.idempotency_keys SET lease_expires_at = now() - interval '1 minute' WHERE key = 'ranout';
SELECT pg_temp.b('ops', 'ranout', 'POST /jobs', sha256('j3'));
SELECT is(outcome || '/' || coalesce(k.claimed_at::text, 'no claim time'), 'claimed/no claim time',
    'a transactional takeover of a run-out lease stores no claim time')
  FROM r, idem.idem_key('ops', 'ranout') AS k;

SELECT * FROM finish();
ROLLBACK;

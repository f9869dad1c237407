-- Every outcome of idem_begin, idem_complete, idem_release and idem_save_final.
-- Run with: pg_prove -d DB tests/sql/*.sql (the database needs the idem migrations and the
-- pgtap extension; `make test` does both).
BEGIN;
\ir lib/helpers.sql
SELECT plan(57);

SELECT pg_temp.b('alice', 'k1', 'POST /v1/transfers', sha256('body-1'),
                 jsonb_build_object('amount', pg_temp.h('1'), 'to', pg_temp.h('t1')));
SELECT is(outcome, 'claimed', 'a fresh key is claimed') FROM r;
SELECT ok(attempt > 0, 'a claim has a fencing token') FROM r;
SELECT attempt AS k1_attempt FROM r \gset
SELECT is((SELECT state FROM idem.idempotency_keys WHERE key = 'k1'), 'p'::"char", 'the row is in progress');

SELECT lives_ok(format($$SELECT idem.idem_complete(p_principal => 'alice', p_key => 'k1', p_attempt => %s,
    p_status => 201, p_headers => '{"Content-Type":"application/json","Location":"/v1/transfers/7","X-Odd":"a\tb é"}',
    p_body => '\x7b226964223a20377d0a00ff'::bytea, p_resource_id => '7')$$, :k1_attempt), 'complete stores the response');

-- replay: identical status, headers and body bytes
SELECT pg_temp.b('alice', 'k1', 'POST /v1/transfers', sha256('body-1'));
SELECT is(outcome, 'replay', 'same fingerprint replays') FROM r;
SELECT is(attempt, :k1_attempt::bigint, 'replay reports the completed claim''s token') FROM r;
SELECT is(response_status, 201, 'replay: stored status') FROM r;
SELECT is(response_body, '\x7b226964223a20377d0a00ff'::bytea, 'replay: body byte for byte (NUL and 0xFF included)') FROM r;
SELECT is(response_headers, '{"Content-Type":"application/json","Location":"/v1/transfers/7","X-Odd":"a\tb é"}'::jsonb, 'replay: stored headers') FROM r;
SELECT is(response_headers->>'X-Odd', E'a\tb é', 'replay: a header value exactly as given') FROM r;
SELECT is(resource_id, '7', 'replay: resource id') FROM r;
SELECT is(withheld, NULL, 'replay: nothing withheld') FROM r;

-- mismatch
SELECT pg_temp.b('alice', 'k1', 'POST /v1/transfers', sha256('body-2'),
                 jsonb_build_object('amount', pg_temp.h('2'), 'to', pg_temp.h('t1'), 'memo', pg_temp.h('m')));
SELECT is(outcome, 'mismatch', 'another fingerprint is a mismatch') FROM r;
SELECT is(changed_fields, ARRAY['amount','memo'], 'mismatch names changed and added fields, sorted') FROM r;
SELECT is(response_body, NULL, 'mismatch carries no response') FROM r;

SELECT pg_temp.b('alice', 'k1', 'POST /v1/transfers', sha256('body-2'), jsonb_build_object('to', pg_temp.h('t1')));
SELECT is(changed_fields, ARRAY['amount'], 'a removed field is named too') FROM r;

SELECT pg_temp.b('alice', 'k1', 'PUT /v1/transfers', sha256('body-1'),
                 jsonb_build_object('amount', pg_temp.h('1'), 'to', pg_temp.h('t1')));
SELECT is(changed_fields, '{}'::text[], 'another action: changed_fields is {}') FROM r;
SELECT pg_temp.b('alice', 'k1', 'PUT /v1/transfers', sha256('body-1'));
SELECT is(changed_fields, '{}'::text[], 'another action without field hashes: still {}') FROM r;

SELECT pg_temp.b('alice', 'k1', 'POST /v1/transfers', sha256('body-3'));
SELECT is(changed_fields, NULL, 'another body without field hashes: changed_fields is NULL') FROM r;

SELECT pg_temp.b('bob', 'k1', 'POST /v1/transfers', sha256('body-3'));
SELECT is(outcome, 'claimed', 'another principal with the same key is independent') FROM r;
SELECT attempt AS bob_attempt FROM r \gset
SELECT isnt(:bob_attempt::bigint, :k1_attempt::bigint, 'every claim gets its own token');
SELECT throws_ok(format($$SELECT idem.idem_release('bob', 'k1', %s)$$, :bob_attempt), '55000', NULL,
    'a transactional claim is not released: its transaction rolls back');

-- an expired key behaves as absent
UPDATE idem.idempotency_keys SET expires_at = now() - interval '1 day', lease_expires_at = now() - interval '1 day' WHERE principal_id = 'alice' AND key = 'k1';
SELECT pg_temp.b('alice', 'k1', 'POST /v1/other', sha256('body-9'));
SELECT is(outcome, 'claimed', 'an expired key is claimed again, whatever the request') FROM r;
SELECT ok(attempt > :k1_attempt, 'with a new token (fencing)') FROM r;
SELECT is((SELECT response_body FROM idem.idempotency_keys WHERE key = 'k1' AND principal_id = 'alice'), NULL,
    'the old response is gone');

-- lease claims
SELECT pg_temp.b('alice', 'lease', 'POST /v1/jobs', sha256('job'), p_lease => '30 seconds');
SELECT is(outcome, 'claimed', 'a lease claim') FROM r;
SELECT attempt AS lease1 FROM r \gset
SELECT pg_temp.b('alice', 'lease', 'POST /v1/jobs', sha256('job'), p_lease => '30 seconds');
SELECT is(outcome, 'in_progress', 'a running lease is in_progress') FROM r;
SELECT ok(retry_after > interval '29 seconds' AND retry_after <= interval '30 seconds', 'retry_after is what the lease still runs') FROM r;
SELECT is(attempt, :lease1::bigint, 'in_progress reports the holder''s token') FROM r;

UPDATE idem.idempotency_keys SET lease_expires_at = clock_timestamp() - interval '1 second' WHERE key = 'lease';
SELECT pg_temp.b('alice', 'lease', 'POST /v1/jobs', sha256('other job'), p_lease => '30 seconds');
SELECT is(outcome, 'mismatch', 'a lease that ran out is not taken over by another request') FROM r;
SELECT pg_temp.b('alice', 'lease', 'POST /v1/jobs', sha256('job'), p_lease => '30 seconds');
SELECT is(outcome, 'claimed', 'a lease that ran out is taken over by the same request') FROM r;
SELECT attempt AS lease2 FROM r \gset
SELECT ok(:lease2 > :lease1, 'the takeover has a new token') FROM r;

SELECT throws_ok(format($$SELECT idem.idem_complete('alice', 'lease', %s, 200, '{}', 'late')$$, :lease1), '55000', NULL,
    'the superseded holder cannot complete (fencing)');
SELECT is((SELECT state FROM idem.idempotency_keys WHERE key = 'lease'), 'p'::"char", 'the refused completion wrote nothing');
SELECT is(idem.idem_release('alice', 'lease', :lease1), false, 'the superseded holder cannot release');
SELECT is(idem.idem_release('alice', 'lease', :lease2), true, 'the holder releases');
SELECT throws_ok(format($$SELECT idem.idem_complete('alice', 'lease', %s, 200, '{}', 'x')$$, :lease2), '55000', NULL,
    'a released claim cannot complete');
SELECT pg_temp.b('alice', 'lease', 'POST /v1/jobs', sha256('another job'), p_lease => '30 seconds');
SELECT is(outcome, 'claimed', 'a released key is claimed again by any request') FROM r;
SELECT attempt AS lease3 FROM r \gset

-- withheld responses
SELECT lives_ok(format($$SELECT idem.idem_complete('alice', 'lease', %s, 201, '{}', NULL, 'tok_1', 'one_time_secret')$$, :lease3),
    'a one-time secret is completed without its body');
SELECT pg_temp.b('alice', 'lease', 'POST /v1/jobs', sha256('another job'));
SELECT is(withheld || '/' || response_status || '/' || coalesce(encode(response_body, 'hex'), 'null'),
    'one_time_secret/201/null', 'its replay says why the body is withheld') FROM r;

-- save_final for a key nobody holds
SELECT is(idem.idem_save_final('alice', 'final', 'POST /v1/transfers', sha256('f'), '1 hour', 422,
    '{"Content-Type":"application/problem+json"}', '{"code":"insufficient_funds"}'), true, 'save_final stores a new key');
SELECT is(idem.idem_save_final('alice', 'final', 'POST /v1/transfers', sha256('f'), '1 hour', 404,
    '{}', 'other'), false, 'save_final never overwrites a completed key');
SELECT is((SELECT response_status FROM idem.idempotency_keys WHERE key = 'final'), 422::smallint, 'the first final response stays');
SELECT is(idem.idem_save_final('alice', 'lease', 'POST /v1/jobs', sha256('another job'), '1 hour', 404, '{}', 'x'), false,
    'save_final leaves a completed key alone, even for the same request');
UPDATE idem.idempotency_keys SET expires_at = now() - interval '1 day', lease_expires_at = NULL WHERE key = 'final';
SELECT is(idem.idem_save_final('alice', 'final', 'POST /v1/transfers', sha256('g'), NULL, 404, '{}', NULL,
    p_withheld => 'too_large', p_resource_id => '/v1/things/9'), true, 'save_final replaces an expired row (default TTL)');
SELECT pg_temp.b('alice', 'final', 'POST /v1/transfers', sha256('g'));
SELECT is(outcome || '/' || response_status || '/' || withheld || '/' || resource_id, 'replay/404/too_large//v1/things/9',
    'a final answer carries withheld and the resource id') FROM r;

-- save_final in the claiming transaction, after the work rolled back to a savepoint
SELECT pg_temp.b('alice', 'own', 'POST /v1/transfers', sha256('o'));
SELECT attempt AS own FROM r \gset
SAVEPOINT work;
CREATE TEMP TABLE work_done AS SELECT 1 AS n;
ROLLBACK TO SAVEPOINT work;
SELECT is(idem.idem_save_final('alice', 'own', 'POST /v1/transfers', sha256('o'), NULL, 422, '{}', 'no'), true,
    'save_final finalizes this transaction''s own claim');
SELECT is((SELECT state::text || '/' || attempt || '/' || coalesce(uncompleted::text, 'null') FROM idem.idempotency_keys WHERE key = 'own'),
    'c/' || :own || '/null', 'completed, with the claim''s own token, and the guard released');
SELECT pg_temp.b('alice', 'own2', 'POST /v1/transfers', sha256('o2'));
SELECT is(idem.idem_save_final('alice', 'own2', 'POST /v1/transfers', sha256('not the claim'), NULL, 422, '{}', 'no'), false,
    'save_final does not finalize its own claim with another request');
SELECT is(idem.idem_save_final('alice', 'own2', 'POST /v1/transfers', sha256('o2'), NULL, 422, '{}', 'no'), true,
    'with its own request it does');

SELECT is(outcome, 'claimed', 'a key of exactly 255 visible ASCII characters is accepted')
  FROM idem.idem_begin('alice', repeat('~', 254) || '!', 'POST /v1/x', sha256('x'));
SELECT lives_ok(format($$SELECT idem.idem_complete('alice', repeat('~', 254) || '!', %s, 200, '{}', NULL)$$, attempt), 'and completed')
  FROM idem.idempotency_keys WHERE key = repeat('~', 254) || '!';

-- A repeat of a committed key draws no fencing token and stores nothing: replay, mismatch
-- (with the changed fields named) and in_progress of a lease are read from the row.
SELECT pg_temp.b('alice', 'rep', 'POST /v1/transfers', sha256('rep-1'),
                 jsonb_build_object('amount', pg_temp.h('1'), 'to', pg_temp.h('t1')));
SELECT idem.idem_complete('alice', 'rep', attempt, 201, '{}', NULL) FROM r;
SELECT pg_temp.b('alice', 'lease-held', 'POST /v1/payouts', sha256('l'), NULL, '1 hour');
SELECT last_value AS seq_before FROM idem.token_seq \gset
SELECT is(string_agg(outcome || coalesce(':' || array_to_string(changed_fields, ','), ''), ' ' ORDER BY n), 'replay mismatch:amount,to in_progress',
    'a replay, a mismatch and an in_progress answer')
  FROM (SELECT 1 AS n, * FROM idem.idem_begin('alice', 'rep', 'POST /v1/transfers', sha256('rep-1'))
        UNION ALL
        SELECT 2, * FROM idem.idem_begin('alice', 'rep', 'POST /v1/transfers', sha256('rep-2'),
                                         p_request_fields => jsonb_build_object('amount', pg_temp.h('2'), 'to', pg_temp.h('t2')))
        UNION ALL
        SELECT 3, * FROM idem.idem_begin('alice', 'lease-held', 'POST /v1/payouts', sha256('l'), p_lease => '1 hour')) AS o;
SELECT is((SELECT last_value FROM idem.token_seq), :seq_before::bigint, 'drew no fencing token');
SELECT throws_ok($$SELECT idem.idem_begin('alice', 'rep', 'POST /v1/transfers', sha256('rep-1'), p_request_fields => '{"amount": 1}')$$,
    '22023', NULL, 'a repeat with malformed field hashes is refused as a fresh request is');

-- The stored form of the field hashes: each name in UTF-8, a NUL byte and the first 8 bytes of
-- its hash, in jsonb's order of the names, byte for byte as every release stored it (a stored
-- key is compared with a later request's fields by these bytes), whatever builds it.
SELECT pg_temp.b('alice', 'form', 'POST /v1/transfers', sha256('form'),
                 jsonb_build_object('é', pg_temp.h('1'), 'b', pg_temp.h('2'), 'aa', pg_temp.h('3'), 'zz', upper(pg_temp.h('4'))));
SELECT is((SELECT request_fields FROM idem.idempotency_keys WHERE key = 'form'),
          (SELECT string_agg(convert_to(f.key, 'UTF8') || '\x00'::bytea || decode(left(f.value #>> '{}', 16), 'hex'), ''::bytea)
             FROM jsonb_each(jsonb_build_object('é', pg_temp.h('1'), 'b', pg_temp.h('2'), 'aa', pg_temp.h('3'), 'zz', upper(pg_temp.h('4')))) AS f),
          'the field hashes are stored in the form every release stored them');
SELECT pg_temp.b('alice', 'empty', 'POST /v1/transfers', sha256('empty'), '{}');
SELECT is((SELECT request_fields FROM idem.idempotency_keys WHERE key = 'empty'), ''::bytea,
          'an empty object is stored as known and empty');

SELECT * FROM finish();
ROLLBACK;

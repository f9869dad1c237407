-- Every outcome of idem_begin, idem_complete, idem_release and idem_save_final.
-- Run with: pg_prove -d DB tests/sql/*.sql (the database needs the idem migrations and the
-- pgtap extension; `make test` does both).
BEGIN;
SELECT plan(42);

CREATE TEMP TABLE r AS
SELECT * FROM idem.idem_begin(p_principal => 'alice', p_key => 'k1', p_action => 'POST /v1/transfers',
    p_request_sha256 => sha256('body-1'), p_request_fields => '{"amount":"a1","to":"t1"}');
SELECT is(outcome, 'claimed', 'a fresh key is claimed') FROM r;
SELECT is(attempt, 1, 'a fresh claim is attempt 1') FROM r;
SELECT is((SELECT state FROM idem.idempotency_keys WHERE key = 'k1'), 'in_progress', 'the row is in_progress');

SELECT lives_ok($$SELECT idem.idem_complete(p_principal => 'alice', p_key => 'k1', p_attempt => 1,
    p_status => 201, p_headers => '{"Content-Type":"application/json","Location":"/v1/transfers/7","X-Odd":"a\tb é"}',
    p_body => '\x7b226964223a20377d0a00ff'::bytea, p_resource_id => '7')$$, 'complete stores the response');

-- replay: identical status, headers and body bytes
TRUNCATE r; INSERT INTO r
SELECT * FROM idem.idem_begin(p_principal => 'alice', p_key => 'k1', p_action => 'POST /v1/transfers',
    p_request_sha256 => sha256('body-1'));
SELECT is(outcome, 'replay', 'same fingerprint replays') FROM r;
SELECT is(response_status, 201, 'replay: stored status') FROM r;
SELECT is(response_body, '\x7b226964223a20377d0a00ff'::bytea, 'replay: body byte for byte (NUL and 0xFF included)') FROM r;
SELECT is(response_headers, '{"Content-Type":"application/json","Location":"/v1/transfers/7","X-Odd":"a\tb é"}'::jsonb, 'replay: stored headers') FROM r;
SELECT is(response_headers->>'X-Odd', E'a\tb é', 'replay: a header value exactly as given') FROM r;
SELECT is(resource_id, '7', 'replay: resource id') FROM r;
SELECT is(withheld, NULL, 'replay: nothing withheld') FROM r;

-- mismatch
TRUNCATE r; INSERT INTO r
SELECT * FROM idem.idem_begin(p_principal => 'alice', p_key => 'k1', p_action => 'POST /v1/transfers',
    p_request_sha256 => sha256('body-2'), p_request_fields => '{"amount":"a2","to":"t1","memo":"m"}');
SELECT is(outcome, 'mismatch', 'another fingerprint is a mismatch') FROM r;
SELECT is(changed_fields, ARRAY['amount','memo'], 'mismatch names changed and added fields, sorted') FROM r;
SELECT is(response_body, NULL, 'mismatch carries no response') FROM r;

TRUNCATE r; INSERT INTO r
SELECT * FROM idem.idem_begin(p_principal => 'alice', p_key => 'k1', p_action => 'PUT /v1/transfers',
    p_request_sha256 => sha256('body-1'), p_request_fields => '{"amount":"a1","to":"t1"}');
SELECT is(changed_fields, '{}'::text[], 'another action: changed_fields is {}') FROM r;

TRUNCATE r; INSERT INTO r
SELECT * FROM idem.idem_begin(p_principal => 'alice', p_key => 'k1', p_action => 'POST /v1/transfers',
    p_request_sha256 => sha256('body-3'));
SELECT is(changed_fields, NULL, 'without field hashes changed_fields is NULL') FROM r;

TRUNCATE r; INSERT INTO r
SELECT * FROM idem.idem_begin(p_principal => 'bob', p_key => 'k1', p_action => 'POST /v1/transfers',
    p_request_sha256 => sha256('body-3'));
SELECT is(outcome, 'claimed', 'another principal with the same key is independent') FROM r;
SELECT lives_ok($$SELECT idem.idem_release('bob', 'k1', 1)$$, 'release of a transactional claim');

-- an expired key behaves as absent
UPDATE idem.idempotency_keys SET created_at = now() - interval '2 days', expires_at = now() - interval '1 day'
 WHERE principal_id = 'alice' AND key = 'k1';
TRUNCATE r; INSERT INTO r
SELECT * FROM idem.idem_begin(p_principal => 'alice', p_key => 'k1', p_action => 'POST /v1/other',
    p_request_sha256 => sha256('body-9'));
SELECT is(outcome, 'claimed', 'an expired key is claimed again, whatever the request') FROM r;
SELECT is(attempt, 2, 'the attempt keeps counting across expiry (fencing)') FROM r;
SELECT is((SELECT response_body FROM idem.idempotency_keys WHERE key = 'k1' AND principal_id = 'alice'), NULL,
    'the old response is gone');

-- lease claims
TRUNCATE r; INSERT INTO r
SELECT * FROM idem.idem_begin(p_principal => 'alice', p_key => 'lease', p_action => 'POST /v1/jobs',
    p_request_sha256 => sha256('job'), p_lease => '30 seconds');
SELECT is(outcome, 'claimed', 'a lease claim') FROM r;
TRUNCATE r; INSERT INTO r
SELECT * FROM idem.idem_begin(p_principal => 'alice', p_key => 'lease', p_action => 'POST /v1/jobs',
    p_request_sha256 => sha256('job'), p_lease => '30 seconds');
SELECT is(outcome, 'in_progress', 'a running lease is in_progress') FROM r;
SELECT ok(retry_after > interval '29 seconds' AND retry_after <= interval '30 seconds', 'retry_after is what the lease still runs') FROM r;
SELECT is(attempt, 1, 'in_progress reports the holder''s attempt') FROM r;

UPDATE idem.idempotency_keys SET lease_expires_at = clock_timestamp() - interval '1 second' WHERE key = 'lease';
TRUNCATE r; INSERT INTO r
SELECT * FROM idem.idem_begin(p_principal => 'alice', p_key => 'lease', p_action => 'POST /v1/jobs',
    p_request_sha256 => sha256('other job'), p_lease => '30 seconds');
SELECT is(outcome, 'mismatch', 'a lease that ran out is not taken over by another request') FROM r;
TRUNCATE r; INSERT INTO r
SELECT * FROM idem.idem_begin(p_principal => 'alice', p_key => 'lease', p_action => 'POST /v1/jobs',
    p_request_sha256 => sha256('job'), p_lease => '30 seconds');
SELECT is(outcome, 'claimed', 'a lease that ran out is taken over by the same request') FROM r;
SELECT is(attempt, 2, 'the takeover is attempt 2') FROM r;

SELECT throws_ok($$SELECT idem.idem_complete('alice', 'lease', 1, 200, '{}', 'late')$$, '55000', NULL,
    'the superseded attempt cannot complete (fencing)');
SELECT is((SELECT state FROM idem.idempotency_keys WHERE key = 'lease'), 'in_progress', 'the refused completion wrote nothing');
SELECT is(idem.idem_release('alice', 'lease', 1), false, 'the superseded attempt cannot release');
SELECT is(idem.idem_release('alice', 'lease', 2), true, 'the holder releases');
SELECT throws_ok($$SELECT idem.idem_complete('alice', 'lease', 2, 200, '{}', 'x')$$, '55000', NULL,
    'a released claim cannot complete');
TRUNCATE r; INSERT INTO r
SELECT * FROM idem.idem_begin(p_principal => 'alice', p_key => 'lease', p_action => 'POST /v1/jobs',
    p_request_sha256 => sha256('another job'), p_lease => '30 seconds');
SELECT is(outcome || '/' || attempt, 'claimed/3', 'a released key is claimed again by any request, attempt 3') FROM r;

-- withheld responses
SELECT lives_ok($$SELECT idem.idem_complete('alice', 'lease', 3, 201, '{}', NULL, 'tok_1', 'one_time_secret')$$,
    'a one-time secret is completed without its body');
TRUNCATE r; INSERT INTO r
SELECT * FROM idem.idem_begin(p_principal => 'alice', p_key => 'lease', p_action => 'POST /v1/jobs',
    p_request_sha256 => sha256('another job'));
SELECT is(withheld || '/' || response_status || '/' || coalesce(encode(response_body, 'hex'), 'null'),
    'one_time_secret/201/null', 'its replay says why the body is withheld') FROM r;

-- save_final
SELECT is(idem.idem_save_final('alice', 'final', 'POST /v1/transfers', sha256('f'), '1 hour', 422,
    '{"Content-Type":"application/problem+json"}', '{"code":"insufficient_funds"}'), true, 'save_final stores a new key');
SELECT is(idem.idem_save_final('alice', 'final', 'POST /v1/transfers', sha256('f'), '1 hour', 404,
    '{}', 'other'), false, 'save_final never overwrites a live row');
SELECT is((SELECT response_status FROM idem.idempotency_keys WHERE key = 'final'), 422, 'the first final response stays');
SELECT is(idem.idem_save_final('alice', 'lease', 'POST /v1/jobs', sha256('f'), '1 hour', 404, '{}', 'x'), false,
    'save_final leaves a completed key alone');
UPDATE idem.idempotency_keys SET created_at = now() - interval '2 days', expires_at = now() - interval '1 day' WHERE key = 'final';
SELECT is(idem.idem_save_final('alice', 'final', 'POST /v1/transfers', sha256('g'), '1 hour', 404, '{}', 'new'), true,
    'save_final replaces an expired row');

SELECT is(outcome, 'claimed', 'a key of exactly 255 visible ASCII characters is accepted')
  FROM idem.idem_begin('alice', repeat('~', 254) || '!', 'POST /v1/x', sha256('x'));

SELECT * FROM finish();
ROLLBACK;

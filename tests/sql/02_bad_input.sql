-- Bad input to every function: a clear SQL error with a documented SQLSTATE, nothing written.
-- 22004 null_value_not_allowed, 22023 invalid_parameter_value.
BEGIN;
SELECT plan(91);

CREATE TEMP TABLE bad (fn text, call text, state text);
INSERT INTO bad VALUES
 ('begin', $$SELECT idem.idem_begin(NULL, 'k', 'a', sha256('x'))$$, '22004'),
 ('begin', $$SELECT idem.idem_begin('p', NULL, 'a', sha256('x'))$$, '22004'),
 ('begin', $$SELECT idem.idem_begin('', 'k', 'a', sha256('x'))$$, '22023'),
 ('begin', $$SELECT idem.idem_begin(repeat('p', 256), 'k', 'a', sha256('x'))$$, '22023'),
 ('begin', $$SELECT idem.idem_begin('p', '', 'a', sha256('x'))$$, '22023'),
 ('begin', $$SELECT idem.idem_begin('p', repeat('k', 256), 'a', sha256('x'))$$, '22023'),
 ('begin', $$SELECT idem.idem_begin('p', E'k\n1', 'a', sha256('x'))$$, '22023'),
 ('begin', $$SELECT idem.idem_begin('p', 'k 1', 'a', sha256('x'))$$, '22023'),
 ('begin', $$SELECT idem.idem_begin('p', 'clé', 'a', sha256('x'))$$, '22023'),
 ('begin', $$SELECT idem.idem_begin('p', 'k', NULL, sha256('x'))$$, '22004'),
 ('begin', $$SELECT idem.idem_begin('p', 'k', '', sha256('x'))$$, '22023'),
 ('begin', $$SELECT idem.idem_begin('p', 'k', 'a', NULL)$$, '22004'),
 ('begin', $$SELECT idem.idem_begin('p', 'k', 'a', '\x00'::bytea)$$, '22023'),
 ('begin', $$SELECT idem.idem_begin('p', 'k', 'a', sha512('x'))$$, '22023'),
 ('begin', $$SELECT idem.idem_begin('p', 'k', 'a', sha256('x'), p_ttl => '0')$$, '22023'),
 ('begin', $$SELECT idem.idem_begin('p', 'k', 'a', sha256('x'), p_ttl => '-1 hour')$$, '22023'),
 ('begin', $$SELECT idem.idem_begin('p', 'k', 'a', sha256('x'), p_ttl => '-1 year 361 days')$$, '22023'),
 ('begin', $$SELECT idem.idem_begin('p', 'k', 'a', sha256('x'), p_ttl => '1 day -1 second')$$, '22023'),
 ('begin', $$SELECT idem.idem_begin('p', 'k', 'a', sha256('x'), p_ttl => '1 mon -29 days')$$, '22023'),
 ('begin', $$SELECT idem.idem_begin('p', 'k', 'a', sha256('x'), p_lease => '0')$$, '22023'),
 ('begin', $$SELECT idem.idem_begin('p', 'k', 'a', sha256('x'), p_lease => '1 day -1 second')$$, '22023'),
 ('begin', $$SELECT idem.idem_begin('p', 'k', 'a', sha256('x'), p_ttl => '10 years 1 day')$$, '22023'),
 ('begin', $$SELECT idem.idem_begin('p', 'k', 'a', sha256('x'), p_lease => '200000 years')$$, '22023'),
 ('save_final', $$SELECT idem.idem_save_final('p', 'k', 'a', sha256('x'), '11 years', 404, '{}', NULL)$$, '22023'),
 ('extend', $$SELECT idem.idem_extend('p', 'k', 1, '11 years')$$, '22023'),
 ('begin', $$SELECT idem.idem_begin('p', 'k', 'a', sha256('x'), p_request_fields => '[1]')$$, '22023'),
 ('begin', $$SELECT idem.idem_begin('p', 'k', 'a', sha256('x'), p_request_fields => '{"a": 1}')$$, '22023'),
 ('begin', $$SELECT idem.idem_begin('p', 'k', 'a', sha256('x'), p_request_fields => '{"a": "not hex at all"}')$$, '22023'),
 ('begin', $$SELECT idem.idem_begin('p', 'k', 'a', sha256('x'), p_request_fields => '{"a": "abc"}')$$, '22023'),
 ('begin', $$SELECT idem.idem_begin('p', 'k', 'a', sha256('x'), p_request_fields => '{"a": "0123456789ab    cdef0123"}')$$, '22023'),
 ('begin', $$SELECT idem.idem_begin('p', 'k', 'a', sha256('x'), p_lock_timeout => '-1 s')$$, '22023'),
 ('begin', $$SELECT idem.idem_begin('p', 'k', 'a', sha256('x'), p_lock_timeout => '1 day -1 s')$$, '22023'),
 ('complete', $$SELECT idem.idem_complete('p', 'k', 1, 99, '{}', NULL)$$, '22023'),
 ('complete', $$SELECT idem.idem_complete('p', 'k', 1, 600, '{}', NULL)$$, '22023'),
 ('complete', $$SELECT idem.idem_complete('p', 'k', NULL, 200, '{}', NULL)$$, '22004'),
 ('complete', $$SELECT idem.idem_complete('p', 'k', 1, NULL, '{}', NULL)$$, '22004'),
 ('complete', $$SELECT idem.idem_complete('p', 'k', 1, 200, NULL, NULL)$$, '22004'),
 ('complete', $$SELECT idem.idem_complete('p', 'k', 1, 200, '[]', NULL)$$, '22023'),
 ('complete', $$SELECT idem.idem_complete('p', 'k', 1, 200, '{"Content-Length": 12}', NULL)$$, '22023'),
 ('complete', $$SELECT idem.idem_complete('p', 'k', 1, 200, '{"Vary": ["a", "b"]}', NULL)$$, '22023'),
 ('complete', $$SELECT idem.idem_complete('p', 'k', 1, 200, '{}', NULL, NULL, 'secret')$$, '22023'),
 ('complete', $$SELECT idem.idem_complete('p', 'k', 1, 200, '{}', 'body', NULL, 'too_large')$$, '22023'),
 ('complete', $$SELECT idem.idem_complete('p', 'k 1', 1, 200, '{}', NULL)$$, '22023'),
 ('save_final', $$SELECT idem.idem_save_final('p', 'k', 'a', sha256('x'), '1 hour', 1000, '{}', NULL)$$, '22023'),
 ('save_final', $$SELECT idem.idem_save_final('p', E'k\t', 'a', sha256('x'), '1 hour', 404, '{}', NULL)$$, '22023'),
 ('save_final', $$SELECT idem.idem_save_final('p', 'k', 'a', sha256('x'), '1 hour', NULL, '{}', NULL)$$, '22004'),
 ('save_final', $$SELECT idem.idem_save_final('p', 'k', 'a', sha256('x'), '-1 year 361 days', 404, '{}', NULL)$$, '22023'),
 ('save_final', $$SELECT idem.idem_save_final('p', 'k', 'a', sha256('x'), '1 hour', 404, '{"a": true}', NULL)$$, '22023'),
 ('save_final', $$SELECT idem.idem_save_final('p', 'k', 'a', sha256('x'), '1 hour', 404, '{}', 'b', p_withheld => 'too_large')$$, '22023'),
 ('save_final', $$SELECT idem.idem_save_final('p', 'k', 'a', sha256('x'), '1 hour', 404, '{}', NULL, p_request_fields => '"x"')$$, '22023'),
 ('save_final', $$SELECT idem.idem_save_final('p', 'k', 'a', sha256('x'), '1 hour', 404, '{}', NULL, p_request_fields => '{"a": " 0123456789abcdef"}')$$, '22023'),
 ('save_final', $$SELECT idem.idem_save_final('p', 'k', NULL, sha256('x'), '1 hour', 404, '{}', NULL)$$, '22004'),
 ('release', $$SELECT idem.idem_release('p', 'k', NULL)$$, '22004'),
 ('release', $$SELECT idem.idem_release(NULL, 'k', 1)$$, '22004'),
 ('cleanup', $$SELECT idem.idem_cleanup(0)$$, '22023'),
 ('cleanup', $$SELECT idem.idem_cleanup(NULL)$$, '22004'),
 ('cleanup_workers', $$SELECT * FROM idem.idem_cleanup_workers(0)$$, '22023'),
 ('cleanup_workers', $$SELECT * FROM idem.idem_cleanup_workers(100, 0)$$, '22023'),
 ('cleanup_workers', $$SELECT * FROM idem.idem_cleanup_workers(100, 1.5)$$, '22023'),
 ('cleanup_workers', $$SELECT * FROM idem.idem_cleanup_workers(100, 'NaN')$$, '22023'),
 ('cleanup_workers', $$SELECT * FROM idem.idem_cleanup_workers(100, 1, '0 s')$$, '22023'),
 ('cleanup_workers', $$SELECT * FROM idem.idem_cleanup_workers(100, 1, '2 hours')$$, '22023'),
 ('cleanup_workers', $$SELECT * FROM idem.idem_cleanup_workers(100, NULL)$$, '22004'),
 ('cleanup_leased', $$SELECT idem.idem_cleanup_leased(NULL)$$, '22004'),
 ('cleanup_leased', $$SELECT idem.idem_cleanup_leased(gen_random_uuid(), 0)$$, '22023'),
 ('cleanup_leased', $$SELECT idem.idem_cleanup_leased(gen_random_uuid(), 100, 0)$$, '22023'),
 ('cleanup_leased', $$SELECT idem.idem_cleanup_leased(gen_random_uuid(), 100, 'NaN')$$, '22023');

SELECT throws_ok(call, state, NULL, fn || ' refuses: ' || call) FROM bad;
-- Values that are not strings, though their text would decode (a number of 16 digits), or
-- that have no text (null): refused by idem_begin's own message on a fresh key, and by
-- idem_save_final's.
SELECT throws_ok($$SELECT idem.idem_begin('p', 'num', 'a', sha256('x'), p_request_fields => '{"a": 1234567890123456}')$$,
    '22023', 'idem_begin: p_request_fields must be a JSON object whose values are hex SHA-256 digests (at least 16 hex digits)',
    'a number whose text would decode is refused on a fresh key');
SELECT throws_ok($$SELECT idem.idem_begin('p', 'nul', 'a', sha256('x'), p_request_fields => '{"a": "0123456789abcdef", "b": null}')$$,
    '22023', 'idem_begin: p_request_fields must be a JSON object whose values are hex SHA-256 digests (at least 16 hex digits)',
    'a null value is refused on a fresh key');
SELECT throws_ok($$SELECT idem.idem_save_final('p', 'num', 'a', sha256('x'), '1 hour', 404, '{}', NULL, p_request_fields => '{"a": 1234567890123456}')$$,
    '22023', 'idem_save_final: p_request_fields must be a JSON object whose values are hex SHA-256 digests (at least 16 hex digits)',
    'and by idem_save_final');
SELECT is((SELECT count(*) FROM idem.idempotency_keys WHERE key IN ('num', 'nul')), 0::bigint, 'nothing of them is stored');
SELECT throws_ok($$SELECT idem.idem_begin('p', 'k', 'a', sha256('x'), p_lock_timeout => '25 days')$$, '22023',
    'idem_begin: p_lock_timeout must be at most 2147483.647 seconds (PostgreSQL''s largest lock_timeout, about 24.8 days), got 25 days',
    'a lock timeout PostgreSQL cannot take is named as the argument');
SELECT lives_ok($$SELECT idem.idem_begin('p', 'k24', 'a', sha256('x'), p_lock_timeout => '2147483.647 seconds')$$,
    'the largest lock timeout PostgreSQL takes is accepted');
DELETE FROM idem.idempotency_keys WHERE key = 'k24';
SELECT throws_ok($$SELECT idem.idem_cleanup(0)$$, '22023', 'idem_cleanup: p_batch_size must be at least 1, got 0',
    'the error names the function called, not an internal one');
SELECT is((SELECT count(*) FROM idem.idempotency_keys), 0::bigint, 'nothing was written');

-- A completed key's replay is answered before the key and request arguments are tested (a row
-- is found only for arguments once accepted, D138); bad arguments on that key still raise, and
-- change nothing. idem_complete tests the key once it finds no claim; a bad one still raises.
SELECT idem.idem_complete('p', 'done', b.attempt, 201, '{}', 'answer')
  FROM idem.idem_begin('p', 'done', 'a', sha256('x'), p_request_fields => '{"f": "0123456789abcdef"}') AS b;
DELETE FROM bad;
INSERT INTO bad VALUES
 ('begin', $$SELECT idem.idem_begin('p', 'done', NULL, sha256('x'))$$, '22004'),
 ('begin', $$SELECT idem.idem_begin('p', 'done', repeat('a', 1001), sha256('x'))$$, '22023'),
 ('begin', $$SELECT idem.idem_begin('p', 'done', 'a', substr(sha256('x'), 1, 31))$$, '22023'),
 ('begin', $$SELECT idem.idem_begin('p', 'done', 'a', sha256('x'), p_ttl => '0 s')$$, '22023'),
 ('begin', $$SELECT idem.idem_begin('p', 'done', 'a', sha256('x'), p_lease => '-1 s')$$, '22023'),
 ('begin', $$SELECT idem.idem_begin('p', 'done', 'a', sha256('x'), p_lock_timeout => '0 s')$$, '22023'),
 ('begin', $$SELECT idem.idem_begin('p', 'done', 'a', sha256('x'), p_lock_timeout => '25 days')$$, '22023'),
 ('begin', $$SELECT idem.idem_begin('p', 'done', 'a', sha256('x'), p_request_fields => '{"f": 1}')$$, '22023'),
 ('begin', $$SELECT idem.idem_begin('p', 'done', 'a', sha256('x'), p_request_fields => '[]')$$, '22023'),
 ('begin', $$SELECT idem.idem_begin('p', 'done', 'a', sha256('x'), p_request_fields => '{"f": "0123456789ab    cdef0123"}')$$, '22023'),
 ('complete', $$SELECT idem.idem_complete(NULL, 'done', 1, 200, '{}', NULL)$$, '22004'),
 ('complete', $$SELECT idem.idem_complete('p', repeat('k', 256), 1, 200, '{}', NULL)$$, '22023');
SELECT throws_ok(call, state, NULL, fn || ' refuses, on a completed key: ' || call) FROM bad;
SELECT is((SELECT format('%s %s %s', count(*), min(state), min(convert_from(response_body, 'UTF8'))) FROM idem.idempotency_keys),
    '1 c answer', 'the completed key is as it was');
DELETE FROM idem.idempotency_keys;
-- Only a field hash's first 16 characters are examined and stored: what follows them is not
-- looked at, on a fresh key as on a completed one.
SELECT is(outcome, 'claimed', 'a field hash whose first 16 characters are hex is taken on a fresh key')
  FROM idem.idem_begin('p', 'suffix', 'a', sha256('x'), p_request_fields => '{"f": "0123456789abcdef: the rest is not read"}');
SELECT idem.idem_complete('p', 'suffix', attempt, 201, '{}', 'ok') FROM idem.idempotency_keys WHERE key = 'suffix';
SELECT is(outcome, 'replay', 'and on a completed key')
  FROM idem.idem_begin('p', 'suffix', 'a', sha256('x'), p_request_fields => '{"f": "0123456789abcdef0"}');
DELETE FROM idem.idempotency_keys WHERE key = 'suffix';
SELECT lives_ok($$SELECT idem.idem_release('p', 'tenyears', attempt) FROM idem.idem_begin('p', 'tenyears', 'a', sha256('x'), p_ttl => '86400 hours', p_lease => '86400 hours')$$,
    'a TTL and a lease of exactly 10 years (120 months of 30 days, in hours) are accepted');

SELECT * FROM finish();
ROLLBACK;

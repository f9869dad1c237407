-- The bound of cleanup, to the millisecond: idem_cleanup never deletes a key before its expiry
-- (both expires_at and lease_expires_at passed), however close to it it runs, and deletes it
-- once it has passed. Keys expire a few milliseconds to a second after the first pass; one pass
-- must keep every key whose expiry is later than the instant it ended.
BEGIN;
\ir lib/helpers.sql
SELECT plan(6);

CREATE TEMP TABLE bound (key text PRIMARY KEY, expiry timestamptz NOT NULL);
-- Completed keys whose expiry is close: by expires_at (the claim's), or by lease_expires_at
-- (the answer's, after an expires_at that has passed), from 2 ms to a second ahead.
WITH d(key, ms, by_answer) AS (VALUES ('c2', 2, false), ('c5', 5, false), ('c20', 20, false), ('c100', 100, false),
                                      ('c1000', 1000, false), ('a5', 5, true), ('a20', 20, true), ('a1000', 1000, true)),
     t AS (SELECT key, clock_timestamp() + ms * interval '1 millisecond' AS expiry, by_answer FROM d)
INSERT INTO idem.idempotency_keys (expires_at, lease_expires_at, attempt, action_hash, state, principal_id, key, request_sha256,
    response_status, response_headers)
SELECT CASE WHEN by_answer THEN expiry - interval '1 hour' ELSE expiry END, CASE WHEN by_answer THEN expiry END,
       nextval('idem.token_seq'), 0, 'c', 'bound', key, sha256(key::bytea), 200, '{}'
  FROM t;
INSERT INTO bound SELECT key, greatest(expires_at, coalesce(lease_expires_at, expires_at)) FROM idem.idempotency_keys
 WHERE principal_id = 'bound';

SELECT idem.idem_cleanup(1000);
SELECT clock_timestamp() AS first_end \gset
SELECT is((SELECT count(*) FROM bound b WHERE b.expiry > :'first_end'::timestamptz
             AND NOT EXISTS (SELECT FROM idem.idempotency_keys k WHERE k.principal_id = 'bound' AND k.key = b.key)),
    0::bigint, 'a pass deletes no key whose expiry is later than the instant it ended');
SELECT ok(EXISTS (SELECT FROM idem.idempotency_keys WHERE principal_id = 'bound' AND key = 'c1000'),
    'a key a second from its claim''s expiry stays');
SELECT ok(EXISTS (SELECT FROM idem.idempotency_keys WHERE principal_id = 'bound' AND key = 'a1000'),
    'a key a second from its answer''s expiry stays, though its claim''s has passed');

-- 120 ms later: the keys that expired are deleted, the others stay.
SELECT pg_sleep(0.12);
SELECT clock_timestamp() AS second_start \gset
SELECT idem.idem_cleanup(1000);
SELECT clock_timestamp() AS second_end \gset
SELECT is((SELECT count(*) FROM bound b WHERE b.expiry <= :'second_start'::timestamptz
             AND EXISTS (SELECT FROM idem.idempotency_keys k WHERE k.principal_id = 'bound' AND k.key = b.key)),
    0::bigint, 'a pass deletes every key that had expired when it began');
SELECT is((SELECT count(*) FROM bound b WHERE b.expiry > :'second_end'::timestamptz
             AND NOT EXISTS (SELECT FROM idem.idempotency_keys k WHERE k.principal_id = 'bound' AND k.key = b.key)),
    0::bigint, 'and still none whose expiry is later than the instant it ended');
SELECT is((SELECT count(*) FROM idem.idempotency_keys WHERE principal_id = 'bound' AND key IN ('c1000', 'a1000')), 2::bigint,
    'the keys a second away stay');

SELECT * FROM finish();
ROLLBACK;

-- idem_cleanup: deletes expired rows only, at most one batch, oldest first, and counts them;
-- never a row whose lease still runs. cleanup_relations: the same path over several tables.
BEGIN;
\ir lib/helpers.sql
SELECT plan(14);

-- 25 expired rows (expired 1..25 minutes ago) and 5 live ones.
SELECT pg_temp.expired('p', 'old', 25);
INSERT INTO idem.idempotency_keys (expires_at, attempt, action_hash, state, principal_id, key, request_sha256,
    response_status, response_headers)
SELECT now() + interval '1 hour', nextval('idem.token_seq'), 0, 'c', 'p', 'live-' || i, sha256(i::text::bytea), 200, '{}'
  FROM generate_series(1, 5) AS i;
-- A row whose TTL ran out while a lease on it still runs (a lease now extends the key, but
-- 0.1.0 stored such rows).
INSERT INTO idem.idempotency_keys (expires_at, attempt, action_hash, lease_expires_at, state, principal_id, key, request_sha256)
VALUES (now() - interval '1 hour', nextval('idem.token_seq'), 0, now() + interval '1 hour', 'p', 'p', 'leased', sha256('l'));

SELECT is(idem.idem_cleanup(10), 10, 'a full batch of 10');
SELECT is((SELECT count(*) FROM idem.idempotency_keys WHERE key IN ('old-25', 'old-16')), 0::bigint,
    'the oldest expired rows went first');
SELECT is((SELECT count(*) FROM idem.idempotency_keys WHERE key = 'old-15'), 1::bigint,
    'a newer expired row waits for the next batch');
SELECT is(idem.idem_cleanup(10), 10, 'a second full batch');
SELECT is(idem.idem_cleanup(10), 5, 'a short batch: the pass is over');
SELECT is(idem.idem_cleanup(), 0, 'nothing left to delete (default batch size)');
SELECT is((SELECT count(*) FROM idem.idempotency_keys WHERE key LIKE 'live-%'), 5::bigint, 'live rows are untouched');
SELECT is((SELECT count(*) FROM idem.idempotency_keys WHERE key = 'leased'), 1::bigint, 'a row whose lease runs stays');
SELECT is((SELECT count(*) FROM idem.idempotency_keys), 6::bigint, 'only live rows remain');

-- The shared path over two relations of the same shape.
CREATE TABLE idem.keys_copy (LIKE idem.idempotency_keys);
SELECT pg_temp.expired('p', 'gone', 7);
INSERT INTO idem.keys_copy SELECT * FROM idem.idempotency_keys WHERE key LIKE 'gone-%';
DELETE FROM idem.idempotency_keys WHERE key LIKE 'gone-%';
SELECT pg_temp.expired('p', 'here', 4);
SELECT is(idem.cleanup_relations(ARRAY['idem.idempotency_keys', 'idem.keys_copy']::regclass[], 6), 6,
    'one batch across two relations: the first drained, the rest from the second');
SELECT is((SELECT count(*) FROM idem.keys_copy), 5::bigint, 'the second gave what the first did not');
SELECT is(idem.cleanup_relations(ARRAY['idem.idempotency_keys', 'idem.keys_copy']::regclass[], 6), 5, 'then the rest');
SELECT throws_ok($$SELECT idem.cleanup_relations(ARRAY['pg_catalog.pg_class']::regclass[], 1)$$, '22023', NULL,
    'cleanup_relations touches only tables of schema idem');
SELECT is(idem.key_relations(), ARRAY['idem.idempotency_keys']::regclass[], 'without Citus the key table is the one relation');

SELECT * FROM finish();
ROLLBACK;

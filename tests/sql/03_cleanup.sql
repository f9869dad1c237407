-- idem_cleanup: deletes expired rows only, at most one batch, oldest first, and counts them.
BEGIN;
SELECT plan(8);

-- 25 expired rows (expired 1..25 minutes ago) and 5 live ones.
INSERT INTO idem.idempotency_keys (principal_id, key, state, attempt, created_at, expires_at, action,
    request_sha256, completed_at, response_status, response_headers)
SELECT 'p', 'old-' || i, 'completed', 1, now() - interval '1 day', now() - i * interval '1 minute', 'a',
       sha256(i::text::bytea), now() - interval '1 day', 200, '{}'
  FROM generate_series(1, 25) AS i;
INSERT INTO idem.idempotency_keys (principal_id, key, state, attempt, created_at, expires_at, action,
    request_sha256, completed_at, response_status, response_headers)
SELECT 'p', 'live-' || i, 'completed', 1, now(), now() + interval '1 hour', 'a',
       sha256(i::text::bytea), now(), 200, '{}'
  FROM generate_series(1, 5) AS i;

SELECT is(idem.idem_cleanup(10), 10, 'a full batch of 10');
SELECT is((SELECT count(*) FROM idem.idempotency_keys WHERE key IN ('old-25', 'old-16')), 0::bigint,
    'the oldest expired rows went first');
SELECT is((SELECT count(*) FROM idem.idempotency_keys WHERE key = 'old-15'), 1::bigint,
    'a newer expired row waits for the next batch');
SELECT is(idem.idem_cleanup(10), 10, 'a second full batch');
SELECT is(idem.idem_cleanup(10), 5, 'a short batch: the pass is over');
SELECT is(idem.idem_cleanup(), 0, 'nothing left to delete (default batch size)');
SELECT is((SELECT count(*) FROM idem.idempotency_keys WHERE key LIKE 'live-%'), 5::bigint, 'live rows are untouched');
SELECT is((SELECT count(*) FROM idem.idempotency_keys), 5::bigint, 'only live rows remain');

SELECT * FROM finish();
ROLLBACK;

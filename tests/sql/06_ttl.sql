-- What a TTL means: a key is replayable for at least the TTL after its answer was stored,
-- however long the work took; the completion changes no indexed column (it stays HOT).
BEGIN;
\ir lib/helpers.sql
SELECT plan(17);

-- A transactional claim with a TTL of one hour, completed later in its transaction.
SELECT pg_temp.b('ttl', 'tx', 'POST /t', sha256('tx'), p_ttl => '1 hour');
SELECT attempt AS tx FROM r \gset
SELECT expires_at AS tx_expires FROM idem.idempotency_keys WHERE key = 'tx' \gset
SELECT pg_sleep(0.2);
SELECT clock_timestamp() AS before_tx \gset
SELECT idem.idem_complete('ttl', 'tx', :tx, 201, '{}', 'done');
SELECT ok(lease_expires_at >= :'before_tx'::timestamptz + interval '1 hour',
    'a transactional answer is kept at least the TTL after it was given')
  FROM idem.idempotency_keys WHERE key = 'tx';
SELECT is(expires_at, :'tx_expires'::timestamptz, 'the completion leaves expires_at (indexed) as it was: a HOT update')
  FROM idem.idempotency_keys WHERE key = 'tx';

-- Its claim's TTL has run out, its answer's has not: it replays and cleanup keeps it.
UPDATE idem.idempotency_keys SET expires_at = now() - interval '1 minute' WHERE key = 'tx';
SELECT pg_temp.b('ttl', 'tx', 'POST /t', sha256('tx'));
SELECT is(outcome, 'replay', 'a key whose answer is younger than its TTL replays, though its claim is older') FROM r;
SELECT pg_temp.b('ttl', 'tx', 'POST /t', sha256('another request'));
SELECT is(outcome, 'mismatch', 'and another request under it is refused') FROM r;
SELECT idem.idem_cleanup(1000);
SELECT is((SELECT count(*) FROM idem.idempotency_keys WHERE key = 'tx'), 1::bigint, 'cleanup keeps it');
UPDATE idem.idempotency_keys SET lease_expires_at = now() - interval '1 minute' WHERE key = 'tx';
SELECT is(idem.idem_cleanup(1000), 1, 'once both have passed, cleanup deletes it');

-- A lease claim: its key lives the TTL past the lease's end; a lease may outlast the TTL.
SELECT pg_temp.b('ttl', 'lease', 'POST /t', sha256('lease'), p_lease => '2 hours', p_ttl => '1 hour');
SELECT is(outcome, 'claimed', 'a lease longer than the TTL is accepted') FROM r;
SELECT attempt AS lease FROM r \gset
SELECT is(expires_at - lease_expires_at, interval '1 hour', 'a running lease''s key expires the TTL after the lease''s end')
  FROM idem.idempotency_keys WHERE key = 'lease';
SELECT clock_timestamp() AS before_lease \gset
SELECT idem.idem_complete('ttl', 'lease', :lease, 200, '{}', 'done');
SELECT ok(lease_expires_at >= :'before_lease'::timestamptz + interval '1 hour'
          AND lease_expires_at < clock_timestamp() + interval '1 hour',
    'a lease''s answer is kept the TTL after it was given (not after the lease''s end)')
  FROM idem.idempotency_keys WHERE key = 'lease';
-- Its answer's TTL has run out, its claim's (the lease's end plus the TTL) has not: the key is
-- expired (D200; it replayed until the lease's end plus the TTL).
UPDATE idem.idempotency_keys SET lease_expires_at = now() - interval '1 minute' WHERE key = 'lease';
SELECT is((SELECT expired FROM idem.idem_key('ttl', 'lease')), true, 'idem_key says a lease''s answer past its TTL expired');
SELECT pg_temp.b('ttl', 'lease', 'POST /t', sha256('lease'), p_lease => '2 hours', p_ttl => '1 hour');
SELECT is(outcome, 'claimed', 'a lease''s answer past its TTL is absent, though its lease''s end plus the TTL is not past') FROM r;
SELECT isnt(attempt, :lease::bigint, 'with a new token') FROM r;
SELECT pg_temp.b('ttl', 'lease3', 'POST /t', sha256('lease3'), p_lease => '2 hours', p_ttl => '1 hour');
SELECT attempt AS lease3 FROM r \gset
SELECT idem.idem_complete('ttl', 'lease3', :lease3, 200, '{}', 'done');
UPDATE idem.idempotency_keys SET lease_expires_at = now() - interval '1 minute' WHERE key = 'lease3';
SELECT is(idem.idem_save_final('ttl', 'lease3', 'POST /t', sha256('other'), '1 hour', 422, '{}', 'no'), true,
    'idem_save_final stores over a lease''s answer past its TTL');

-- A lease taken over: the key lives the TTL past the new lease.
SELECT pg_temp.b('ttl', 'lease2', 'POST /t', sha256('lease2'), p_lease => '1 minute', p_ttl => '1 hour');
UPDATE idem.idempotency_keys SET lease_expires_at = clock_timestamp() - interval '1 second',
       expires_at = clock_timestamp() + interval '10 minutes' WHERE key = 'lease2';
SELECT pg_temp.b('ttl', 'lease2', 'POST /t', sha256('lease2'), p_lease => '1 minute', p_ttl => '1 hour');
SELECT is(outcome, 'claimed', 'a lease that ran out is taken over') FROM r;
SELECT ok(expires_at >= lease_expires_at + interval '1 hour', 'the taken-over key lives the TTL past the new lease')
  FROM idem.idempotency_keys WHERE key = 'lease2';

-- A final answer in the claiming transaction, given late.
SELECT pg_temp.b('ttl', 'final', 'POST /t', sha256('final'), p_ttl => '1 hour');
SELECT pg_sleep(0.1);
SELECT clock_timestamp() AS before_final \gset
SELECT idem.idem_save_final('ttl', 'final', 'POST /t', sha256('final'), '1 hour', 422, '{}', 'no');
SELECT ok(lease_expires_at >= :'before_final'::timestamptz + interval '1 hour',
    'a final answer stored in the claiming transaction is kept the TTL after it was given')
  FROM idem.idempotency_keys WHERE key = 'final';
-- Its p_ttl counts too: an answer is kept at least p_ttl after it is stored, whatever the
-- claim's TTL was.
SELECT pg_temp.b('ttl', 'final2', 'POST /t', sha256('final2'), p_ttl => '2 seconds');
SELECT clock_timestamp() AS before_final2 \gset
SELECT idem.idem_save_final('ttl', 'final2', 'POST /t', sha256('final2'), '1 hour', 422, '{}', 'no');
SELECT ok(greatest(expires_at, lease_expires_at) >= :'before_final2'::timestamptz + interval '1 hour',
    'a final answer in the claiming transaction is kept its own p_ttl after it was given')
  FROM idem.idempotency_keys WHERE key = 'final2';

SELECT * FROM finish();
ROLLBACK;

-- Generations and provider keys: every attempt of one request (a replay, a duplicate while it
-- runs, a takeover of its lease, a retry after it yielded its lease) gets the same provider key;
-- any later request under the key (after expiry, cleanup or a release), and every other
-- principal, gets another. And the TTL counts from the answer on every path, a transactional
-- takeover of a lease included.
BEGIN;
\ir lib/helpers.sql
SELECT plan(24);

-- One request, its attempts.
SELECT pg_temp.b('gen', 'k', 'POST /payouts', sha256('100'), p_lease => '1 minute', p_ttl => '1 hour');
SELECT attempt AS a1, provider_key AS pk1 FROM r \gset
SELECT ok(:'pk1' ~ '^[0-9a-f]{64}$', 'a claim returns a provider key of 64 hex digits');
SELECT pg_temp.b('gen', 'k', 'POST /payouts', sha256('100'), p_lease => '1 minute', p_ttl => '1 hour');
SELECT is(outcome, 'in_progress', 'a duplicate while the lease runs is told so') FROM r;
SELECT is(provider_key, :'pk1', 'with the same provider key') FROM r;
SELECT pg_temp.b('gen', 'k', 'POST /payouts', sha256('250000'), p_lease => '1 minute', p_ttl => '1 hour');
SELECT is(outcome, 'mismatch', 'another request under the key is refused') FROM r;
SELECT is(provider_key, NULL, 'and is given no provider key') FROM r;

-- The lease runs out; the same request takes it over, as a lease and then as a transactional claim.
UPDATE idem.idempotency_keys SET lease_expires_at = clock_timestamp() - interval '1 second' WHERE key = 'k';
SELECT pg_temp.b('gen', 'k', 'POST /payouts', sha256('100'), p_lease => '1 minute', p_ttl => '1 hour');
SELECT attempt AS a2 FROM r \gset
SELECT is(outcome, 'claimed', 'a lease that ran out is taken over') FROM r;
SELECT ok(:a2 <> :a1, 'with a new token');
SELECT is(provider_key, :'pk1', 'in the same generation: the same provider key') FROM r;
-- This lease ran out a minute ago (its key lives the TTL past that end): the answer of the
-- transactional takeover is still kept the TTL after it is given, not after the dead lease.
UPDATE idem.idempotency_keys SET lease_expires_at = clock_timestamp() - interval '1 minute',
       expires_at = clock_timestamp() - interval '1 minute' + interval '1 hour' WHERE key = 'k';
SELECT pg_temp.b('gen', 'k', 'POST /payouts', sha256('100'), p_ttl => '1 hour');
SELECT attempt AS a3 FROM r \gset
SELECT is(outcome || ' ' || provider_key, 'claimed ' || :'pk1', 'a transactional takeover keeps the generation too') FROM r;
SELECT clock_timestamp() AS before_answer \gset
SELECT idem.idem_complete('gen', 'k', :a3, 201, '{}', 'paid');
SELECT ok(greatest(expires_at, lease_expires_at) >= :'before_answer'::timestamptz + interval '1 hour',
    'the answer after a transactional takeover of a lease is kept the TTL after it was given')
  FROM idem.idempotency_keys WHERE key = 'k';
SELECT pg_temp.b('gen', 'k', 'POST /payouts', sha256('100'), p_lease => '1 minute', p_ttl => '1 hour');
SELECT is(outcome || ' ' || provider_key, 'replay ' || :'pk1', 'a replay names the request''s provider key') FROM r;

-- After expiry: a new request, a new generation.
UPDATE idem.idempotency_keys SET expires_at = clock_timestamp() - interval '1 second',
       lease_expires_at = clock_timestamp() - interval '1 second' WHERE key = 'k';
SELECT pg_temp.b('gen', 'k', 'POST /payouts', sha256('250000'), p_lease => '1 minute', p_ttl => '1 hour');
SELECT provider_key AS pk2, attempt AS a4 FROM r \gset
SELECT is(outcome, 'claimed', 'after expiry the key takes a new request') FROM r;
SELECT isnt(:'pk2'::text, :'pk1'::text, 'which gets a provider key of its own');
-- The same body as the first request, after expiry, is a new request too.
UPDATE idem.idempotency_keys SET state = 'r', lease_expires_at = NULL WHERE key = 'k';
SELECT pg_temp.b('gen', 'k', 'POST /payouts', sha256('100'), p_lease => '1 minute', p_ttl => '1 hour');
SELECT provider_key AS pk3, attempt AS a5 FROM r \gset
SELECT ok(:'pk3' <> :'pk1' AND :'pk3' <> :'pk2', 'a released key starts a new generation, even for the first request''s body');
-- After cleanup.
SELECT idem.idem_complete('gen', 'k', :a5, 201, '{}', 'paid');
UPDATE idem.idempotency_keys SET expires_at = clock_timestamp() - interval '1 second',
       lease_expires_at = clock_timestamp() - interval '1 second' WHERE key = 'k';
SELECT idem.idem_cleanup(1000);
SELECT pg_temp.b('gen', 'k', 'POST /payouts', sha256('100'), p_lease => '1 minute', p_ttl => '1 hour');
SELECT ok(provider_key NOT IN (:'pk1', :'pk2', :'pk3'), 'a key cleaned up and claimed again starts a new generation') FROM r;

-- Another principal, the same key and request.
SELECT pg_temp.b('gen-other', 'k', 'POST /payouts', sha256('100'), p_lease => '1 minute', p_ttl => '1 hour');
SELECT ok(provider_key NOT IN (:'pk1', :'pk2', :'pk3'), 'another principal''s key never shares a provider key') FROM r;

-- idem_yield: the lease ends now, the key stays with its request.
SELECT pg_temp.b('gen', 'y', 'POST /payouts', sha256('y'), p_lease => '1 minute', p_ttl => '1 hour');
SELECT attempt AS y1, provider_key AS ypk FROM r \gset
SELECT is(idem.idem_yield('gen', 'y', :y1 + 1000000), false, 'a wrong token yields nothing');
SELECT is(idem.idem_yield('gen', 'y', :y1), true, 'the holder yields its lease');
SELECT pg_temp.b('gen', 'y', 'POST /payouts', sha256('other'), p_lease => '1 minute', p_ttl => '1 hour');
SELECT is(outcome, 'mismatch', 'another request under a yielded key is still refused') FROM r;
SELECT pg_temp.b('gen', 'y', 'POST /payouts', sha256('y'), p_lease => '1 minute', p_ttl => '1 hour');
SELECT is(outcome || ' ' || provider_key, 'claimed ' || :'ypk', 'the same request takes it over at once, in the same generation') FROM r;
SELECT is(idem.idem_yield('gen', 'y', :y1), false, 'the old holder, fenced off, cannot yield the new one''s lease');
SELECT pg_temp.b('gen', 'tx', 'POST /t', sha256('tx'));
SELECT attempt AS t1 FROM r \gset
SELECT is(idem.idem_yield('gen', 'tx', :t1), false, 'a transactional claim has no lease to yield');
SELECT idem.idem_complete('gen', 'tx', :t1, 201, '{}', 'ok');

-- A final answer for a free key starts a generation; one stored by the claiming transaction keeps its claim's.
SELECT idem.idem_save_final('gen', 'f', 'POST /t', sha256('f'), '1 hour', 404, '{}', 'no');
SELECT pg_temp.b('gen', 'f', 'POST /t', sha256('f'));
SELECT is(outcome, 'replay', 'a final answer stored for a free key replays') FROM r;
SELECT ok(provider_key ~ '^[0-9a-f]{64}$', 'with the provider key of its own generation') FROM r;

SELECT * FROM finish();
ROLLBACK;

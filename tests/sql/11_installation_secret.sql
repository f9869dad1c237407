-- The installation's secret in provider keys: a generation started by this release hashes the
-- secret in (label v3); one that the previous release started (a token below the secret's
-- from_token, from idem.attempt_seq) keeps that release's key (label v2) through takeovers, so
-- an upgrade changes no existing generation's key. Nobody but the owner reads the secret.
BEGIN;
\ir lib/helpers.sql
SELECT plan(10);

SELECT s.from_token AS from_token,
       (SELECT encode(string_agg(int8send(pg_sequence_last_value(u.q::regclass)), ''::bytea ORDER BY u.o), 'hex')
          FROM unnest(s.secret_seqs) WITH ORDINALITY AS u(q, o)) AS secret
  FROM idem.installation_secrets AS s ORDER BY s.from_token LIMIT 1 \gset
SELECT is((SELECT count(*) FROM idem.installation_secrets), 1::bigint, 'an installation has one secret');
SELECT is(octet_length(decode(:'secret', 'hex')), 32, 'of 32 bytes');
SELECT ok((SELECT last_value FROM idem.token_seq) >= :from_token, 'tokens come from idem.token_seq, at or above the secret''s first token');

-- A new generation: label v3 with the secret.
SELECT pg_temp.b('inst', 'k', 'POST /payouts', sha256('1'), p_lease => '1 minute');
SELECT attempt AS a1, provider_key AS pk1 FROM r \gset
SELECT ok(:a1 >= :from_token, 'a new claim''s token is at or above the secret''s first token');
SELECT is(:'pk1', encode(sha256('pgidem provider key v3'::bytea || '\x00'::bytea || decode(:'secret', 'hex') || '\x00'::bytea
    || 'inst'::bytea || '\x00'::bytea || 'k'::bytea || '\x00'::bytea || convert_to(:a1::text, 'UTF8')), 'hex'),
    'a new generation''s provider key is the SHA-256 of label v3, the secret, the principal, the key and the generation');

-- A generation the previous release started: its token came from idem.attempt_seq, below the
-- secret's first token (on an upgraded database; this one is new, so one below is made up).
INSERT INTO idem.idempotency_keys (expires_at, attempt, action_hash, lease_expires_at, state, principal_id, key,
                                   request_sha256, claimed_at)
VALUES (now() + interval '1 day', :from_token - 1, hashtextextended('POST /payouts', 0),
        clock_timestamp() - interval '1 second', 'p', 'inst', 'old', sha256('2'), now() - interval '1 minute');
SELECT attempt AS old FROM idem.idempotency_keys WHERE key = 'old' \gset
SELECT ok(:old < :from_token, 'the previous release''s tokens are below the secret''s first token');
SELECT pg_temp.b('inst', 'old', 'POST /payouts', sha256('2'), p_lease => '1 minute');
SELECT is(outcome || ' ' || provider_key, 'claimed ' || encode(sha256('pgidem provider key v2'::bytea || '\x00'::bytea
    || 'inst'::bytea || '\x00'::bytea || 'old'::bytea || '\x00'::bytea || convert_to(:old::text, 'UTF8')), 'hex'),
    'a takeover of a lease the previous release claimed keeps that release''s provider key') FROM r;
SELECT ok(attempt >= :from_token, 'with a new token from the new sequence') FROM r;

-- Privileges: the application and the operators cannot read the secret.
SET LOCAL ROLE idem_app;
SELECT throws_ok('SELECT pg_sequence_last_value(''idem.installation_secret_1_1'')', '42501', NULL, 'the application role cannot read the secret');
RESET ROLE;
SET LOCAL ROLE idem_operator;
SELECT throws_ok('SELECT last_value FROM idem.installation_secret_1_1', '42501', NULL, 'the operators'' role cannot read it either');
RESET ROLE;

SELECT * FROM finish();
ROLLBACK;

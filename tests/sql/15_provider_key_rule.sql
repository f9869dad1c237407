-- The provider key's prefix by token (provider_key_bounds, provider_key_prefixes): the rule of
-- docs/sql-api.md ("Generations and provider keys") worked out once a session for intervals of
-- tokens. A generation takes the secret whose first token is the greatest at or below it, if
-- that token is in the generation's token range (the top 16 bits); otherwise label v2 without
-- a secret. Here with four secrets of distinct values over three token ranges (one range
-- without a secret, one with two), compared with the rule itself around every bound, and end to
-- end through idem_begin's takeover of a lease in three ranges.
BEGIN;
\ir lib/helpers.sql
SELECT plan(8);

-- Three more secrets, each with four sequences of its own values: two in token range 1, one in
-- range 3 (range 2 has none). publish_secrets writes the lists from the table; here the same
-- lists are written from it by hand.
DO $$
DECLARE
    i integer;
    j integer;
BEGIN
    FOR i IN 2..4 LOOP
        FOR j IN 1..4 LOOP
            EXECUTE format('CREATE SEQUENCE idem.installation_secret_t%s_%s AS bigint MINVALUE -9223372036854775808', i, j);
            PERFORM setval(format('idem.installation_secret_t%s_%s', i, j)::regclass, i * 1000 + j);
        END LOOP;
        INSERT INTO idem.installation_secrets (from_token, secret_seqs)
        VALUES (CASE i WHEN 2 THEN (1::bigint << 48) + 5 WHEN 3 THEN (1::bigint << 48) + 100 ELSE (3::bigint << 48) + 7 END,
                ARRAY[format('idem.installation_secret_t%s_1', i), format('idem.installation_secret_t%s_2', i),
                      format('idem.installation_secret_t%s_3', i), format('idem.installation_secret_t%s_4', i)]::regclass[]);
    END LOOP;
    EXECUTE format($fn$CREATE OR REPLACE FUNCTION idem.installation_secret_tokens() RETURNS bigint[]
        LANGUAGE sql IMMUTABLE SECURITY INVOKER SET search_path = pg_catalog, pg_temp AS %L$fn$,
        format('SELECT %L::bigint[]', (SELECT array_agg(s.from_token ORDER BY s.from_token) FROM idem.installation_secrets AS s)));
    EXECUTE format($fn$CREATE OR REPLACE FUNCTION idem.installation_secret_seqs() RETURNS regclass[]
        LANGUAGE sql IMMUTABLE SECURITY INVOKER SET search_path = pg_catalog, pg_temp AS %L$fn$,
        format('SELECT %L::regclass[]', (SELECT array_agg(u.q ORDER BY s.from_token, u.o)
                                           FROM idem.installation_secrets AS s,
                                                unnest(s.secret_seqs) WITH ORDINALITY AS u(q, o))));
    -- As idem_new_installation_secret does: every session compiles idem_begin anew.
    ALTER FUNCTION idem.idem_begin(text, text, text, bytea, interval, interval, jsonb, interval) COST 100;
END
$$;
SELECT is(cardinality(idem.installation_secret_tokens()), 4, 'four secrets');

-- The rule, as the docs state it, for one generation.
CREATE FUNCTION pg_temp.rule(g bigint) RETURNS bytea LANGUAGE sql AS $$
    SELECT CASE WHEN width_bucket(g, t) > 0 AND t[width_bucket(g, t)] >> 48 = g >> 48
                THEN 'pgidem provider key v3'::bytea || '\x00'::bytea || v[width_bucket(g, t)] || '\x00'::bytea
                ELSE 'pgidem provider key v2'::bytea || '\x00'::bytea END
      FROM (SELECT idem.installation_secret_tokens() AS t, idem.installation_secret_values() AS v) AS q
$$;
-- The tokens around every secret's first token and every range's start, from range 0 to 4.
CREATE TEMP TABLE g AS
SELECT DISTINCT x.g + d.d AS g
  FROM (SELECT unnest(idem.installation_secret_tokens()) AS g
        UNION ALL SELECT r::bigint << 48 FROM generate_series(0, 4) AS r
        UNION ALL SELECT ((r::bigint + 1) << 48) - 1 FROM generate_series(0, 4) AS r) AS x,
       generate_series(-2, 2) AS d(d)
 WHERE x.g + d.d > 0;

SELECT is((SELECT count(*) FROM g
            WHERE (idem.provider_key_prefixes())[width_bucket(g.g, idem.provider_key_bounds()) + 1] IS DISTINCT FROM pg_temp.rule(g.g)),
          0::bigint, 'the prefix by interval is the rule''s, around every secret''s first token and every range''s start');
SELECT is((SELECT count(DISTINCT pg_temp.rule(g.g)) FROM g), 5::bigint,
          'those tokens meet all four secrets and the label without one');
SELECT is(idem.provider_key_bounds(),
          ARRAY[(SELECT min(from_token) FROM idem.installation_secrets), 1::bigint << 48, (1::bigint << 48) + 5,
                (1::bigint << 48) + 100, 2::bigint << 48, (3::bigint << 48) + 7, 4::bigint << 48],
          'the bounds: each secret''s first token, and the end of its range where no secret starts there');

-- End to end: a lease the previous holder lost, in each of three ranges, taken over by
-- idem_begin, which hands out its generation's provider key.
INSERT INTO idem.idempotency_keys (expires_at, attempt, action_hash, lease_expires_at, state, principal_id, key,
                                   request_sha256, claimed_at)
SELECT now() + interval '1 day', t.g, hashtextextended('POST /payouts', 0), clock_timestamp() - interval '1 second', 'p',
       'rule', 'k' || t.g, sha256('r'), now() - interval '1 minute'
  FROM (VALUES ((1::bigint << 48) + 50), ((2::bigint << 48) + 3), ((3::bigint << 48) + 8)) AS t(g);
SELECT pg_temp.b('rule', 'k' || ((1::bigint << 48) + 50), 'POST /payouts', sha256('r'), p_lease => '1 minute');
SELECT is(provider_key, encode(sha256(pg_temp.rule((1::bigint << 48) + 50) || 'rule'::bytea || '\x00'::bytea
    || convert_to('k' || ((1::bigint << 48) + 50), 'UTF8') || '\x00'::bytea || convert_to(((1::bigint << 48) + 50)::text, 'UTF8')), 'hex'),
    'a takeover in range 1 between its two secrets takes the first one') FROM r;
SELECT pg_temp.b('rule', 'k' || ((2::bigint << 48) + 3), 'POST /payouts', sha256('r'), p_lease => '1 minute');
SELECT is(provider_key, encode(sha256('pgidem provider key v2'::bytea || '\x00'::bytea || 'rule'::bytea || '\x00'::bytea
    || convert_to('k' || ((2::bigint << 48) + 3), 'UTF8') || '\x00'::bytea || convert_to(((2::bigint << 48) + 3)::text, 'UTF8')), 'hex'),
    'one in range 2, which has no secret, takes none') FROM r;
SELECT pg_temp.b('rule', 'k' || ((3::bigint << 48) + 8), 'POST /payouts', sha256('r'), p_lease => '1 minute');
SELECT is(provider_key, encode(sha256('pgidem provider key v3'::bytea || '\x00'::bytea
    || int8send(4001) || int8send(4002) || int8send(4003) || int8send(4004) || '\x00'::bytea || 'rule'::bytea || '\x00'::bytea
    || convert_to('k' || ((3::bigint << 48) + 8), 'UTF8') || '\x00'::bytea || convert_to(((3::bigint << 48) + 8)::text, 'UTF8')), 'hex'),
    'one in range 3 takes range 3''s secret, its four sequences'' values in order') FROM r;
SELECT is(count(*), 3::bigint, 'each takeover kept its generation') FROM idem.idempotency_keys
 WHERE principal_id = 'rule' AND generation IN ((1::bigint << 48) + 50, (2::bigint << 48) + 3, (3::bigint << 48) + 8);

SELECT * FROM finish();
ROLLBACK;

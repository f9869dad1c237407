-- 006: a secret of this installation, which enters the provider key of every generation that
-- starts from now on, so that two installations (staging and production, two services, two
-- tenants' databases sharing one provider account) never hand a provider the same key.
--
-- Expand only: nothing here touches the key table, so the previous release serves through it.
--
--   - idem.installation_secrets: one row per secret, with the first token it applies to. A
--     generation (the token of its first claim) takes the secret with the greatest from_token
--     at or below it, in its own token range (the top 16 bits: a Citus worker's group); a
--     generation below every secret of its range is one the previous release started, and keeps
--     the provider key that release gave it (label v2, no secret): an upgrade never changes the
--     provider key of a generation that exists, so a lease in flight across it keeps its key.
--   - idem.token_seq: where tokens come from from now on, starting 2^32 above the last token
--     of idem.attempt_seq. A call of the previous release's functions that was already running
--     when the new ones were installed still draws from idem.attempt_seq, below the new secret's
--     from_token, and gives the v2 key that its generation keeps. One sequence with a threshold
--     could not tell those late draws from new ones. idem.attempt_seq stays for that reason (a
--     later release drops it).
--
-- The secret is readable by the schema's owner only: the SECURITY DEFINER functions read it, no
-- role is granted it, and nothing returns it. A copy of the database (a restore of a dump, a
-- clone from a template) carries the secret: give the copy its own with
-- CALL idem.idem_new_installation_secret() (docs/operations.md).
CREATE TABLE idem.installation_secrets (
    from_token bigint PRIMARY KEY,
    secret     bytea NOT NULL CHECK (octet_length(secret) = 32),
    created_at timestamptz NOT NULL DEFAULT now()
);
REVOKE ALL ON idem.installation_secrets FROM PUBLIC;
COMMENT ON TABLE idem.installation_secrets IS
    'The installation''s secrets for provider keys, each for the generations from from_token on (in its token range); private to the schema''s owner.';

CREATE SEQUENCE idem.token_seq AS bigint;
COMMENT ON SEQUENCE idem.token_seq IS
    'Fencing tokens (attempt) and so generation numbers, from migration 006 on; above every token of idem.attempt_seq.';

DO $$
DECLARE
    v_next  bigint := (SELECT s.last_value + CASE WHEN s.is_called THEN 1 ELSE 0 END FROM idem.attempt_seq AS s);
    v_start bigint := v_next;
BEGIN
    -- The 2^32 gap is for the calls of the functions installed now that may still draw from
    -- idem.attempt_seq after this commits; where none of them does (a new installation, an
    -- upgrade from 0.1.0), tokens go on where idem.attempt_seq's would have.
    IF EXISTS (SELECT FROM pg_catalog.pg_proc AS p
                WHERE p.pronamespace = 'idem'::regnamespace AND p.prosrc LIKE '%idem.attempt_seq%') THEN
        v_start := v_next + 4294967296;
    END IF;
    PERFORM setval('idem.token_seq', v_start, false);
    -- 32 bytes from the server's strong random source (gen_random_uuid draws 122 bits a UUID).
    INSERT INTO idem.installation_secrets (from_token, secret)
    VALUES (v_start, sha256(convert_to(gen_random_uuid()::text || gen_random_uuid()::text || gen_random_uuid()::text, 'UTF8')));
END
$$;
-- Statistics, so that the functions' plans read this one-row table as such (without them the
-- planner assumes hundreds of rows, and a bitmap scan and a sort every claim).
ANALYZE idem.installation_secrets;

---- create above / drop below ----

DROP SEQUENCE idem.token_seq;
DROP TABLE idem.installation_secrets;

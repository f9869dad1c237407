-- 006: a secret of this installation, which enters the provider key of every generation that
-- starts from now on, so that two installations (staging and production, two services, two
-- tenants' databases sharing one provider account) never hand a provider the same key.
--
-- Expand only: nothing here touches the key table, so the previous release serves through it.
--
--   - The secret is 32 random bytes kept in four sequences (idem.installation_secret_1_1 to
--     _1_4, eight bytes each), readable by the schema's owner only. A sequence, not a table: it
--     is read without a snapshot, so every transaction, at any isolation level and however old
--     its snapshot, computes the same provider key for a generation (a table read by an older
--     REPEATABLE READ snapshot would miss a secret that applies to its token).
--   - idem.installation_secrets: one row per secret, with the first token it applies to and its
--     sequences. A generation (the token of its first claim) takes the secret with the greatest
--     from_token at or below it, in its own token range (the top 16 bits: a Citus worker's
--     group); a generation below every secret of its range is one the previous release started,
--     and keeps the provider key that release gave it (label v2, no secret): an upgrade never
--     changes the provider key of a generation that exists, so a lease in flight across it keeps
--     its key.
--   - idem.token_seq: where tokens come from from now on, 2^32 above the last token of
--     idem.attempt_seq where the previous release's functions drew from it. A call of those
--     functions that was already running when the new ones were installed still draws from
--     idem.attempt_seq, below the new secret's from_token, and gives the v2 key that its
--     generation keeps. One sequence with a threshold could not tell those late draws from new
--     ones. idem.attempt_seq stays for that reason (a later release drops it).
--
-- The functions read the list of secrets from two functions that the install writes from this
-- table (installation_secret_tokens, installation_secret_seqs: sql/functions/install.sql). A
-- copy of the database (a restore of a dump, a clone from a template) carries the secret: give
-- the copy its own with CALL idem.idem_new_installation_secret() (docs/operations.md).
CREATE TABLE idem.installation_secrets (
    from_token  bigint PRIMARY KEY,
    secret_seqs text[] NOT NULL CHECK (cardinality(secret_seqs) = 4),
    created_at  timestamptz NOT NULL DEFAULT now()
);
REVOKE ALL ON idem.installation_secrets FROM PUBLIC;
COMMENT ON TABLE idem.installation_secrets IS
    'The installation''s secrets for provider keys, each for the generations from from_token on (in its token range), kept in four sequences each; private to the schema''s owner.';

CREATE SEQUENCE idem.token_seq AS bigint;
COMMENT ON SEQUENCE idem.token_seq IS
    'Fencing tokens (attempt) and so generation numbers, from migration 006 on; above every token of idem.attempt_seq.';

-- The first secret's four parts (the values below; never call nextval on them). Only the owner
-- may read them (a sequence grants nothing to PUBLIC).
CREATE SEQUENCE idem.installation_secret_1_1 AS bigint MINVALUE -9223372036854775808 START 0;
CREATE SEQUENCE idem.installation_secret_1_2 AS bigint MINVALUE -9223372036854775808 START 0;
CREATE SEQUENCE idem.installation_secret_1_3 AS bigint MINVALUE -9223372036854775808 START 0;
CREATE SEQUENCE idem.installation_secret_1_4 AS bigint MINVALUE -9223372036854775808 START 0;

DO $$
DECLARE
    v_next  bigint := (SELECT s.last_value + CASE WHEN s.is_called THEN 1 ELSE 0 END FROM idem.attempt_seq AS s);
    v_start bigint := v_next;
    -- 32 bytes from the server's strong random source (gen_random_uuid draws 122 bits a UUID).
    v_bytes bytea := sha256(convert_to(gen_random_uuid()::text || gen_random_uuid()::text || gen_random_uuid()::text, 'UTF8'));
BEGIN
    -- The 2^32 gap is for the calls of the functions installed now that may still draw from
    -- idem.attempt_seq after this commits; where none of them does (a new installation, an
    -- upgrade from 0.1.0), tokens go on where idem.attempt_seq's would have.
    IF EXISTS (SELECT FROM pg_catalog.pg_proc AS p
                WHERE p.pronamespace = 'idem'::regnamespace AND p.prosrc LIKE '%idem.attempt_seq%') THEN
        v_start := v_next + 4294967296;
    END IF;
    PERFORM setval('idem.token_seq', v_start, false);
    FOR j IN 1..4 LOOP
        PERFORM setval(format('idem.installation_secret_1_%s', j)::regclass,
                       ('x' || encode(substr(v_bytes, 8 * j - 7, 8), 'hex'))::bit(64)::bigint, true);
    END LOOP;
    INSERT INTO idem.installation_secrets (from_token, secret_seqs)
    VALUES (v_start, ARRAY['idem.installation_secret_1_1', 'idem.installation_secret_1_2',
                           'idem.installation_secret_1_3', 'idem.installation_secret_1_4']);
END
$$;

---- create above / drop below ----

DROP SEQUENCE idem.installation_secret_1_1, idem.installation_secret_1_2, idem.installation_secret_1_3,
    idem.installation_secret_1_4;
DROP SEQUENCE idem.token_seq;
DROP TABLE idem.installation_secrets;

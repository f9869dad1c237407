-- idem_new_installation_secret: gives this database a secret of its own for the provider keys
-- of the generations that start from now on. For a copy of a database (a restore of a dump into
-- staging, a clone from a template), which carries the secret of the original: run it once in
-- the copy, before it serves, and the copy's new provider keys differ from the original's.
-- Generations that already exist keep their provider keys (a lease in flight keeps its key).
--
-- Two transactions, in this order: the new secret's row commits first, from a token 2^32
-- above the last one drawn; only then does the sequence jump to that token. A claim reads the
-- secrets after it drew its token, so a token below the jump takes the earlier secret, and one
-- at or above it is drawn after the row committed and finds it. A procedure: it commits, so it
-- cannot be SECURITY DEFINER or pin search_path with a SET clause; every name is qualified.
-- The schema's owner runs it (nothing is granted).
CREATE OR REPLACE PROCEDURE idem.idem_new_installation_secret()
LANGUAGE plpgsql
AS $$
DECLARE
    v_from bigint;
BEGIN
    -- One run at a time (SHARE ROW EXCLUSIVE conflicts with itself, not with the claims'
    -- reads): two runs could otherwise move the sequence backwards.
    LOCK TABLE idem.installation_secrets IN SHARE ROW EXCLUSIVE MODE;
    v_from := (SELECT s.last_value FROM idem.token_seq AS s) + 4294967296;
    INSERT INTO idem.installation_secrets (from_token, secret)
    VALUES (v_from, pg_catalog.sha256(pg_catalog.convert_to(pg_catalog.gen_random_uuid()::text
        || pg_catalog.gen_random_uuid()::text || pg_catalog.gen_random_uuid()::text, 'UTF8')));
    COMMIT;
    LOCK TABLE idem.installation_secrets IN SHARE ROW EXCLUSIVE MODE;
    IF pg_catalog.nextval('idem.token_seq') < v_from THEN
        PERFORM pg_catalog.setval('idem.token_seq', v_from, false);
    END IF;
    COMMIT;
END
$$;

COMMENT ON PROCEDURE idem.idem_new_installation_secret() IS
    'Gives this database (a copy of another) a secret of its own for the provider keys of generations that start from now on; existing generations keep theirs. Run by the schema''s owner. See docs/operations.md.';

-- idem_new_installation_secret: gives this database a secret of its own for the provider keys
-- of the generations that start from now on. For a copy of a database (a restore of a dump into
-- staging, a clone from a template), which carries the secret of the original: run it once in
-- the copy, before it serves, and the copy's new provider keys differ from the original's.
-- Generations that already exist keep their provider keys (a lease in flight keeps its key).
--
-- In this order, so that no claim ever gives a token of the new secret the key of an older one:
--   1. the new secret (four new sequences) and its row commit, from a token 2^32 above the last
--      one drawn and above the newest secret's first; the lists of secrets are written again (include/publish_secrets.sql) and the
--      functions that compute provider keys are compiled anew in every session (their plans
--      hold the lists); a transaction that starts after this sees both;
--   2. it waits until every transaction of this database that was running at 1 has ended (as
--      CREATE INDEX CONCURRENTLY waits for old snapshots), at most p_wait;
--   3. only then the token sequence moves to the new secret's first token.
-- A claim that draws a token of the new secret therefore runs in a transaction that started
-- after 1. When the wait runs out, the call fails and changes nothing that matters: the new
-- secret's tokens are 2^32 draws away; run it again.
--
-- A procedure: it commits, so it cannot be SECURITY DEFINER or pin search_path with a SET
-- clause. It pins search_path for each of its transactions instead (include/pin_path.sql),
-- first thing and again after its COMMIT: a function or operator of a schema on the caller's
-- path that matches a call more exactly than PostgreSQL's own (format(text, text),
-- ||(text[], text)) would otherwise run with the owner's rights (D252). Call it outside a
-- transaction block, as the schema's owner (nothing is granted).
CREATE OR REPLACE PROCEDURE idem.idem_new_installation_secret(p_wait interval DEFAULT '10 minutes')
LANGUAGE plpgsql
AS $$
DECLARE
    v_from  bigint;
    v_n     bigint;
    v_bytes bytea;
    v_seq   text;
    v_seqs  text[];
    v_older text[];
    v_until timestamptz;
    v_grantee oid;
BEGIN
{{ template "include/pin_path.sql" }}
    IF p_wait IS NULL THEN
        RAISE EXCEPTION 'idem_new_installation_secret: p_wait must not be NULL' USING ERRCODE = '22004';
    END IF;
    IF p_wait < interval '0' THEN
        RAISE EXCEPTION 'idem_new_installation_secret: p_wait must not be negative, got %', p_wait
            USING ERRCODE = '22023';
    END IF;
    -- One first transaction at a time (SHARE ROW EXCLUSIVE conflicts with itself, not with
    -- the claims' reads): two runs could otherwise move the sequence backwards. The lock ends
    -- at the COMMIT below, so another run may start while this one waits: its secret starts
    -- 2^32 above this one's too, not only above the sequence, which this run has not moved
    -- yet. Otherwise its first tokens would be a few draws above this secret's, and a
    -- transaction that began between the two runs' commits (it planned this secret, not that
    -- one, and takes no lock that would make it plan again) would hand its claims the key of
    -- this secret once this run moved the sequence.
    -- A migrate (idemmigrate.Migrate, server migrate, sql/idem.sql) writes the lists of secrets
    -- and the functions too: tern's advisory lock, which every migrate takes first, makes the
    -- two take turns (they would otherwise fail with "tuple concurrently updated").
    PERFORM pg_catalog.pg_advisory_xact_lock({{ .tern_lock }});
    LOCK TABLE idem.installation_secrets IN SHARE ROW EXCLUSIVE MODE;
    v_from := greatest((SELECT s.last_value FROM idem.token_seq AS s),
                       coalesce((SELECT pg_catalog.max(x.from_token) FROM idem.installation_secrets AS x), 0)) + 4294967296;
    v_n := (SELECT pg_catalog.count(*) FROM idem.installation_secrets) + 1;
    v_bytes := pg_catalog.sha256(pg_catalog.convert_to(pg_catalog.gen_random_uuid()::text
        || pg_catalog.gen_random_uuid()::text || pg_catalog.gen_random_uuid()::text, 'UTF8'));
    v_seqs := '{}';
    FOR j IN 1..4 LOOP
        v_seq := pg_catalog.format('idem.installation_secret_%s_%s', v_n, j);
        EXECUTE pg_catalog.format('CREATE SEQUENCE %s AS bigint MINVALUE -9223372036854775808 START 0', v_seq);
        PERFORM pg_catalog.setval(v_seq::regclass,
            ('x' || pg_catalog.encode(pg_catalog.substr(v_bytes, 8 * j - 7, 8), 'hex'))::bit(64)::bigint, true);
        v_seqs := v_seqs || v_seq;
        -- The owner's alone: what the owner's default privileges give other roles on a new
        -- sequence is taken back (install.sql does the same for the schema's other objects).
        FOR v_grantee IN
            SELECT DISTINCT x.grantee
              FROM pg_catalog.pg_class AS c
             CROSS JOIN LATERAL pg_catalog.aclexplode(c.relacl) AS x
             WHERE c.oid = v_seq::regclass AND x.grantee <> c.relowner
        LOOP
            EXECUTE pg_catalog.format('REVOKE ALL ON SEQUENCE %s FROM %s', v_seq,
                CASE WHEN v_grantee = 0 THEN 'PUBLIC' ELSE v_grantee::regrole::text END);
        END LOOP;
    END LOOP;
    INSERT INTO idem.installation_secrets (from_token, secret_seqs) VALUES (v_from, v_seqs);
{{ template "include/publish_secrets.sql" . }}
    -- A new pg_proc row for each function that computes provider keys: every session compiles
    -- it anew, and plans the secrets again, in its next transaction.
    ALTER FUNCTION idem.idem_begin(text, text, text, bytea, interval, interval, jsonb, interval) COST 100;
    ALTER FUNCTION idem.idem_stuck(interval, integer) COST 100;
    COMMIT;
{{ template "include/pin_path.sql" }}

    -- The transactions of this database only: one in another database of the cluster (a
    -- pg_dump of it, a long report) claims no key here.
    v_older := ARRAY(SELECT l.virtualxid
                       FROM pg_catalog.pg_locks AS l
                       JOIN pg_catalog.pg_stat_activity AS a ON a.pid = l.pid
                      WHERE l.locktype = 'virtualxid' AND l.granted AND l.pid <> pg_catalog.pg_backend_pid()
                        AND a.datname = pg_catalog.current_database());
    v_until := pg_catalog.clock_timestamp() + p_wait;
    WHILE EXISTS (SELECT FROM pg_catalog.pg_locks AS l
                   WHERE l.locktype = 'virtualxid' AND l.granted AND l.virtualxid = ANY (v_older)) LOOP
        IF pg_catalog.clock_timestamp() > v_until THEN
            RAISE EXCEPTION 'idem_new_installation_secret: transactions older than the new secret are still running after %', p_wait
                USING ERRCODE = '55000',
                      HINT = 'The new secret is not in use yet (its tokens are 2^32 draws away); end them, or run the procedure again.';
        END IF;
        PERFORM pg_catalog.pg_sleep(0.05);
    END LOOP;

    LOCK TABLE idem.installation_secrets IN SHARE ROW EXCLUSIVE MODE;
    IF pg_catalog.nextval('idem.token_seq') < v_from THEN
        PERFORM pg_catalog.setval('idem.token_seq', v_from, false);
    END IF;
    COMMIT;
{{ template "include/pin_path.sql" }}
END
$$;

COMMENT ON PROCEDURE idem.idem_new_installation_secret(interval) IS
    'Gives this database (a copy of another) a secret of its own for the provider keys of generations that start from now on; existing generations keep theirs. Run by the schema''s owner, outside a transaction block. See docs/operations.md.';

-- idem_yield: the holder of a lease claim gives its lease up without an answer, and keeps the
-- key for its request: the lease ends now, so the next attempt of the same request (the same
-- fingerprint) takes the key over at once, in the same generation, with the same provider
-- key; another request under the key gets mismatch until the key expires. For work outside
-- the database that failed in a way that may or may not have reached the outside (a timeout,
-- a lost answer): a retry runs it again under the same provider key, which the provider
-- deduplicates. (idem_release frees the key instead: the next request, even the same one,
-- starts a new generation with a new provider key; right only when the work did not happen.)
-- Fenced by p_attempt: true when the lease claim with this attempt was in progress, false
-- otherwise (taken over, completed, released, expired and cleaned up, never made, or a
-- transactional claim, whose transaction rolls back instead). The claim gets a new token (the
-- generation stays), so the holder that yielded is fenced off like one taken over: its
-- idem_extend, idem_complete and idem_yield raise 55000 or return false. Its claim time goes:
-- a lease given up on purpose is not stuck work (idem_health, idem_stuck).
CREATE OR REPLACE FUNCTION idem.idem_yield(
    p_principal text,
    p_key       text,
    p_attempt   bigint)
RETURNS boolean
{{ template "include/attributes.sql" . }}
AS $$
DECLARE
    v_problem text;
    v_now     timestamptz;
    v_token   bigint;
BEGIN
    IF NOT coalesce({{ template "include/valid_key.sql" }} AND p_attempt IS NOT NULL, false) THEN
        v_problem := CASE
{{ template "include/check_key.sql" . }}
            WHEN p_attempt IS NULL
                THEN '22004 p_attempt must not be NULL'
        END;
{{ template "include/raise.sql" "idem_yield" }}
    END IF;
    v_now := clock_timestamp();
    v_token := nextval('idem.token_seq');
    UPDATE idem.idempotency_keys AS k
       SET lease_expires_at = least(k.lease_expires_at, v_now), attempt = v_token,
           generation = coalesce(k.generation, k.attempt), claimed_at = NULL
     WHERE k.principal_id = p_principal COLLATE pg_catalog."default" AND k.key = p_key COLLATE pg_catalog."default"
       AND k.attempt = p_attempt AND k.state = 'p' AND k.lease_expires_at IS NOT NULL
       AND k.expires_at > v_now;
    RETURN FOUND;
END
$$;

COMMENT ON FUNCTION idem.idem_yield(text, text, bigint) IS
    'Ends the lease of the in-progress lease claim with this attempt now, without an answer, keeping the key for the same request (its retry takes over in the same generation); false when there is no such claim. See docs/sql-api.md.';

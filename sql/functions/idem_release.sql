-- idem_release: abandon a lease claim without a response, so that a retry may claim the key
-- again (with a new token, so the released holder stays fenced off). True when released, false
-- when no lease claim with this attempt is in progress. A transactional claim is not released:
-- its transaction rolls back instead. Released and committed, it would let the transaction's
-- effect commit beside a key without an answer, and the retry that claims the key again would
-- apply the effect a second time (the commit guard exists to refuse exactly that).
CREATE OR REPLACE FUNCTION idem.idem_release(
    p_principal text,
    p_key       text,
    p_attempt   bigint)
RETURNS boolean
{{ template "include/attributes.sql" . }}
AS $$
DECLARE
    v_problem text;
    v_now     timestamptz;
BEGIN
    IF NOT coalesce({{ template "include/valid_key.sql" }} AND p_attempt IS NOT NULL, false) THEN
        v_problem := CASE
{{ template "include/check_key.sql" . }}
            WHEN p_attempt IS NULL
                THEN '22004 p_attempt must not be NULL'
        END;
{{ template "include/raise.sql" "idem_release" }}
    END IF;
    v_now := clock_timestamp();
    UPDATE idem.idempotency_keys AS k
       SET state = 'r', lease_expires_at = NULL, uncompleted = NULL
     WHERE k.principal_id = p_principal COLLATE pg_catalog."default" AND k.key = p_key COLLATE pg_catalog."default"
       AND k.attempt = p_attempt AND k.state = 'p' AND k.lease_expires_at IS NOT NULL
       AND k.expires_at > v_now;
    IF FOUND THEN
        RETURN true;
    END IF;
    IF EXISTS (SELECT FROM idem.idempotency_keys AS k
                WHERE k.principal_id = p_principal COLLATE pg_catalog."default" AND k.key = p_key COLLATE pg_catalog."default"
                  AND k.attempt = p_attempt AND k.state = 'p' AND k.lease_expires_at IS NULL) THEN
        RAISE EXCEPTION 'idem_release: the claim with attempt % is transactional: roll its transaction back instead', p_attempt
            USING ERRCODE = '55000',
                  DETAIL = 'A transactional claim commits only with its answer (idem_complete or idem_save_final).';
    END IF;
    RETURN false;
END
$$;

COMMENT ON FUNCTION idem.idem_release(text, text, bigint) IS
    'Abandons the in-progress lease claim with this attempt so that a retry may claim the key again; false when there is none; 55000 for a transactional claim (roll its transaction back). See docs/sql-api.md.';

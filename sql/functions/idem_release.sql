-- idem_release: abandon a claim without a response, so that a retry may claim the key again
-- (with a new token, so the released holder stays fenced off). True when released, false when
-- no claim with this attempt is in progress.
CREATE OR REPLACE FUNCTION idem.idem_release(
    p_principal text,
    p_key       text,
    p_attempt   bigint)
RETURNS boolean
{{ template "include/attributes.sql" . }}
AS $$
DECLARE
    v_problem text;
BEGIN
    IF NOT coalesce({{ template "include/valid_key.sql" }} AND p_attempt IS NOT NULL, false) THEN
        v_problem := CASE
{{ template "include/check_key.sql" . }}
            WHEN p_attempt IS NULL
                THEN '22004 p_attempt must not be NULL'
        END;
{{ template "include/raise.sql" "idem_release" }}
    END IF;
    UPDATE idem.idempotency_keys AS k
       SET state = 'r', lease_expires_at = NULL, uncompleted = NULL
     WHERE k.principal_id = p_principal AND k.key = p_key
       AND k.attempt = p_attempt AND k.state = 'p';
    RETURN FOUND;
END
$$;

COMMENT ON FUNCTION idem.idem_release(text, text, bigint) IS
    'Abandons the in-progress claim with this attempt so that a retry may claim the key again; false when there is none. See docs/sql-api.md.';

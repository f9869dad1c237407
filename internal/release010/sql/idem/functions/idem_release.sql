-- idem_release: abandon a claim without a response, so that a retry may claim the key again
-- (with the next attempt, so the released holder stays fenced off). True when released,
-- false when no claim with this attempt is in progress.
CREATE OR REPLACE FUNCTION idem.idem_release(
    p_principal text,
    p_key       text,
    p_attempt   integer)
RETURNS boolean
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '2s'
AS $$
DECLARE
    v_problem text;
BEGIN
    v_problem := CASE
{{ template "check_key.sql" . }}
        WHEN p_attempt IS NULL
            THEN '22004 p_attempt must not be NULL'
    END;
    IF v_problem IS NOT NULL THEN
        RAISE EXCEPTION 'idem_release: %', substr(v_problem, 7) USING ERRCODE = left(v_problem, 5);
    END IF;

    UPDATE idem.idempotency_keys AS k
       SET state = 'released', lease_expires_at = NULL, uncompleted = NULL
     WHERE k.principal_id = p_principal AND k.key = p_key
       AND k.attempt = p_attempt AND k.state = 'in_progress';
    RETURN FOUND;
END
$$;

COMMENT ON FUNCTION idem.idem_release(text, text, integer) IS
    'Abandons the in-progress claim with this attempt so that a retry may claim the key again; false when there is none. See docs/sql-api.md.';

-- idem_complete: store the response of a claim and mark it completed.
--
-- Fenced by p_attempt: a claim that was taken over (or released, or never made) raises 55000
-- and stores nothing. Updates no indexed column, so the row is updated in place (HOT).
CREATE OR REPLACE FUNCTION idem.idem_complete(
    p_principal   text,
    p_key         text,
    p_attempt     integer,
    p_status      integer,
    p_headers     jsonb,
    p_body        bytea,
    p_resource_id text DEFAULT NULL,
    p_withheld    text DEFAULT NULL)
RETURNS void
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
        WHEN p_attempt IS NULL OR p_status IS NULL OR p_headers IS NULL
            THEN '22004 p_attempt, p_status and p_headers must not be NULL'
        WHEN p_status NOT BETWEEN 100 AND 599
            THEN format('22023 p_status must be between 100 and 599, got %s', p_status)
        WHEN jsonb_typeof(p_headers) <> 'object'
            THEN format('22023 p_headers must be a JSON object, got %s', jsonb_typeof(p_headers))
        WHEN p_withheld NOT IN ('one_time_secret', 'too_large') OR (p_withheld IS NOT NULL AND p_body IS NOT NULL)
            THEN '22023 p_withheld must be NULL, one_time_secret or too_large, and p_body NULL when it is set'
    END;
    IF v_problem IS NOT NULL THEN
        RAISE EXCEPTION 'idem_complete: %', substr(v_problem, 7) USING ERRCODE = left(v_problem, 5);
    END IF;

    UPDATE idem.idempotency_keys AS k
       SET state = 'completed', completed_at = clock_timestamp(), lease_expires_at = NULL,
           uncompleted = NULL, response_status = p_status, response_headers = p_headers,
           response_body = p_body, resource_id = p_resource_id, withheld = p_withheld
     WHERE k.principal_id = p_principal AND k.key = p_key
       AND k.attempt = p_attempt AND k.state = 'in_progress';
    IF NOT FOUND THEN
        RAISE EXCEPTION 'idem_complete: no claim in progress for this key with attempt %', p_attempt
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  HINT = 'The claim was taken over by a later attempt, released, expired and cleaned up, or never made.';
    END IF;
END
$$;

COMMENT ON FUNCTION idem.idem_complete(text, text, integer, integer, jsonb, bytea, text, text) IS
    'Stores the response of the claim with this attempt and marks it completed; 55000 when no such claim is in progress. See docs/sql-api.md.';

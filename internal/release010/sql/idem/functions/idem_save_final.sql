-- idem_save_final: store a final error response after the work was rolled back, in its own
-- short transaction. Inserts a completed row; an expired or released row counts as absent and
-- is replaced; any other row is left alone (false).
CREATE OR REPLACE FUNCTION idem.idem_save_final(
    p_principal      text,
    p_key            text,
    p_action         text,
    p_request_sha256 bytea,
    p_ttl            interval,
    p_status         integer,
    p_headers        jsonb,
    p_body           bytea,
    p_request_fields jsonb DEFAULT NULL)
RETURNS boolean
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '2s'
AS $$
DECLARE
    v_problem text;
    v_now     timestamptz := clock_timestamp();
    v_stored  boolean;
BEGIN
    v_problem := CASE
{{ template "check_key.sql" . }}
{{ template "check_request.sql" . }}
        WHEN p_status IS NULL OR p_headers IS NULL
            THEN '22004 p_status and p_headers must not be NULL'
        WHEN p_status NOT BETWEEN 100 AND 599
            THEN format('22023 p_status must be between 100 and 599, got %s', p_status)
        WHEN jsonb_typeof(p_headers) <> 'object' OR jsonb_typeof(p_request_fields) <> 'object'
            THEN '22023 p_headers and p_request_fields must be JSON objects'
    END;
    IF v_problem IS NOT NULL THEN
        RAISE EXCEPTION 'idem_save_final: %', substr(v_problem, 7) USING ERRCODE = left(v_problem, 5);
    END IF;

    INSERT INTO idem.idempotency_keys AS k
        (principal_id, key, state, attempt, created_at, expires_at, action, request_sha256,
         request_fields, completed_at, response_status, response_headers, response_body)
    VALUES
        (p_principal, p_key, 'completed', 1, v_now, v_now + p_ttl, p_action, p_request_sha256,
         p_request_fields, v_now, p_status, p_headers, p_body)
    ON CONFLICT ON CONSTRAINT idempotency_keys_pkey DO UPDATE
       SET state = 'completed', attempt = k.attempt + 1, created_at = v_now,
           expires_at = v_now + p_ttl, lease_expires_at = NULL, uncompleted = NULL,
           action = p_action, request_sha256 = p_request_sha256, request_fields = p_request_fields,
           completed_at = v_now, response_status = p_status, response_headers = p_headers,
           response_body = p_body, resource_id = NULL, withheld = NULL
     WHERE k.expires_at <= v_now OR k.state = 'released'
    RETURNING true INTO v_stored;
    RETURN coalesce(v_stored, false);
END
$$;

COMMENT ON FUNCTION idem.idem_save_final(text, text, text, bytea, interval, integer, jsonb, bytea, jsonb) IS
    'Stores a final error response for a key whose work was rolled back; true when stored, false when a live row already existed (never overwritten). See docs/sql-api.md.';

-- idem_extend: the holder of a lease claim moves its lease's end to p_lease from now, while its
-- work outside the database runs (a heartbeat). Fenced by p_attempt: only the current holder
-- of an in-progress lease claim may extend it; anything else (the lease was taken over, the
-- claim was completed or released, the key expired and was cleaned up, or the claim is
-- transactional) raises 55000 and changes nothing. It never shortens: the lease's end and the
-- key's expiry only move later, by the same amount (the key lives the TTL past the lease,
-- answer_expires_at). Returns the lease's end.
CREATE OR REPLACE FUNCTION idem.idem_extend(
    p_principal text,
    p_key       text,
    p_attempt   bigint,
    p_lease     interval)
RETURNS timestamptz
{{ template "include/attributes.sql" . }}
AS $$
DECLARE
    v_problem text;
    v_lease   timestamptz;
    v_end     timestamptz;
    v_now     timestamptz;
BEGIN
    IF NOT coalesce({{ template "include/valid_key.sql" }} AND p_attempt IS NOT NULL AND p_lease IS NOT NULL, false) THEN
        v_problem := CASE
{{ template "include/check_key.sql" . }}
            WHEN p_attempt IS NULL OR p_lease IS NULL
                THEN '22004 p_attempt and p_lease must not be NULL'
        END;
{{ template "include/raise.sql" "idem_extend" }}
    END IF;
    IF {{ template "include/not_plain_positive.sql" "p_lease" }} THEN
        IF {{ template "include/not_positive.sql" "p_lease" }} THEN
            RAISE EXCEPTION 'idem_extend: p_lease must be positive in every part, got %', p_lease USING ERRCODE = '22023';
        END IF;
        -- Within the limit only (tested below): the hours are computed in integers.
        IF p_lease <= interval '{{ template "max_interval" }}' THEN
            p_lease := {{ template "include/in_hours.sql" "p_lease" }};
        END IF;
    END IF;
    IF p_lease > interval '{{ template "max_interval" }}' THEN
        RAISE EXCEPTION 'idem_extend: p_lease must be at most {{ template "max_interval" }}, got %', p_lease USING ERRCODE = '22023';
    END IF;
    v_now := clock_timestamp();
    v_lease := v_now + p_lease;
    UPDATE idem.idempotency_keys AS k
       SET lease_expires_at = greatest(k.lease_expires_at, v_lease),
           expires_at = greatest(k.expires_at, idem.answer_expires_at(k.expires_at, k.lease_expires_at, v_lease))
     WHERE k.principal_id = p_principal COLLATE pg_catalog."default" AND k.key = p_key COLLATE pg_catalog."default"
       AND k.attempt = p_attempt AND k.state = 'p' AND k.lease_expires_at IS NOT NULL
       AND k.expires_at > v_now
    RETURNING k.lease_expires_at INTO v_end;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'idem_extend: no lease claim in progress for this key with attempt %', p_attempt
            USING ERRCODE = '55000',
                  HINT = 'The lease was taken over by a later attempt, the claim was completed or released, the key expired, or the claim is transactional.';
    END IF;
    RETURN v_end;
END
$$;

COMMENT ON FUNCTION idem.idem_extend(text, text, bigint, interval) IS
    'Moves the lease of the in-progress lease claim with this attempt to p_lease from now (never earlier), and the key''s expiry with it; 55000 when there is no such claim. See docs/sql-api.md.';

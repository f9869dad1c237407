-- idem_complete: store the response of a claim and mark it completed.
--
-- Fenced by p_attempt: a claim that was taken over (or released, or never made) raises 55000
-- and stores nothing. The key is then kept at least the TTL after the answer is stored
-- (lease_expires_at, see answer_expires_at): after now, or after a wait on the key's row, its
-- end (include/restamp_answer.sql). The answer replaces the steps' recovery point
-- (idem_step). Updates no indexed column, so the row is updated in place (HOT).
CREATE OR REPLACE FUNCTION idem.idem_complete(
    p_principal   text,
    p_key         text,
    p_attempt     bigint,
    p_status      integer,
    p_headers     jsonb,
    p_body        bytea,
    p_resource_id text DEFAULT NULL,
    p_withheld    text DEFAULT NULL)
RETURNS void
{{ template "include/attributes.sql" . }}
AS $$
DECLARE
    v_problem text;
    v_now     timestamptz;
    v_since   timestamptz;
    v_stored  timestamptz;
BEGIN
    -- Validation: one small test on the fast path; see idem_begin. What is stored (the
    -- response) is checked before the UPDATE; the key only where the UPDATE finds no claim (no
    -- row has a key that idem_begin refuses), so that a bad key still raises 22004 or 22023.
    IF NOT coalesce(p_attempt IS NOT NULL AND {{ template "include/valid_response.sql" }}, false) THEN
        v_problem := CASE
{{ template "include/check_key.sql" . }}
        WHEN p_attempt IS NULL
            THEN '22004 p_attempt must not be NULL'
{{ template "include/check_response.sql" . }}
        END;
{{ template "include/raise.sql" "idem_complete" }}
    END IF;
    v_now := clock_timestamp();
    v_since := transaction_timestamp();
    UPDATE idem.idempotency_keys AS k
       SET state = 'c', lease_expires_at = idem.answer_expires_at(k.expires_at, coalesce(k.lease_expires_at, v_since), v_now),
           uncompleted = NULL, response_status = p_status,
           response_headers = p_headers, response_body = p_body, resource_id = p_resource_id,
           withheld = p_withheld, recovery_point = NULL, recovery_saved = NULL
     WHERE k.principal_id = p_principal COLLATE pg_catalog."default" AND k.key = p_key COLLATE pg_catalog."default"
       AND k.attempt = p_attempt AND k.state = 'p'
       -- A lease claim past its TTL is absent (its expiry is never before its lease's end); a
       -- transactional claim is its transaction's own, whatever its age.
       AND (k.uncompleted OR k.expires_at > v_now);
    IF NOT FOUND THEN
        IF NOT coalesce({{ template "include/valid_key.sql" }}, false) THEN
            v_problem := CASE
{{ template "include/check_key.sql" . }}
            END;
{{ template "include/raise.sql" "idem_complete" }}
        END IF;
        RAISE EXCEPTION 'idem_complete: no claim in progress for this key with attempt %', p_attempt
            USING ERRCODE = '55000',
                  HINT = 'The claim was taken over by a later attempt, released, expired (a lease claim past its TTL), or never made.';
    END IF;
{{ template "include/restamp_answer.sql" . }}
END
$$;

COMMENT ON FUNCTION idem.idem_complete(text, text, bigint, integer, jsonb, bytea, text, text) IS
    'Stores the response of the claim with this attempt and marks it completed; 55000 when no such claim is in progress. See docs/sql-api.md.';

-- idem_save_final: store a final error response (a 404, a 422) in the caller's transaction,
-- after the work was rolled back (to a savepoint taken right after idem_begin).
--
--   - This transaction's own transactional claim of the same request: it is finalized with the
--     response, so a duplicate waiting on the key sees only the final answer.
--   - No row, an expired row or a released one: the final answer is inserted (new token).
--   - Anything else (a completed key, another holder's lease): left alone, false.
--
-- Returns true when it stored the response. Never overwrites a completed key.
CREATE OR REPLACE FUNCTION idem.idem_save_final(
    p_principal      text,
    p_key            text,
    p_action         text,
    p_request_sha256 bytea,
    p_ttl            interval,
    p_status         integer,
    p_headers        jsonb,
    p_body           bytea,
    p_request_fields jsonb DEFAULT NULL,
    p_withheld       text  DEFAULT NULL,
    p_resource_id    text  DEFAULT NULL)
RETURNS boolean
{{ template "include/attributes.sql" . }}
AS $$
DECLARE
    v_problem text;
    v_now     timestamptz;
    v_expires timestamptz;
    v_action  bigint;
    v_fields  bytea;
    v_size    bigint;
    v_token   bigint;
    v_since   timestamptz;
    v_stored  timestamptz;
BEGIN
    -- Validation: one small test on the fast path; see idem_begin.
    IF NOT coalesce({{ template "include/valid_key.sql" }} AND {{ template "include/valid_request.sql" }}
                    AND {{ template "include/valid_response.sql" }}, false) THEN
        v_problem := CASE
{{ template "include/check_key.sql" . }}
{{ template "include/check_request.sql" . }}
{{ template "include/check_response.sql" . }}
        END;
{{ template "include/raise.sql" "idem_save_final" }}
    END IF;
{{ template "include/check_ttl.sql" "idem_save_final" }}
{{ template "include/fields_blob.sql" "idem_save_final" }}
    v_now := clock_timestamp();
    v_since := transaction_timestamp();
    v_expires := v_now + coalesce(p_ttl, {{ template "default_ttl" }});
    v_action := hashtextextended(p_action COLLATE pg_catalog."default", 0);
    v_token := nextval('idem.token_seq');

    -- A free key: the INSERT stores the answer (a new generation). ON CONFLICT waits for an
    -- uncommitted holder of the key (bounded by lock_timeout), then finds the committed row.
    -- Then the UPDATE stores the answer only where it may: this transaction's own claim of the
    -- same request (an uncompleted transactional claim that it sees can only be its own: the
    -- commit guard keeps any other from being committed), or a released or expired row (never
    -- this transaction's own claim of another request, however old: it holds the key until
    -- its transaction ends). Not
    -- INSERT ... ON CONFLICT DO UPDATE ... WHERE: that locks the row it finds even when its
    -- WHERE refuses it, and another holder's lease then could not be extended or answered
    -- until this transaction ended. An UPDATE locks only a row that passes its WHERE (but for
    -- a row another transaction changed while the UPDATE waited for it: PostgreSQL keeps that
    -- one locked even when the WHERE then refuses it). When the row went away in between
    -- (cleanup), the INSERT runs again.
    FOR v_try IN 1..3 LOOP
        INSERT INTO idem.idempotency_keys AS k
            (expires_at, attempt, action_hash, state, principal_id, key, request_sha256,
             request_fields, response_status, response_headers, response_body, resource_id, withheld)
        VALUES
            (v_expires, v_token, v_action, 'c', p_principal, p_key, p_request_sha256,
             v_fields, p_status, p_headers, p_body, p_resource_id, p_withheld)
        ON CONFLICT ON CONSTRAINT idempotency_keys_pkey DO NOTHING;
        IF FOUND THEN
{{ template "include/restamp_answer.sql" . }}
            RETURN true;
        END IF;
        UPDATE idem.idempotency_keys AS k
           SET state = 'c',
               attempt = CASE WHEN k.uncompleted THEN k.attempt ELSE v_token END,
               expires_at = CASE WHEN k.uncompleted THEN k.expires_at ELSE v_expires END,
               -- This transaction's own claim is kept the TTL after now: its own TTL moved on
               -- by the time since the claim (answer_expires_at), and at least p_ttl; a free
               -- key's new row expires p_ttl after now already.
               lease_expires_at = CASE WHEN k.uncompleted THEN greatest(idem.answer_expires_at(k.expires_at, v_since, v_now), v_expires) END,
               uncompleted = NULL, action_hash = v_action,
               request_sha256 = p_request_sha256, request_fields = v_fields,
               response_status = p_status, response_headers = p_headers,
               response_body = p_body, resource_id = p_resource_id,
               withheld = p_withheld, claimed_at = NULL,
               recovery_point = NULL, recovery_saved = NULL,
               -- This transaction's own claim keeps its generation; a free key starts a new one.
               generation = CASE WHEN k.uncompleted THEN k.generation END
         WHERE k.principal_id = p_principal COLLATE pg_catalog."default" AND k.key = p_key COLLATE pg_catalog."default"
           AND (k.state = 'r'
                -- expired: a completed key the TTL after its answer (idem_begin, D200), any
                -- other once its claim's TTL and its lease have run out
                OR (k.state = 'c' AND coalesce(k.lease_expires_at, k.expires_at) <= v_now)
                OR (k.expires_at <= v_now AND (k.lease_expires_at IS NULL OR k.lease_expires_at <= v_now)
                    AND k.uncompleted IS NULL)
                OR (k.uncompleted AND k.action_hash = v_action AND k.request_sha256 = p_request_sha256));
        IF FOUND THEN
{{ template "include/restamp_answer.sql" . }}
            RETURN true;
        END IF;
        IF EXISTS (SELECT FROM idem.idempotency_keys AS k WHERE k.principal_id = p_principal COLLATE pg_catalog."default" AND k.key = p_key COLLATE pg_catalog."default") THEN
            RETURN false;
        END IF;
    END LOOP;
    RETURN false;
END
$$;

COMMENT ON FUNCTION idem.idem_save_final(text, text, text, bytea, interval, integer, jsonb, bytea, jsonb, text, text) IS
    'Stores a final error response in the caller''s transaction: finalizes its own claim, or inserts for a key nobody holds; true when stored, false when a live row exists (never overwritten). See docs/sql-api.md.';

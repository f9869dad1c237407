-- idem_begin: claim a key, or answer from the row that already holds it.
--
-- Hot path: one INSERT. On conflict the INSERT has already waited for an uncommitted holder
-- (bounded by lock_timeout, SQLSTATE 55P03 past it); the row is then read without a lock and
-- decided on. Only the two writes (re-claiming an expired or released row, taking over a lease
-- that ran out) lock the row, and they decide again on the locked version. No EXCEPTION block:
-- no subtransaction on any path. Bad arguments raise 22004 (NULL) or 22023 (invalid value).
CREATE OR REPLACE FUNCTION idem.idem_begin(
    p_principal      text,
    p_key            text,
    p_action         text,
    p_request_sha256 bytea,
    p_ttl            interval DEFAULT '24 hours',
    p_lease          interval DEFAULT NULL,
    p_request_fields jsonb    DEFAULT NULL,
    p_lock_timeout   interval DEFAULT NULL,
    OUT outcome          text,
    OUT attempt          integer,
    OUT response_status  integer,
    OUT response_headers jsonb,
    OUT response_body    bytea,
    OUT resource_id      text,
    OUT withheld         text,
    OUT changed_fields   text[],
    OUT retry_after      interval)
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '2s'
AS $$
DECLARE
    v_problem text;
    v_now     timestamptz;
    v_row     idem.idempotency_keys%ROWTYPE;
    v_lock    boolean;
    v_tries   integer;
BEGIN
    -- One expression validates everything: PL/pgSQL prepares each expression once per
    -- transaction, so on the hot path fewer expressions are cheaper than many small IFs.
    v_problem := CASE
{{ template "check_key.sql" . }}
{{ template "check_request.sql" . }}
        WHEN p_lease <= interval '0' OR p_lease > p_ttl
            THEN format('22023 p_lease must be positive and at most p_ttl, got %s', p_lease)
        WHEN jsonb_typeof(p_request_fields) <> 'object'
            THEN format('22023 p_request_fields must be a JSON object, got %s', jsonb_typeof(p_request_fields))
        WHEN p_lock_timeout <= interval '0'
            THEN format('22023 p_lock_timeout must be positive, got %s', p_lock_timeout)
    END;
    IF v_problem IS NOT NULL THEN
        RAISE EXCEPTION 'idem_begin: %', substr(v_problem, 7) USING ERRCODE = left(v_problem, 5);
    END IF;
    IF p_lock_timeout IS NOT NULL THEN
        -- Local to this call: the SET clause above restores the caller's value on return.
        PERFORM set_config('lock_timeout',
            greatest(ceil(extract(epoch FROM p_lock_timeout) * 1000), 1)::bigint || 'ms', true);
    END IF;

    -- Every pass starts with the INSERT unless the previous pass asked for the row locked.
    -- A fresh key leaves at the first RETURN: one INSERT and two expressions.
    LOOP
        IF v_lock IS NOT TRUE THEN
            -- statement_timestamp() is one instant for the whole call (the request's
            -- arrival); decisions after a wait use clock_timestamp().
            INSERT INTO idem.idempotency_keys AS k
                (principal_id, key, state, attempt, created_at, expires_at, lease_expires_at,
                 uncompleted, action, request_sha256, request_fields)
            VALUES
                (p_principal, p_key, 'in_progress', 1, statement_timestamp(), statement_timestamp() + p_ttl,
                 statement_timestamp() + p_lease, nullif(p_lease IS NULL, false), p_action,
                 p_request_sha256, p_request_fields)
            ON CONFLICT ON CONSTRAINT idempotency_keys_pkey DO NOTHING
            RETURNING k.attempt INTO attempt;
            IF FOUND THEN
                outcome := 'claimed';
                RETURN;
            END IF;
            -- The key exists, and the INSERT has waited for an uncommitted holder. Decide on
            -- the row as committed; lock it only to write.
            SELECT * INTO v_row FROM idem.idempotency_keys AS k
             WHERE k.principal_id = p_principal AND k.key = p_key;
        ELSE
            SELECT * INTO v_row FROM idem.idempotency_keys AS k
             WHERE k.principal_id = p_principal AND k.key = p_key
               FOR UPDATE;
        END IF;

        IF NOT FOUND THEN
            -- idem_cleanup deleted the (expired) row since the INSERT saw it: insert again.
            v_tries := coalesce(v_tries, 0) + 1;
            EXIT WHEN v_tries >= 8;
            v_lock := false;
            CONTINUE;
        END IF;

        v_now := clock_timestamp();
        IF v_row.expires_at <= v_now OR v_row.state = 'released' THEN
            -- An expired key is absent, a released one free: claim it again. The attempt
            -- keeps counting so that a holder of an older claim stays fenced off.
            IF v_lock THEN
                UPDATE idem.idempotency_keys AS k
                   SET state = 'in_progress', attempt = k.attempt + 1, created_at = v_now,
                       expires_at = v_now + p_ttl, lease_expires_at = v_now + p_lease,
                       uncompleted = nullif(p_lease IS NULL, false), action = p_action,
                       request_sha256 = p_request_sha256, request_fields = p_request_fields,
                       completed_at = NULL, response_status = NULL, response_headers = NULL,
                       response_body = NULL, resource_id = NULL, withheld = NULL
                 WHERE k.principal_id = p_principal AND k.key = p_key
                RETURNING k.attempt INTO attempt;
                outcome := 'claimed';
                RETURN;
            END IF;
        ELSIF v_row.action <> p_action OR v_row.request_sha256 <> p_request_sha256 THEN
            outcome := 'mismatch';
            attempt := v_row.attempt;
            IF v_row.action <> p_action THEN
                changed_fields := '{}';
            ELSIF v_row.request_fields IS NOT NULL AND p_request_fields IS NOT NULL THEN
                -- Names only, never values; {} when only the method or path differ.
                changed_fields := ARRAY(
                    SELECT coalesce(o.key, n.key)
                      FROM jsonb_each(v_row.request_fields) AS o
                      FULL JOIN jsonb_each(p_request_fields) AS n ON n.key = o.key
                     WHERE o.value IS DISTINCT FROM n.value
                     ORDER BY 1);
            END IF;
            RETURN;
        ELSIF v_row.state = 'completed' THEN
            outcome := 'replay';
            attempt := v_row.attempt;
            response_status := v_row.response_status;
            response_headers := v_row.response_headers;
            response_body := v_row.response_body;
            resource_id := v_row.resource_id;
            withheld := v_row.withheld;
            RETURN;
        ELSIF v_row.lease_expires_at IS NULL OR v_row.lease_expires_at > v_now THEN
            -- in_progress with the same fingerprint. Without a lease it is this
            -- transaction's own uncommitted claim (no other transaction can see one).
            outcome := 'in_progress';
            attempt := v_row.attempt;
            retry_after := v_row.lease_expires_at - v_now;
            RETURN;
        ELSIF v_lock THEN
            -- The lease ran out: take it over with the next attempt (fencing token).
            UPDATE idem.idempotency_keys AS k
               SET attempt = k.attempt + 1, lease_expires_at = v_now + p_lease,
                   uncompleted = nullif(p_lease IS NULL, false)
             WHERE k.principal_id = p_principal AND k.key = p_key
            RETURNING k.attempt INTO attempt;
            outcome := 'claimed';
            RETURN;
        END IF;
        -- A write is due: read the row again FOR UPDATE and decide on the locked version.
        v_lock := true;
    END LOOP;
    RAISE EXCEPTION 'idem_begin: the row of this key kept vanishing; retry the transaction'
        USING ERRCODE = 'serialization_failure';
END
$$;

COMMENT ON FUNCTION idem.idem_begin(text, text, text, bytea, interval, interval, jsonb, interval) IS
    'Claims an idempotency key in the caller''s transaction, or answers replay, mismatch or in_progress from the row that holds it. See docs/sql-api.md.';

-- idem_step: the holder of a lease claim records that a step of its work is done (a recovery
-- point), in the caller's transaction: the step's own writes and its recovery point commit
-- together, or neither does. Work in steps (Brandur Leach's atomic phases): a takeover of the
-- same generation gets every recorded step from idem_begin (recovery_point, recovery_saved)
-- and goes on after them; a new generation starts from none.
--
-- Fenced by p_attempt, as idem_complete is: when no lease claim with this token is in progress
-- (taken over, yielded, released, completed, expired and cleaned up, never made, or a
-- transactional claim) it raises 55000 and the caller's transaction, aborted, must roll back,
-- so the step's writes never commit beside a later holder's. The row lock it takes lasts until
-- the caller's transaction ends: a takeover (idem_begin locks the row to write it) waits for
-- it, then reads the step; a holder whose takeover committed first finds another token here.
-- A step recorded already in this generation raises 23505: its writes were done once.
-- p_saved is what later steps need to know of this one (an id, an amount), any JSON value (SQL
-- NULL is stored as JSON null); the steps' values of one generation are at most 8192 bytes in
-- all, counted on recovery_saved::text, the object as jsonb writes it (22023 past it).
CREATE OR REPLACE FUNCTION idem.idem_step(
    p_principal text,
    p_key       text,
    p_attempt   bigint,
    p_step      text,
    p_saved     jsonb DEFAULT NULL)
RETURNS void
{{ template "include/attributes.sql" . }}
AS $$
DECLARE
    v_problem text;
    v_saved   jsonb;
    v_lease   timestamptz;
    v_expires timestamptz;
BEGIN
    IF NOT coalesce({{ template "include/valid_key.sql" }} AND p_attempt IS NOT NULL
                    AND length(p_step) BETWEEN 1 AND 255, false) THEN
        v_problem := CASE
{{ template "include/check_key.sql" . }}
            WHEN p_attempt IS NULL OR p_step IS NULL
                THEN '22004 p_attempt and p_step must not be NULL'
            WHEN length(p_step) NOT BETWEEN 1 AND 255
                THEN format('22023 p_step must be 1 to 255 characters, got %s', length(p_step))
        END;
{{ template "include/raise.sql" "idem_step" }}
    END IF;
    SELECT k.recovery_saved, k.lease_expires_at, k.expires_at INTO v_saved, v_lease, v_expires
      FROM idem.idempotency_keys AS k
     WHERE k.principal_id = p_principal COLLATE pg_catalog."default" AND k.key = p_key COLLATE pg_catalog."default"
       AND k.attempt = p_attempt AND k.state = 'p'
       FOR NO KEY UPDATE;
    IF NOT FOUND OR v_lease IS NULL OR v_expires <= clock_timestamp() THEN
        RAISE EXCEPTION 'idem_step: no lease claim in progress for this key with attempt %', p_attempt
            USING ERRCODE = '55000',
                  HINT = 'The lease was taken over by a later attempt or yielded, the claim was completed or released, the key expired, or the claim is transactional: roll this transaction back.';
    END IF;
    IF v_saved ? p_step THEN
        RAISE EXCEPTION 'idem_step: step % is recorded already in this generation of the key', p_step
            USING ERRCODE = '23505',
                  HINT = 'Its writes committed with its recovery point (idem_begin''s recovery_saved): roll this transaction back and go on after it.';
    END IF;
    v_saved := coalesce(v_saved, '{}') || jsonb_build_object(p_step, coalesce(p_saved, 'null'));
    IF octet_length(v_saved::text) > 8192 THEN
        RAISE EXCEPTION 'idem_step: the steps'' saved values would take % bytes, at most 8192', octet_length(v_saved::text)
            USING ERRCODE = '22023',
                  HINT = 'Save ids and small values; keep what is large in your own tables, written in the step''s transaction.';
    END IF;
    UPDATE idem.idempotency_keys AS k
       SET recovery_point = p_step, recovery_saved = v_saved
     WHERE k.principal_id = p_principal COLLATE pg_catalog."default" AND k.key = p_key COLLATE pg_catalog."default";
END
$$;

COMMENT ON FUNCTION idem.idem_step(text, text, bigint, text, jsonb) IS
    'Records, in the caller''s transaction, that step p_step of the in-progress lease claim with this attempt is done, with what it saved; 55000 when there is no such claim (roll back), 23505 when the step is recorded already. See docs/sql-api.md.';

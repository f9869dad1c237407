-- idem_recovery: what the generation of an in-progress claim has done so far, for its holder
-- (work in steps, idem_step): recovery_point is the last step recorded, recovery_saved each
-- recorded step by name with what it saved; both NULL when none is recorded (a fresh
-- generation, or a claim whose earlier attempts recorded nothing).
--
-- A holder calls it right after idem_begin answered 'claimed', in the claim's transaction or
-- after it committed: a takeover of the same generation (a lease that ran out or was given
-- up, idem_yield) goes on after the steps recorded; a new generation (a claim of an expired or
-- released key) has none. idem_begin_steps calls it with the claim, in one call, so that a
-- lease claim costs no extra round trip (the Go driver claims leases so). Not a column of idem_begin:
-- adding OUT columns to it would mean dropping the function the previous release calls while
-- it serves (docs/DECISIONS.md).
--
-- Fenced by p_attempt, as idem_step is: when no claim with this token is in progress (taken
-- over, yielded, released, completed, expired and cleaned up, or never made) it raises 55000.
-- It reads without a lock: only the holder of this token records steps, and a takeover moves
-- the token on.
CREATE OR REPLACE FUNCTION idem.idem_recovery(
    p_principal text,
    p_key       text,
    p_attempt   bigint,
    OUT recovery_point text,
    OUT recovery_saved jsonb)
{{ template "include/attributes.sql" . }}
AS $$
-- VOLATILE, not STABLE: called beside idem_begin in one statement (a caller's join), it must
-- see the row that idem_begin wrote, which a STABLE function's snapshot (the statement's
-- start) does not.
-- @plpgsql_check_options: performance_warnings = false
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
{{ template "include/raise.sql" "idem_recovery" }}
    END IF;
    v_now := clock_timestamp();
    SELECT k.recovery_point, k.recovery_saved INTO recovery_point, recovery_saved
      FROM idem.idempotency_keys AS k
     WHERE k.principal_id = p_principal COLLATE pg_catalog."default" AND k.key = p_key COLLATE pg_catalog."default"
       AND k.attempt = p_attempt AND k.state = 'p'
       AND (k.uncompleted OR k.expires_at > v_now);
    IF NOT FOUND THEN
        RAISE EXCEPTION 'idem_recovery: no claim in progress for this key with attempt %', p_attempt
            USING ERRCODE = '55000',
                  HINT = 'The claim was taken over by a later attempt or yielded, completed or released, or the key expired.';
    END IF;
END
$$;

COMMENT ON FUNCTION idem.idem_recovery(text, text, bigint) IS
    'The steps recorded (idem_step) in the generation of the in-progress claim with this attempt: the last one and what each saved; 55000 when there is no such claim. See docs/sql-api.md.';

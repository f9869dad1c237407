-- 007: recovery points of work in steps (docs/sql-api.md, "Work in steps").
--
-- A lease claim in progress can record named steps (idem_step): each step's writes and its
-- recovery point commit in the caller's transaction, fenced by the claim's token. The recovery
-- point lives on the key's own row, in two nullable columns:
--
--   - recovery_point: the name of the last step recorded in the key's current generation;
--   - recovery_saved: a JSON object, each recorded step's name to the small JSON value it
--     saved (at most 8192 bytes as text in all).
--
-- A takeover of the same generation (a lease that ran out or was given up, idem_yield) keeps
-- them and idem_begin hands them to the new holder; a new generation (a claim of an expired or
-- released key) starts without; an answer (idem_complete) clears them. On the row and not in
-- a side table: the row lock that fences the answer fences the steps too (a takeover's FOR
-- UPDATE waits for a step's transaction, and then reads its recovery point), and idem_cleanup
-- deletes them with the key.
--
-- Expand only: two nullable columns without a default are a change of the catalog, no rewrite
-- and no scan, whatever the table's size; the previous release (0.2.0) names the columns it
-- reads and writes, so it serves beside them. ADD COLUMN takes the key table's ACCESS
-- EXCLUSIVE lock until the migrate commits (a few catalog changes and the functions' install):
-- it is asked for with a 200 ms lock timeout, again until it is had, so that the claims of the
-- previous release never queue behind it for longer than that. The short lock timeout stays for
-- the rest of the migration.
DO $$
DECLARE
    v_tries integer := 0;
BEGIN
    IF EXISTS (SELECT FROM pg_catalog.pg_attribute
                WHERE attrelid = 'idem.idempotency_keys'::regclass AND attname = 'recovery_point' AND NOT attisdropped) THEN
        RETURN;
    END IF;
    LOOP
        BEGIN
            PERFORM pg_catalog.set_config('lock_timeout', '200ms', true);
            LOCK TABLE idem.idempotency_keys IN ACCESS EXCLUSIVE MODE;
            EXIT;
        EXCEPTION WHEN lock_not_available THEN
            v_tries := v_tries + 1;
            IF v_tries >= 300 THEN
                RAISE EXCEPTION 'idem migration 007: idem.idempotency_keys stayed locked through % tries of 200 ms', v_tries
                    USING ERRCODE = '55P03', HINT = 'A long transaction holds the key table: end it, then run the migrate again.';
            END IF;
            PERFORM pg_catalog.pg_sleep(0.05);
        END;
    END LOOP;
    ALTER TABLE idem.idempotency_keys ADD COLUMN recovery_point text, ADD COLUMN recovery_saved jsonb;
END
$$;

COMMENT ON COLUMN idem.idempotency_keys.recovery_point IS
    'The last step recorded (idem_step) by a lease claim in progress in the key''s current generation; NULL: none.';
COMMENT ON COLUMN idem.idempotency_keys.recovery_saved IS
    'Each step recorded in the key''s current generation, by name, with the JSON value it saved; NULL: none.';

---- create above / drop below ----

ALTER TABLE idem.idempotency_keys DROP COLUMN IF EXISTS recovery_point, DROP COLUMN IF EXISTS recovery_saved;

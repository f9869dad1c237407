{{- /* online/007_columns.sql: migration 007's columns, added before the migrate's transaction
   by idemsql.Migrate (ExpandOnline) and by sql/idem.sql, in a statement of their own that
   commits at once, while the previous release serves: the key table's ACCESS EXCLUSIVE lock,
   which ADD COLUMN needs, is then held for the catalog change and its commit only, never
   through the functions' install. It is asked for with a 20 ms lock timeout, again after a
   pause until it is had (a claim of the previous release gives up on a locked table after
   about 70 ms and answers 503). It does nothing on a database without the lean key table
   (schema version below 3: migration 003 builds it, under its own lock), on one of a later
   schema version than this release's (which the migrate then refuses, changing nothing), or
   on one that has the columns. It runs again safely. */ -}}
DO $idem_007$
DECLARE
    v_tries integer := 0;
BEGIN
    PERFORM pg_catalog.pg_advisory_xact_lock({{ .tern_lock }});
    IF pg_catalog.to_regclass('idem.schema_version') IS NULL OR pg_catalog.to_regclass('idem.idempotency_keys') IS NULL THEN
        RETURN;
    END IF;
    IF NOT EXISTS (SELECT FROM idem.schema_version WHERE version BETWEEN 3 AND {{ .schema_version }})
       OR EXISTS (SELECT FROM pg_catalog.pg_attribute
                   WHERE attrelid = 'idem.idempotency_keys'::regclass AND attname = 'recovery_point' AND NOT attisdropped) THEN
        RETURN;
    END IF;
    LOOP
        BEGIN
            PERFORM pg_catalog.set_config('lock_timeout', '20ms', true);
            -- online: asked for with a 20 ms lock timeout and held for a catalog change, in a
            -- statement that commits at once (no scan, no rewrite, whatever the table's size)
            LOCK TABLE idem.idempotency_keys IN ACCESS EXCLUSIVE MODE;
            EXIT;
        EXCEPTION WHEN lock_not_available THEN
            v_tries := v_tries + 1;
            IF v_tries >= 2000 THEN
                RAISE EXCEPTION 'idem migration 007: idem.idempotency_keys stayed locked through % tries of 20 ms', v_tries
                    USING ERRCODE = '55P03', HINT = 'A long transaction holds the key table: end it, then run the migrate again.';
            END IF;
            PERFORM pg_catalog.pg_sleep(0.02 + 0.04 * pg_catalog.random());
        END;
    END LOOP;
    ALTER TABLE idem.idempotency_keys ADD COLUMN recovery_point text, ADD COLUMN recovery_saved jsonb;
    COMMENT ON COLUMN idem.idempotency_keys.recovery_point IS
        'The last step recorded (idem_step) by a lease claim in progress in the key''s current generation; NULL: none.';
    COMMENT ON COLUMN idem.idempotency_keys.recovery_saved IS
        'Each step recorded in the key''s current generation, by name, with the JSON value it saved; NULL: none.';
END
$idem_007$;

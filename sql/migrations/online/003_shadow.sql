{{- /* online/003_shadow.sql: what migration 003 needs before its swap, created without a lock
   on the live key table: the new table (under the name idempotency_keys_v3, with its primary
   key, its indexes and the commit guard), the fencing-token sequence, the conversion of a
   0.1.0 row, the trigger function that keeps the new table current, the procedure that adds
   the trigger and copies the existing rows in batches, and its bookkeeping row. Every
   statement can run again.

   idemsql.Migrate and sql/idem.sql run it in a short transaction of its own, then CALL
   idem.rebuild_003() outside any transaction, while the previous release keeps serving; then
   migration 003 (which includes this file too, for a database that had no such run: a new
   install, whose table is empty) swaps the tables in a lock that lasts milliseconds. */ -}}
CREATE SEQUENCE IF NOT EXISTS idem.attempt_seq AS bigint;

COMMENT ON SEQUENCE idem.attempt_seq IS
    'Fencing tokens (idempotency_keys.attempt): every claim and takeover draws a new one, so no earlier holder of a key ever had it.';

CREATE TABLE IF NOT EXISTS idem.idempotency_keys_v3 (
    expires_at       timestamptz NOT NULL,
    attempt          bigint      NOT NULL,
    action_hash      bigint      NOT NULL,
    lease_expires_at timestamptz,
    claimed_at       timestamptz,
    generation       bigint,
    response_status  smallint,
    state            "char"      NOT NULL,
    uncompleted      boolean,
    principal_id     text        NOT NULL,
    key              text        NOT NULL,
    request_sha256   bytea       NOT NULL,
    request_fields   bytea,
    resource_id      text,
    withheld         text,
    response_headers jsonb,
    response_body    bytea,
    CONSTRAINT idempotency_keys_v3_pkey PRIMARY KEY (principal_id, key),
    CONSTRAINT idempotency_keys_claim_completed_in_its_transaction
        FOREIGN KEY (uncompleted) REFERENCES idem.claim_guard (uncompleted)
        DEFERRABLE INITIALLY DEFERRED
) WITH (
    -- The completion adds the response to a row inserted moments before; 5% of a page keeps
    -- that update HOT for responses of a few hundred bytes (docs/operations.md).
    fillfactor = 95,
    autovacuum_vacuum_scale_factor = 0.02,
    autovacuum_vacuum_insert_scale_factor = 0.02,
    autovacuum_analyze_scale_factor = 0.05,
    toast.autovacuum_vacuum_scale_factor = 0.02,
    -- Freed pages are reused by the next claims; truncating them would take the table's
    -- ACCESS EXCLUSIVE lock at the end of every vacuum, and every claim would wait for it.
    vacuum_truncate = false,
    toast.vacuum_truncate = false
);

CREATE INDEX IF NOT EXISTS idempotency_keys_v3_expires_at_idx ON idem.idempotency_keys_v3 (expires_at);
CREATE INDEX IF NOT EXISTS idempotency_keys_v3_claimed_at_idx ON idem.idempotency_keys_v3 (claimed_at) WHERE claimed_at IS NOT NULL;

-- The rebuild's bookkeeping: the largest 0.1.0 token copied (the sequence starts above it), and
-- whether every row that existed before the trigger has been copied.
CREATE TABLE IF NOT EXISTS idem.rebuild_003 (
    one         boolean PRIMARY KEY DEFAULT true CHECK (one),
    max_attempt bigint  NOT NULL DEFAULT 0,
    backfilled  boolean NOT NULL DEFAULT false
);
INSERT INTO idem.rebuild_003 DEFAULT VALUES ON CONFLICT DO NOTHING;

-- A 0.1.0 row as the new table keeps it. request_fields was {"name": "hex sha256"}; it becomes
-- name, NUL, the first 8 bytes of the hash, for each field. 0.1.0 took any JSON object there: a
-- value that is not at least 16 hex digits keeps its name with a hash of eight zero bytes (it
-- only names a field in a mismatch answer; whether a request matches is the request_sha256's
-- to say). A lease in progress keeps its key the TTL past its end, and its claim time
-- (created_at). 0.1.0 stored a repeated header as an array; 0.2.0 stores one string per name,
-- and an answer's headers as an object of strings (an empty one when there are none: 0.1.0's
-- '{}', which jsonb_object_agg alone would turn into NULL). 0.1.0 took any JSON values there: a
-- number or a boolean becomes its text.
CREATE OR REPLACE FUNCTION idem.v3_row(k idem.idempotency_keys)
RETURNS idem.idempotency_keys_v3
LANGUAGE sql
STABLE
SET search_path = pg_catalog, pg_temp
AS $$
SELECT {{ template "online/003_convert.sql" "k" }}
$$;

-- The trigger that keeps the new table current while the previous release writes the old one:
-- in the writing transaction, so the copy commits or rolls back with the write.
CREATE OR REPLACE FUNCTION idem.copy_to_v3()
RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF TG_OP = 'DELETE' OR (TG_OP = 'UPDATE' AND (OLD.principal_id, OLD.key) IS DISTINCT FROM (NEW.principal_id, NEW.key)) THEN
        DELETE FROM idem.idempotency_keys_v3 AS n WHERE n.principal_id = OLD.principal_id AND n.key = OLD.key;
    END IF;
    IF TG_OP = 'DELETE' THEN
        RETURN NULL;
    END IF;
    INSERT INTO idem.idempotency_keys_v3 AS n SELECT * FROM idem.v3_row(NEW)
    ON CONFLICT (principal_id, key) DO UPDATE
       SET expires_at = excluded.expires_at, attempt = excluded.attempt, action_hash = excluded.action_hash,
           lease_expires_at = excluded.lease_expires_at, claimed_at = excluded.claimed_at,
           generation = excluded.generation, response_status = excluded.response_status, state = excluded.state,
           uncompleted = excluded.uncompleted, request_sha256 = excluded.request_sha256,
           request_fields = excluded.request_fields, resource_id = excluded.resource_id, withheld = excluded.withheld,
           response_headers = excluded.response_headers, response_body = excluded.response_body;
    UPDATE idem.rebuild_003 SET max_attempt = NEW.attempt WHERE max_attempt < NEW.attempt;
    RETURN NULL;
END
$$;

-- The online part of the rebuild, CALLed outside any transaction (it commits as it goes):
--   1. the trigger, which needs a SHARE ROW EXCLUSIVE lock on the old table: that lock waits
--      for the table's writers and makes new ones queue behind it, so it is asked for with a
--      lock timeout of 100 ms, again and again, never holding a claim up for longer;
--   2. the rows that existed before the trigger, in batches of p_batch_size in the primary
--      key's order, each batch a transaction of its own that holds its rows FOR KEY SHARE
--      (a concurrent delete waits for the batch, then the trigger deletes the copy) and keeps
--      what the trigger already copied (ON CONFLICT DO NOTHING: the trigger's copy is newer).
-- Nothing here locks out the previous release's claims; its writes pay for the trigger.
-- Running it again (or in two sessions at once) is safe; a second run copies nothing new.
CREATE OR REPLACE PROCEDURE idem.rebuild_003(p_batch_size integer DEFAULT 5000)
LANGUAGE plpgsql
AS $$
DECLARE
    v_tries    integer := 0;
    v_principal text := '';
    v_key      text := '';
    v_rows     integer;
    v_max      bigint;
    v_last_p   text;
    v_last_k   text;
BEGIN
    WHILE NOT EXISTS (SELECT FROM pg_catalog.pg_trigger AS t
                       WHERE t.tgrelid = 'idem.idempotency_keys'::regclass AND t.tgname = 'idempotency_keys_copy_to_v3') LOOP
        BEGIN
            PERFORM pg_catalog.set_config('lock_timeout', '100ms', true);
            CREATE TRIGGER idempotency_keys_copy_to_v3
                AFTER INSERT OR UPDATE OR DELETE ON idem.idempotency_keys
                FOR EACH ROW EXECUTE FUNCTION idem.copy_to_v3();
        EXCEPTION WHEN duplicate_object THEN
            -- another migrate's rebuild created it while this one waited for the table's lock
            -- (its check above came before that commit): it exists, go on
            NULL;
        WHEN lock_not_available THEN
            v_tries := v_tries + 1;
            IF v_tries >= 600 THEN
                RAISE EXCEPTION 'idem rebuild 003: idem.idempotency_keys stayed locked through % tries of 100 ms', v_tries
                    USING ERRCODE = '55P03', HINT = 'A long transaction holds the key table: end it, then run the migrate again.';
            END IF;
        END;
        COMMIT;
        IF v_tries > 0 THEN
            PERFORM pg_catalog.pg_sleep(least(0.01 * v_tries, 0.2));
        END IF;
    END LOOP;
    COMMIT;

    WHILE NOT (SELECT r.backfilled FROM idem.rebuild_003 AS r) LOOP
        -- online: one batch, a transaction of its own, outside the migration's.
        WITH batch AS (
            SELECT k.*
              FROM idem.idempotency_keys AS k
             WHERE (k.principal_id, k.key) > (v_principal, v_key)
             ORDER BY k.principal_id, k.key
             LIMIT p_batch_size
               FOR KEY SHARE OF k
        ), copied AS (
            INSERT INTO idem.idempotency_keys_v3
            SELECT {{ template "online/003_convert.sql" "b" }}
              FROM batch AS b
            ON CONFLICT (principal_id, key) DO NOTHING
        )
        SELECT count(*)::integer, max(b.attempt),
               (array_agg(b.principal_id ORDER BY b.principal_id DESC, b.key DESC))[1],
               (array_agg(b.key ORDER BY b.principal_id DESC, b.key DESC))[1]
          INTO v_rows, v_max, v_last_p, v_last_k
          FROM batch AS b;
        IF v_rows = 0 THEN
            UPDATE idem.rebuild_003 SET backfilled = true;
        ELSE
            UPDATE idem.rebuild_003 SET max_attempt = v_max WHERE max_attempt < v_max;
            v_principal := v_last_p;
            v_key := v_last_k;
        END IF;
        COMMIT;
    END LOOP;
END
$$;

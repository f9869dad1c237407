-- 003: the key table rebuilt lean, and fencing tokens that are never reused.
--
-- What changes (docs/sql-api.md describes the new table; CHANGELOG.md says why):
--   - attempt is a bigint drawn from the sequence idem.attempt_seq, so a token is unique for
--     the life of the database, across expiry and cleanup (0.1.0 restarted at 1 after cleanup);
--   - state is a one-byte "char" ('p' in progress, 'c' completed, 'r' released);
--   - the action is kept as a 64-bit hash (action_hash), the per-field hashes as 8 bytes each in
--     binary (request_fields bytea), the status as smallint; created_at and completed_at go;
--   - a lease never outlives its key: a lease claim's key expires the TTL after the lease's
--     end (0.1.0: the TTL after the claim, or the lease's end if later);
--   - claimed_at: when a lease claim in progress was made (0.1.0's created_at), for operators;
--     generation: the token of the first claim of the key's current generation once a lease was
--     taken over (NULL: the row's attempt is its generation), from which idem_begin derives the
--     provider key; both NULL in every other row, which costs no byte;
--   - no CHECK constraints: the SECURITY DEFINER functions are the only writers (no other role
--     has a privilege on the table), and the pgTAP suite proves the invariants they keep.
--
-- Online (expand and contract, as pg_repack and pg-online-schema-change do): the new table is
-- built beside the old one while the previous release keeps serving. idemsql.Migrate (and
-- sql/idem.sql) first run online/003_shadow.sql in a short transaction and CALL
-- idem.rebuild_003(), which adds a trigger that copies every write of the old table into the
-- new one and then copies the existing rows in batches, each a short transaction; the
-- previous release's claims never wait for more than a 100 ms lock attempt. This migration
-- then swaps the tables: it locks the old table (ACCESS EXCLUSIVE, asked for with a 200 ms
-- lock timeout, again until it gets it), and, the copy being complete and current, drops the
-- old table and renames the new one, in the same transaction as the new functions' install.
-- The lock lasts as long as a few catalog changes, whatever the table's size. A database that
-- had no online run (a new install, whose table is empty; a migrate that was not given one)
-- copies its rows here, under the lock.
--
-- Rows stored by 0.1.0 are copied over, so their keys still replay. Foreign keys that others
-- added to the old table (the reference server's principal reference, or your own) are added
-- again to the new one as NOT VALID. There is no way down: going back to 0.1.0 means
-- restoring a backup.
-- The swap's locks, asked for with a short lock timeout: while it waits in the queue, the
-- previous release's claims wait behind it, so it never waits long at a time. Besides the key
-- table it needs the tables the key table's foreign keys reference (the commit guard, the
-- reference server's principals or yours: dropping the old table drops their triggers, adding
-- the keys to the new one takes a lock on them) and the new table: all are locked here, in one
-- try, so that no later step waits on a reader of one of them while the key table is locked.
-- The short lock timeout stays for the rest of the migration, for the same reason.
-- online: the table was copied beforehand (idem.rebuild_003), so the locks last as long as a
-- few catalog changes, whatever the table's size.
DO $$
DECLARE
    v_tries integer := 0;
    v_rel   regclass;
BEGIN
    LOOP
        BEGIN
            PERFORM pg_catalog.set_config('lock_timeout', '200ms', true);
            LOCK TABLE idem.idempotency_keys IN ACCESS EXCLUSIVE MODE;
            FOR v_rel IN
                SELECT DISTINCT c.confrelid::regclass FROM pg_catalog.pg_constraint AS c
                 WHERE c.conrelid = 'idem.idempotency_keys'::regclass AND c.contype = 'f'
                 ORDER BY 1
            LOOP
                EXECUTE pg_catalog.format('LOCK TABLE %s IN ACCESS EXCLUSIVE MODE', v_rel);
            END LOOP;
            IF pg_catalog.to_regclass('idem.idempotency_keys_v3') IS NOT NULL THEN
                LOCK TABLE idem.idempotency_keys_v3 IN ACCESS EXCLUSIVE MODE;
            END IF;
            EXIT;
        EXCEPTION WHEN lock_not_available THEN
            v_tries := v_tries + 1;
            IF v_tries >= 300 THEN
                RAISE EXCEPTION 'idem migration 003: idem.idempotency_keys or a table it references stayed locked through % tries of 200 ms', v_tries
                    USING ERRCODE = '55P03', HINT = 'A long transaction holds the key table or a table its foreign keys reference: end it, then run the migrate again.';
            END IF;
            PERFORM pg_catalog.pg_sleep(0.05);
        END;
    END LOOP;
END
$$;

-- What the swap needs, if an online run did not create it already (a new install). Only now,
-- under the lock: CREATE INDEX IF NOT EXISTS locks the new table even when the index exists,
-- and the previous release's writes, copied there by the trigger, would wait for this
-- transaction, and this transaction's lock for them.
{{ template "online/003_shadow.sql" . }}

-- The commit guard checks each row copied below at once, not at COMMIT: the new table is
-- renamed below, which PostgreSQL refuses while it has checks pending.
SET CONSTRAINTS idem.idempotency_keys_claim_completed_in_its_transaction IMMEDIATE;
-- Without an online run, the copy happens now, under the lock (ON CONFLICT DO NOTHING keeps
-- what a trigger of an interrupted online run copied: it is newer).
-- online: only without an online run: a new install, whose table is empty (idemsql.Migrate
-- and sql/idem.sql run idem.rebuild_003 first on every database of 0.1.0).
DO $$
BEGIN
    IF NOT (SELECT r.backfilled FROM idem.rebuild_003 AS r) THEN
        INSERT INTO idem.idempotency_keys_v3
        SELECT {{ template "online/003_convert.sql" "k" }}
          FROM idem.idempotency_keys AS k
        ON CONFLICT (principal_id, key) DO NOTHING;
        UPDATE idem.rebuild_003
           SET max_attempt = greatest(max_attempt, coalesce((SELECT max(attempt) FROM idem.idempotency_keys_v3), 0));
    END IF;
END
$$;
SET CONSTRAINTS idem.idempotency_keys_claim_completed_in_its_transaction DEFERRED;

SELECT setval('idem.attempt_seq', (SELECT r.max_attempt FROM idem.rebuild_003 AS r) + 1, false);

-- Foreign keys others put on the old table go to the new one (NOT VALID: no scan, no lock on
-- the referenced table beyond the moment).
-- online: each statement built here adds a foreign key NOT VALID to the new table, which the
-- swap holds locked already, as it does the referenced tables.
DO $$
DECLARE
    v_fk record;
BEGIN
    FOR v_fk IN
        SELECT c.conname, regexp_replace(pg_get_constraintdef(c.oid), ' NOT VALID$', '') AS def
          FROM pg_constraint AS c
         WHERE c.conrelid = 'idem.idempotency_keys'::regclass AND c.contype = 'f'
           AND c.conname <> 'idempotency_keys_claim_completed_in_its_transaction'
    LOOP
        EXECUTE format('ALTER TABLE idem.idempotency_keys_v3 ADD CONSTRAINT %I %s NOT VALID', v_fk.conname, v_fk.def);
    END LOOP;
END
$$;

DROP TRIGGER IF EXISTS idempotency_keys_copy_to_v3 ON idem.idempotency_keys;
DROP PROCEDURE idem.rebuild_003(integer);
DROP FUNCTION idem.copy_to_v3();
DROP FUNCTION idem.v3_row(idem.idempotency_keys);
DROP TABLE idem.rebuild_003;
DROP TABLE idem.idempotency_keys;
ALTER TABLE idem.idempotency_keys_v3 RENAME TO idempotency_keys;
ALTER INDEX idem.idempotency_keys_v3_pkey RENAME TO idempotency_keys_pkey;
ALTER INDEX idem.idempotency_keys_v3_expires_at_idx RENAME TO idempotency_keys_expires_at_idx;
ALTER INDEX idem.idempotency_keys_v3_claimed_at_idx RENAME TO idempotency_keys_claimed_at_idx;

COMMENT ON TABLE idem.idempotency_keys IS
    'Idempotency keys and their stored responses. Private: use the idem.idem_* functions.';
COMMENT ON COLUMN idem.idempotency_keys.claimed_at IS
    'When the lease claim was made (or taken over); NULL for transactional claims.';
COMMENT ON COLUMN idem.idempotency_keys.generation IS
    'The token of the first claim of the key''s current generation, once a lease was taken over; NULL: attempt is the generation.';

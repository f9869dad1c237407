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
-- Rows stored by 0.1.0 are copied over, so their keys still replay. Foreign keys that others
-- added to the old table (the reference server's principal reference, or your own) are added
-- again to the new one as NOT VALID. There is no way down: going back to 0.1.0 means
-- restoring a backup.
--
-- The first statement locks the old table against every other use until this migration
-- commits: a claim that committed before the lock is copied; one that comes after waits for
-- the lock (its function's lock_timeout, 2 s by default), fails with 55P03 and is answered
-- 409 request_in_progress, retryable. Without the lock, keys committed to the old table while
-- the copy ran were dropped with it (docs/operations.md, "Upgrades"; TestUpgradeUnderTraffic).
LOCK TABLE idem.idempotency_keys IN ACCESS EXCLUSIVE MODE;

CREATE SEQUENCE idem.attempt_seq AS bigint;

COMMENT ON SEQUENCE idem.attempt_seq IS
    'Fencing tokens (idempotency_keys.attempt): every claim and takeover draws a new one, so no earlier holder of a key ever had it.';

CREATE TABLE idem.idempotency_keys_v3 (
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
    response_body    bytea
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

-- The old rows. request_fields was {"name": "hex sha256"}; it becomes name, NUL, the first 8
-- bytes of the hash, for each field. 0.1.0 took any JSON object there: a value that is not at
-- least 16 hex digits keeps its name with a hash of eight zero bytes (it only names a field in a
-- mismatch answer; whether a request matches is the request_sha256's to say). A lease in
-- progress keeps its key the TTL past its end.
INSERT INTO idem.idempotency_keys_v3
    (expires_at, attempt, action_hash, lease_expires_at, claimed_at, response_status, state, uncompleted,
     principal_id, key, request_sha256, request_fields, resource_id, withheld, response_headers,
     response_body)
SELECT CASE WHEN k.state = 'in_progress' AND k.lease_expires_at IS NOT NULL
            THEN k.lease_expires_at + (k.expires_at - k.created_at) ELSE k.expires_at END, k.attempt, hashtextextended(k.action, 0),
       k.lease_expires_at, CASE WHEN k.state = 'in_progress' AND k.lease_expires_at IS NOT NULL THEN k.created_at END,
       k.response_status,
       CASE k.state WHEN 'in_progress' THEN 'p' WHEN 'completed' THEN 'c' ELSE 'r' END::"char",
       k.uncompleted, k.principal_id, k.key, k.request_sha256,
       (SELECT string_agg(convert_to(f.key, 'UTF8') || '\x00'::bytea ||
                              CASE WHEN f.value #>> '{}' ~ '^[0-9a-fA-F]{16}' THEN decode(left(f.value #>> '{}', 16), 'hex')
                                   ELSE '\x0000000000000000'::bytea END,
                          ''::bytea ORDER BY f.key)
          FROM jsonb_each(k.request_fields) AS f),
       k.resource_id, k.withheld,
       -- 0.1.0 stored a repeated header as an array; 0.2.0 stores one string per name, and an
       -- answer's headers as an object of strings (an empty one when there are none: 0.1.0's
       -- '{}', which jsonb_object_agg alone would turn into NULL). 0.1.0 took any JSON values
       -- there: a number or a boolean becomes its text.
       CASE WHEN k.response_status IS NOT NULL THEN coalesce(
       (SELECT jsonb_object_agg(h.key, CASE jsonb_typeof(h.value)
                                           WHEN 'array' THEN to_jsonb(coalesce((SELECT string_agg(v, ', ') FROM jsonb_array_elements_text(h.value) AS v), ''))
                                           WHEN 'string' THEN h.value
                                           ELSE to_jsonb(h.value #>> '{}') END)
          FROM jsonb_each(CASE WHEN jsonb_typeof(k.response_headers) = 'object' THEN k.response_headers END) AS h
         WHERE jsonb_typeof(h.value) <> 'null'), '{}') END,
       k.response_body
  FROM idem.idempotency_keys AS k;

SELECT setval('idem.attempt_seq', greatest((SELECT max(attempt) FROM idem.idempotency_keys_v3), 0) + 1, false);

-- Foreign keys others put on the old table go to the new one (NOT VALID: no scan, no lock on
-- the referenced table beyond the moment).
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

DROP TABLE idem.idempotency_keys;
ALTER TABLE idem.idempotency_keys_v3 RENAME TO idempotency_keys;

ALTER TABLE idem.idempotency_keys
    ADD CONSTRAINT idempotency_keys_pkey PRIMARY KEY (principal_id, key),
    ADD CONSTRAINT idempotency_keys_claim_completed_in_its_transaction
        FOREIGN KEY (uncompleted) REFERENCES idem.claim_guard (uncompleted)
        DEFERRABLE INITIALLY DEFERRED;

CREATE INDEX idempotency_keys_expires_at_idx ON idem.idempotency_keys (expires_at);
CREATE INDEX idempotency_keys_claimed_at_idx ON idem.idempotency_keys (claimed_at) WHERE claimed_at IS NOT NULL;

COMMENT ON TABLE idem.idempotency_keys IS
    'Idempotency keys and their stored responses. Private: use the idem.idem_* functions.';
COMMENT ON COLUMN idem.idempotency_keys.claimed_at IS
    'When the lease claim was made (or taken over); NULL for transactional claims.';
COMMENT ON COLUMN idem.idempotency_keys.generation IS
    'The token of the first claim of the key''s current generation, once a lease was taken over; NULL: attempt is the generation.';

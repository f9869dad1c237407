-- 004: claimed_at and generation on the key table, for databases that ran an early build of
-- 0.2.0's 003 (which had neither). Migration 003 now creates the table with both columns and
-- the claimed_at index, so on every supported path (a new install, an upgrade from 0.1.0) this
-- migration finds them and does nothing: it takes no lock at all then (ALTER TABLE ... IF NOT
-- EXISTS would take the table's ACCESS EXCLUSIVE lock before looking).
--
-- claimed_at is set for lease claims only (a transactional claim is seen by others only once
-- it is completed): NULL costs no byte in the other rows, and the partial index holds lease
-- claims only, so that the oldest claim in progress is found without reading the table. The
-- index's predicate names claimed_at alone: a transactional completion (which changes state)
-- leaves it alone and stays a HOT update. generation is NULL unless a lease was taken over
-- (docs/sql-api.md, "Generations and provider keys").
-- online: the index is built only on a database of an early build of 0.2.0 (no release), as
-- that build's own 004 did, and on every supported path the block does nothing.
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_attribute
                    WHERE attrelid = 'idem.idempotency_keys'::regclass AND attname = 'claimed_at' AND NOT attisdropped) THEN
        ALTER TABLE idem.idempotency_keys ADD COLUMN claimed_at timestamptz;
        CREATE INDEX idempotency_keys_claimed_at_idx ON idem.idempotency_keys (claimed_at) WHERE claimed_at IS NOT NULL;
        COMMENT ON COLUMN idem.idempotency_keys.claimed_at IS
            'When the lease claim was made (or taken over); NULL for transactional claims.';
    END IF;
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_attribute
                    WHERE attrelid = 'idem.idempotency_keys'::regclass AND attname = 'generation' AND NOT attisdropped) THEN
        ALTER TABLE idem.idempotency_keys ADD COLUMN generation bigint;
        COMMENT ON COLUMN idem.idempotency_keys.generation IS
            'The token of the first claim of the key''s current generation, once a lease was taken over; NULL: attempt is the generation.';
    END IF;
END
$$;

---- create above / drop below ----

-- Nothing: the columns and the index belong to 003's table, which has no way down.

-- 004: when a lease claim was made, for operators (idem.idem_summary, idem.idem_key,
-- idem.idem_health): the age of the oldest claim in progress, and of one key's claim.
--
-- claimed_at is set for lease claims only (a transactional claim is seen by others only once
-- it is completed): NULL costs no byte in the other rows, and the partial index holds lease
-- claims only, so that the oldest claim in progress is found without reading the table. The
-- index's predicate names claimed_at alone: a transactional completion (which changes state)
-- leaves it alone and stays a HOT update.
--
-- No rewrite: the column is nullable with no default (a change of the catalog), and the
-- functions of 0.2.0's earlier builds ignore it. The index is built in this transaction: it
-- reads the table once under a SHARE lock (writes wait, reads go on), 0.43 s for 1,000,000 keys
-- on the development machine.
ALTER TABLE idem.idempotency_keys ADD COLUMN claimed_at timestamptz;

CREATE INDEX idempotency_keys_claimed_at_idx ON idem.idempotency_keys (claimed_at) WHERE claimed_at IS NOT NULL;

COMMENT ON COLUMN idem.idempotency_keys.claimed_at IS
    'When the lease claim was made (or taken over); NULL for transactional claims.';

---- create above / drop below ----

DROP INDEX IF EXISTS idem.idempotency_keys_claimed_at_idx;
ALTER TABLE idem.idempotency_keys DROP COLUMN IF EXISTS claimed_at;

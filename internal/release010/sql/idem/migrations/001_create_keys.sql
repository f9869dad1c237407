-- The key table and its guard. The table is private: applications call the functions in
-- sql/functions, which run as its owner (SECURITY DEFINER). docs/sql-api.md describes every
-- column and setting; tests/migration_test.go checks that description against pg_catalog.
CREATE SCHEMA IF NOT EXISTS idem;

-- Always empty (CHECK (false) refuses every row). A transactional claim sets
-- idempotency_keys.uncompleted to true; the deferred foreign key below then fails at COMMIT
-- unless idem_complete (or idem_release) has set it back to NULL in the same transaction.
-- The check runs in PostgreSQL's own referential-integrity code, not in a PL/pgSQL trigger.
CREATE TABLE idem.claim_guard (
    uncompleted boolean NOT NULL,
    CONSTRAINT claim_guard_pkey PRIMARY KEY (uncompleted),
    CONSTRAINT claim_guard_always_empty CHECK (false)
);

COMMENT ON TABLE idem.claim_guard IS
    'Always empty. Target of idempotency_keys.uncompleted: a transactional claim cannot be committed without its completion.';

CREATE TABLE idem.idempotency_keys (
    principal_id     text        NOT NULL,
    key              text        NOT NULL,
    state            text        NOT NULL,
    attempt          integer     NOT NULL,
    created_at       timestamptz NOT NULL,
    expires_at       timestamptz NOT NULL,
    lease_expires_at timestamptz,
    uncompleted      boolean,
    action           text        NOT NULL,
    request_sha256   bytea       NOT NULL,
    request_fields   jsonb,
    completed_at     timestamptz,
    response_status  integer,
    response_headers jsonb,
    response_body    bytea,
    resource_id      text,
    withheld         text,
    CONSTRAINT idempotency_keys_pkey PRIMARY KEY (principal_id, key),
    CONSTRAINT idempotency_keys_claim_completed_in_its_transaction
        FOREIGN KEY (uncompleted) REFERENCES idem.claim_guard (uncompleted)
        DEFERRABLE INITIALLY DEFERRED,
    CONSTRAINT idempotency_keys_state_check CHECK (
        CASE state
            WHEN 'in_progress' THEN completed_at IS NULL AND response_status IS NULL
                AND response_headers IS NULL AND response_body IS NULL AND withheld IS NULL
                AND (uncompleted IS NULL OR lease_expires_at IS NULL)
            WHEN 'completed' THEN completed_at IS NOT NULL AND uncompleted IS NULL
                AND response_status BETWEEN 100 AND 599 AND response_headers IS NOT NULL
                AND (withheld IS NULL OR (withheld IN ('one_time_secret', 'too_large') AND response_body IS NULL))
            WHEN 'released' THEN uncompleted IS NULL AND response_status IS NULL
            ELSE false
        END),
    CONSTRAINT idempotency_keys_claim_check CHECK (
        attempt >= 1 AND expires_at > created_at AND octet_length(request_sha256) = 32)
) WITH (
    fillfactor = 70,
    autovacuum_vacuum_scale_factor = 0.02,
    autovacuum_vacuum_insert_scale_factor = 0.02,
    autovacuum_analyze_scale_factor = 0.05,
    toast.autovacuum_vacuum_scale_factor = 0.02
);

CREATE INDEX idempotency_keys_expires_at_idx ON idem.idempotency_keys (expires_at);

COMMENT ON TABLE idem.idempotency_keys IS
    'Idempotency keys and their stored responses. Private: use the idem.idem_* functions.';

---- create above / drop below ----

DROP TABLE IF EXISTS idem.idempotency_keys;
DROP TABLE IF EXISTS idem.claim_guard;

-- The reference server's ledger: principals and their bearer tokens (stored hashed),
-- accounts, deposits and transfers. Applied after the idem migrations, it links
-- idem.idempotency_keys.principal_id to principals: a deleted principal's keys go with it.
CREATE TABLE principals (
    id         text        PRIMARY KEY,
    name       text        NOT NULL CHECK (length(name) BETWEEN 1 AND 100),
    created_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE api_tokens (
    id           bigserial   PRIMARY KEY,
    principal_id text        NOT NULL REFERENCES principals (id) ON DELETE CASCADE,
    name         text        NOT NULL CHECK (length(name) BETWEEN 1 AND 100),
    token_sha256 bytea       NOT NULL UNIQUE CHECK (octet_length(token_sha256) = 32),
    created_at   timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX api_tokens_principal_idx ON api_tokens (principal_id);

CREATE TABLE accounts (
    id           bigserial   PRIMARY KEY,
    principal_id text        NOT NULL REFERENCES principals (id) ON DELETE CASCADE,
    name         text        NOT NULL CHECK (length(name) BETWEEN 1 AND 100),
    currency     text        NOT NULL CHECK (currency ~ '^[A-Z]{3}$'),
    balance      bigint      NOT NULL DEFAULT 0 CHECK (balance >= 0),
    version      integer     NOT NULL DEFAULT 1,
    created_at   timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX accounts_principal_idx ON accounts (principal_id);

CREATE TABLE deposits (
    id              bigserial   PRIMARY KEY,
    account_id      bigint      NOT NULL REFERENCES accounts (id) ON DELETE CASCADE,
    amount          bigint      NOT NULL CHECK (amount > 0),
    idempotency_key text,
    created_at      timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX deposits_account_idx ON deposits (account_id);

CREATE TABLE transfers (
    id              bigserial   PRIMARY KEY,
    principal_id    text        NOT NULL REFERENCES principals (id) ON DELETE CASCADE,
    from_id         bigint      NOT NULL REFERENCES accounts (id) ON DELETE CASCADE,
    to_id           bigint      NOT NULL REFERENCES accounts (id) ON DELETE CASCADE,
    amount          bigint      NOT NULL CHECK (amount > 0),
    idempotency_key text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    CHECK (from_id <> to_id)
);
CREATE INDEX transfers_from_idx ON transfers (from_id);
CREATE INDEX transfers_to_idx ON transfers (to_id);

-- NOT VALID: keys written before this migration are not checked (they expire and are cleaned
-- up), and adding the constraint does not scan or lock a large key table. New keys are checked.
ALTER TABLE idem.idempotency_keys
    ADD CONSTRAINT idempotency_keys_principal_fkey
    FOREIGN KEY (principal_id) REFERENCES principals (id) ON DELETE CASCADE NOT VALID;

GRANT SELECT, INSERT, UPDATE, DELETE ON principals, api_tokens, accounts, deposits, transfers TO "{{.app_role}}";
GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO "{{.app_role}}";

---- create above / drop below ----

ALTER TABLE idem.idempotency_keys DROP CONSTRAINT IF EXISTS idempotency_keys_principal_fkey;
DROP TABLE IF EXISTS transfers, deposits, accounts, api_tokens, principals;

-- The simulated payment provider keeps its records in the database, in a schema of its own,
-- as an outside system would keep them in its own: a restart and a second replica of the
-- server see the same payouts. It writes outside the ledger's transactions (a provider's call
-- cannot be rolled back with them), deduplicates by its own idempotency key (the claim's
-- provider key), and hands out references drawn from a sequence: unique across restarts and
-- replicas, so that no later payout is ever given an earlier one's reference.
CREATE SCHEMA provider;

CREATE SEQUENCE provider.payout_ref_seq AS bigint;

CREATE TABLE provider.payouts (
    idempotency_key text        PRIMARY KEY,
    ref             text        NOT NULL UNIQUE,
    amount          bigint      NOT NULL,
    calls           integer     NOT NULL DEFAULT 1,
    accepted_at     timestamptz NOT NULL DEFAULT now(),
    ready_at        timestamptz NOT NULL
);

COMMENT ON TABLE provider.payouts IS
    'The simulated payment provider''s payouts, one per provider idempotency key, with the calls it received under that key.';

GRANT USAGE ON SCHEMA provider TO "{{.app_role}}";
GRANT SELECT, INSERT, UPDATE ON provider.payouts TO "{{.app_role}}";
GRANT USAGE ON SEQUENCE provider.payout_ref_seq TO "{{.app_role}}";

-- The ledger records a payout once per principal and provider reference: a payout of one
-- principal is never attached to another principal's row (it was once per reference alone, and
-- the provider's references restarted with the process).
-- In a block: on Citus, where ledger.payouts is a reference table, each statement then reaches
-- the workers on its own (Citus refuses to pass on a text of several commands).
DO $$
BEGIN
    ALTER TABLE ledger.payouts DROP CONSTRAINT payouts_provider_ref_key;
    ALTER TABLE ledger.payouts ADD CONSTRAINT payouts_principal_provider_ref_key UNIQUE (principal_id, provider_ref);
END
$$;

---- create above / drop below ----

ALTER TABLE ledger.payouts DROP CONSTRAINT IF EXISTS payouts_principal_provider_ref_key;
ALTER TABLE ledger.payouts ADD CONSTRAINT payouts_provider_ref_key UNIQUE (provider_ref);
DROP SCHEMA IF EXISTS provider CASCADE;

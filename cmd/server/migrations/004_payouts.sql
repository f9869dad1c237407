-- Payouts: money sent to an outside bank through a payment provider (in the reference server,
-- one simulated inside the process). The provider call cannot be rolled back, so the route
-- is a lease route; the payout is recorded after the provider answered, once per provider
-- reference, however many attempts the request took.
CREATE TABLE ledger.payouts (
    id              bigserial   PRIMARY KEY,
    principal_id    text        NOT NULL REFERENCES ledger.principals (id) ON DELETE CASCADE,
    account_id      bigint      NOT NULL REFERENCES ledger.accounts (id) ON DELETE CASCADE,
    amount          bigint      NOT NULL CHECK (amount > 0),
    provider_ref    text        NOT NULL UNIQUE,
    idempotency_key text,
    created_at      timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX payouts_account_idx ON ledger.payouts (account_id);

GRANT SELECT, INSERT, UPDATE ON ledger.payouts TO "{{.app_role}}";
GRANT USAGE ON SEQUENCE ledger.payouts_id_seq TO "{{.app_role}}";

---- create above / drop below ----

DROP TABLE IF EXISTS ledger.payouts;

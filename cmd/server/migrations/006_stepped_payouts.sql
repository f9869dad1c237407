-- Payouts in steps (POST /v1/stepped-payouts, docs/http.md "Work in steps"): the amount is
-- reserved in the ledger (the account's balance goes down by it and a reservation row
-- records it), the provider is called with the request's provider key, and the reservation is
-- settled into a payout (ledger.payouts). Each step commits its writes with its recovery point
-- (idem_step), so a takeover after a crash goes on after the last step done.
CREATE TABLE ledger.payout_reservations (
    id              bigserial   PRIMARY KEY,
    principal_id    text        NOT NULL REFERENCES ledger.principals (id) ON DELETE CASCADE,
    account_id      bigint      NOT NULL REFERENCES ledger.accounts (id) ON DELETE CASCADE,
    amount          bigint      NOT NULL CHECK (amount > 0),
    idempotency_key text,
    payout_id       bigint      REFERENCES ledger.payouts (id),
    created_at      timestamptz NOT NULL DEFAULT now(),
    settled_at      timestamptz
);
CREATE INDEX payout_reservations_account_idx ON ledger.payout_reservations (account_id);

GRANT SELECT, INSERT, UPDATE ON ledger.payout_reservations TO "{{.app_role}}";
GRANT USAGE ON SEQUENCE ledger.payout_reservations_id_seq TO "{{.app_role}}";

---- create above / drop below ----

DROP TABLE IF EXISTS ledger.payout_reservations;

-- The simulated provider records whose call it was: GET /v1/provider/calls/{key} answers a
-- principal about its own payouts only (any principal who learnt another's provider key read
-- that payout's reference and calls). A nullable column without a default: a change of the
-- catalog, no rewrite. Calls recorded before it (principal_id NULL) are a principal's when
-- the ledger recorded a payout of that principal under their reference (D162).
ALTER TABLE provider.payouts ADD COLUMN principal_id text;

COMMENT ON COLUMN provider.payouts.principal_id IS
    'The principal whose payout called the provider under this key; NULL for calls recorded before ledger migration 008.';

---- create above / drop below ----

ALTER TABLE provider.payouts DROP COLUMN IF EXISTS principal_id;

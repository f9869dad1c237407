-- The ledger moves into its own schema, ledger, so that the idem API can be installed alone
-- and an application's tables never share a schema with the reference server's. Tables keep
-- their rows, sequences, indexes and foreign keys (including the one from
-- idem.idempotency_keys.principal_id to principals); only their schema changes.
CREATE SCHEMA IF NOT EXISTS ledger;
ALTER TABLE public.principals SET SCHEMA ledger;
ALTER TABLE public.api_tokens SET SCHEMA ledger;
ALTER TABLE public.accounts SET SCHEMA ledger;
ALTER TABLE public.deposits SET SCHEMA ledger;
ALTER TABLE public.transfers SET SCHEMA ledger;

REVOKE ALL ON SCHEMA ledger FROM PUBLIC;
GRANT USAGE ON SCHEMA ledger TO "{{.app_role}}";
GRANT USAGE ON ALL SEQUENCES IN SCHEMA ledger TO "{{.app_role}}";

---- create above / drop below ----

ALTER TABLE ledger.principals SET SCHEMA public;
ALTER TABLE ledger.api_tokens SET SCHEMA public;
ALTER TABLE ledger.accounts SET SCHEMA public;
ALTER TABLE ledger.deposits SET SCHEMA public;
ALTER TABLE ledger.transfers SET SCHEMA public;

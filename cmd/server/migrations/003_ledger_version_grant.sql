-- The application role reads the ledger's version, as the server checks it at start and in
-- /healthz (idem's version it reads through idem.idem_version()). Nothing else of the version
-- table is granted: only migrate, as the owner, writes it.
GRANT SELECT ON ledger.schema_version TO "{{.app_role}}";

---- create above / drop below ----

REVOKE SELECT ON ledger.schema_version FROM "{{.app_role}}";

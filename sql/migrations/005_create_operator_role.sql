-- The role of operators and support (a DBA logs in as a member of it): it may read the
-- summary of the keys and one key's story with its body (idem_summary, idem_health, idem_key)
-- and release a stuck lease claim (idem_release_stuck), which the application role may not.
-- The name comes from tern data operator_role (default idem_operator). Roles belong to the
-- cluster, so an existing role is reused.
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = '{{.operator_role}}') THEN
        CREATE ROLE "{{.operator_role}}" NOLOGIN;
    END IF;
END
$$;

GRANT USAGE ON SCHEMA idem TO "{{.operator_role}}";

---- create above / drop below ----

REVOKE USAGE ON SCHEMA idem FROM "{{.operator_role}}";

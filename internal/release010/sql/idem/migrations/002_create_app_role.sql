-- The role an application is granted (or logs in as a member of). It may call the functions
-- and nothing else: no privilege on the tables. The name comes from tern data app_role
-- (default idem_app). Roles belong to the cluster, so an existing role is reused.
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = '{{.app_role}}') THEN
        CREATE ROLE "{{.app_role}}" NOLOGIN;
    END IF;
END
$$;

REVOKE ALL ON SCHEMA idem FROM PUBLIC;
GRANT USAGE ON SCHEMA idem TO "{{.app_role}}";
REVOKE ALL ON ALL TABLES IN SCHEMA idem FROM PUBLIC;

---- create above / drop below ----

REVOKE USAGE ON SCHEMA idem FROM "{{.app_role}}";

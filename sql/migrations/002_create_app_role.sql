-- The role an application is granted (or logs in as a member of). It may call the functions
-- and nothing else: no privilege on the tables. The name comes from tern data app_role
-- (default idem_app). Roles belong to the cluster, so an existing role is reused: an owner
-- that is not a superuser installs after a superuser created the roles once, or granted it
-- CREATEROLE (docs/sql-api.md, "Installing without a superuser"); without either, the error
-- says which step is missing.
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = '{{.app_role}}') THEN
        BEGIN
            CREATE ROLE "{{.app_role}}" NOLOGIN;
        EXCEPTION WHEN duplicate_object OR unique_violation THEN
            -- created meanwhile by an install in another database of the cluster (roles are
            -- the cluster's; tern's advisory lock is the database's): it exists, go on (D245)
            NULL;
        WHEN insufficient_privilege THEN
            RAISE EXCEPTION 'idem: the role "{{.app_role}}" does not exist, and the installing role % may not create it', current_user
                USING ERRCODE = 'insufficient_privilege',
                      HINT = 'Have a superuser run once: CREATE ROLE "{{.app_role}}" NOLOGIN; CREATE ROLE "{{.operator_role}}" NOLOGIN; '
                          || '(or ALTER ROLE ' || quote_ident(current_user) || ' CREATEROLE;), then install again. '
                          || 'See docs/sql-api.md, "Installing without a superuser".';
        END;
    END IF;
END
$$;

REVOKE ALL ON SCHEMA idem FROM PUBLIC;
GRANT USAGE ON SCHEMA idem TO "{{.app_role}}";
REVOKE ALL ON ALL TABLES IN SCHEMA idem FROM PUBLIC;

---- create above / drop below ----

REVOKE USAGE ON SCHEMA idem FROM "{{.app_role}}";

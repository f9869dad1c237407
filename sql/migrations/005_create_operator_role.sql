-- The role of operators and support (a DBA logs in as a member of it): it may read the
-- summary of the keys and one key's story with its body (idem_summary, idem_health, idem_key)
-- and release a stuck lease claim (idem_release_stuck), which the application role may not.
-- The name comes from tern data operator_role (default idem_operator). Roles belong to the
-- cluster, so an existing role is reused; an owner that may not create it is told the
-- superuser step that is missing (002).
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = '{{.operator_role}}') THEN
        BEGIN
            CREATE ROLE "{{.operator_role}}" NOLOGIN;
        EXCEPTION WHEN duplicate_object OR unique_violation THEN
            -- created meanwhile by an install in another database of the cluster (roles are
            -- the cluster's; tern's advisory lock is the database's): it exists, go on (D245)
            NULL;
        WHEN insufficient_privilege THEN
            RAISE EXCEPTION 'idem: the role "{{.operator_role}}" does not exist, and the installing role % may not create it', current_user
                USING ERRCODE = 'insufficient_privilege',
                      HINT = 'Have a superuser run once: CREATE ROLE "{{.operator_role}}" NOLOGIN; '
                          || '(or ALTER ROLE ' || quote_ident(current_user) || ' CREATEROLE;), then install again. '
                          || 'See docs/sql-api.md, "Installing without a superuser".';
        END;
    END IF;
END
$$;

GRANT USAGE ON SCHEMA idem TO "{{.operator_role}}";

---- create above / drop below ----

REVOKE USAGE ON SCHEMA idem FROM "{{.operator_role}}";

-- The role {{.}} exists: created NOLOGIN when it does not (roles belong to the cluster, so an
-- existing one is reused), or the error says which step is missing.
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = '{{.}}') THEN
        BEGIN
            CREATE ROLE "{{.}}" NOLOGIN;
        EXCEPTION WHEN duplicate_object OR unique_violation THEN
            -- created meanwhile by an install in another database of the cluster (roles are
            -- the cluster's; tern's advisory lock is the database's): it exists, go on (D245)
            NULL;
        WHEN insufficient_privilege THEN
            RAISE EXCEPTION 'idem: the role "{{.}}" does not exist, and the installing role % may not create it', current_user
                USING ERRCODE = 'insufficient_privilege',
                      HINT = 'Have a superuser run once: CREATE ROLE "{{.}}" NOLOGIN; '
                          || '(or ALTER ROLE ' || quote_ident(current_user) || ' CREATEROLE;), then install again. '
                          || 'See docs/sql-api.md, "Installing without a superuser".';
        END;
    END IF;
END
$$;

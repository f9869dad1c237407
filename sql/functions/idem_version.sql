-- idem_version: the schema version the installed functions were written for, and the one the
-- database is at (tern's idem.schema_version). A server checks both at start and in its health
-- check: they differ only when functions of another release sit beside this schema (an install
-- that stopped half way, with an installer older than idemsql.Migrate's one transaction), and
-- then it refuses to serve until the next migrate. SECURITY DEFINER: the application role
-- reads the version without a privilege on the version table.
CREATE OR REPLACE FUNCTION idem.idem_version(
    OUT functions_version integer,
    OUT schema_version    integer)
LANGUAGE sql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT {{ .schema_version }}, (SELECT v.version FROM idem.schema_version AS v)
$$;

COMMENT ON FUNCTION idem.idem_version() IS
    'The schema version the installed functions belong to, and the version of the schema (idem.schema_version): equal after a complete install. See docs/sql-api.md.';

-- idem_serves_version: whether code written for schema version p_version may call this
-- database's SQL API. True from the oldest version this release keeps every function, column
-- and behaviour for (release 0.2.0's, 5) up to its own: the code of the previous release keeps
-- serving after this release's migrate (a rolling upgrade), and its start and health checks
-- ask this instead of refusing every newer schema. A later release answers for itself: its
-- install replaces this function, and it raises the oldest version only in a step that drops
-- what that version's code calls. SECURITY INVOKER and IMMUTABLE: it reads nothing (a later
-- release's install replaces it, which invalidates every plan that folded it). A NULL version raises
-- 22004, as every required argument of the API does: a NULL answer would read as "not false".
CREATE OR REPLACE FUNCTION idem.idem_serves_version(p_version integer)
RETURNS boolean
LANGUAGE plpgsql
IMMUTABLE
PARALLEL SAFE
SECURITY INVOKER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF p_version IS NULL THEN
        RAISE EXCEPTION 'idem_serves_version: p_version must not be NULL'
            USING ERRCODE = '22004';
    END IF;
    RETURN p_version BETWEEN {{ .oldest_served }} AND {{ .schema_version }};
END
$$;

COMMENT ON FUNCTION idem.idem_serves_version(integer) IS
    'Whether code written for schema version p_version may call this SQL API: true from the oldest version this release still serves up to its own (a rolling upgrade). See docs/sql-api.md.';

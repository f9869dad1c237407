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

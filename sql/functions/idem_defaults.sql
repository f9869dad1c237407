-- idem_defaults: the defaults the functions use when an argument is NULL or omitted, from
-- their one home (include/defaults.sql), so that a client can learn them instead of
-- repeating them.
CREATE OR REPLACE FUNCTION idem.idem_defaults(
    OUT ttl          interval,
    OUT lock_timeout interval,
    OUT batch_size   integer)
LANGUAGE sql
IMMUTABLE
SECURITY INVOKER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT {{ template "default_ttl" }}, interval '{{ template "default_lock_timeout" }}', {{ template "default_batch_size" }}
$$;

COMMENT ON FUNCTION idem.idem_defaults() IS
    'The defaults of the SQL API: the TTL of a key, the lock timeout of every function, the cleanup batch size. See docs/sql-api.md.';

-- answer_expires_at: until when a key whose answer is stored at p_now is kept at least: the
-- TTL after p_now. idem_complete and idem_save_final store it in lease_expires_at (which
-- idem_begin and cleanup already honour: a row is expired only once expires_at and
-- lease_expires_at have both passed), so an answer stays replayable for the TTL after it was
-- given, however long the work took (docs/sql-api.md, "The life of a key"). expires_at itself
-- never changes at completion: it is indexed, and the completion must stay a HOT update.
--
--   - a transactional claim is written with expires_at = its claim + TTL, and p_anchor is the
--     start of its transaction (at or before the claim): the result is expires_at moved on by
--     the time the transaction has run;
--   - a lease claim is written with expires_at = its lease's end + TTL, and p_anchor is the
--     lease's end: the result is p_now + TTL.
--
-- The arithmetic is done in UTC (timestamp without time zone), where adding an interval does
-- not depend on the session's TimeZone, so the function is truly IMMUTABLE: Citus accepts it
-- inside a write to the distributed key table, where timestamptz + interval (STABLE) is
-- refused. A plain SQL expression without SET clauses, it is inlined by the planner (no call
-- at run time); every name in it is qualified, so no search_path can change it. Not granted:
-- only the functions that run as the owner use it.
CREATE OR REPLACE FUNCTION idem.answer_expires_at(p_expires_at timestamptz, p_anchor timestamptz, p_now timestamptz)
RETURNS timestamptz
LANGUAGE sql
IMMUTABLE
PARALLEL SAFE
AS $$
    SELECT pg_catalog.timezone(interval '0',
               pg_catalog.timezone(interval '0', p_expires_at) OPERATOR(pg_catalog.+) (p_now OPERATOR(pg_catalog.-) p_anchor))
$$;

COMMENT ON FUNCTION idem.answer_expires_at(timestamptz, timestamptz, timestamptz) IS
    'Internal: until when a key whose answer is stored at p_now is kept (its claim''s expiry moved on by p_now - p_anchor). Used by idem_complete and idem_save_final.';

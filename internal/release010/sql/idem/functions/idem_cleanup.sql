-- idem_cleanup: delete at most one batch of expired rows, oldest expires_at first, skipping
-- rows that other transactions hold. Returns how many it deleted; call it again until the
-- count is smaller than the batch size. Safe to run from several sessions at once.
CREATE OR REPLACE FUNCTION idem.idem_cleanup(p_batch_size integer DEFAULT 1000)
RETURNS integer
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '2s'
AS $$
DECLARE
    v_now     timestamptz := clock_timestamp();
    v_deleted integer;
BEGIN
    IF p_batch_size IS NULL OR p_batch_size < 1 THEN
        RAISE EXCEPTION 'idem_cleanup: p_batch_size must be at least 1, got %', coalesce(p_batch_size::text, 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;

    DELETE FROM idem.idempotency_keys AS k
     WHERE k.ctid = ANY (ARRAY(
            SELECT c.ctid FROM idem.idempotency_keys AS c
             WHERE c.expires_at <= v_now
             ORDER BY c.expires_at
             LIMIT p_batch_size
               FOR UPDATE SKIP LOCKED))
       AND k.expires_at <= v_now;
    GET DIAGNOSTICS v_deleted = ROW_COUNT;
    RETURN v_deleted;
END
$$;

COMMENT ON FUNCTION idem.idem_cleanup(integer) IS
    'Deletes at most p_batch_size expired keys (oldest first, SKIP LOCKED) and returns how many; repeat until the count is below the batch size. See docs/sql-api.md.';

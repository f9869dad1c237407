-- check_key: raises 22004 or 22023 unless p_principal and p_key are valid. Private helper of
-- the API functions (not granted to anyone); a PL/pgSQL function so its plan is cached.
CREATE OR REPLACE FUNCTION idem.check_key(p_principal text, p_key text)
RETURNS void
LANGUAGE plpgsql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF p_principal IS NULL OR p_key IS NULL THEN
        RAISE EXCEPTION 'idem: principal and key must not be NULL'
            USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF length(p_principal) NOT BETWEEN 1 AND 255 THEN
        RAISE EXCEPTION 'idem: principal must be 1 to 255 characters, got %', length(p_principal)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_key !~ '^[!-~]{1,255}$' THEN
        RAISE EXCEPTION 'idem: key must be 1 to 255 visible ASCII characters (0x21-0x7E)'
            USING ERRCODE = 'invalid_parameter_value',
                  DETAIL = format('The key has %s characters, %s bytes.', length(p_key), octet_length(p_key));
    END IF;
END
$$;

COMMENT ON FUNCTION idem.check_key(text, text) IS
    'Private. Raises 22004 (NULL) or 22023 (empty, too long, not visible ASCII) for a bad principal or key.';

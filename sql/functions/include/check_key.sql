{{- /* check_key: the WHEN branches that validate p_principal and p_key, included in the
   validation CASE of every function that takes them. Each branch yields 'SQLSTATE message'. */ -}}
        WHEN p_principal IS NULL OR p_key IS NULL
            THEN '22004 p_principal and p_key must not be NULL'
        WHEN length(p_principal) NOT BETWEEN 1 AND 255
            THEN format('22023 p_principal must be 1 to 255 characters, got %s', length(p_principal))
        -- Not ^[!-~]{1,255}$: a bounded repetition compiles to a large automaton that cost 8%
        -- of the backend's time in a profile; a length check and a one-class search do not.
        WHEN octet_length(p_key) NOT BETWEEN 1 AND 255 OR p_key COLLATE pg_catalog."default" ~ '[^!-~]'
            THEN format('22023 p_key must be 1 to 255 visible ASCII characters (0x21-0x7E), got %s characters in %s bytes',
                        length(p_key), octet_length(p_key))

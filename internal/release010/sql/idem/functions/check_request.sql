{{- /* check_request: the WHEN branches that validate the request arguments shared by
   idem_begin and idem_save_final (p_action, p_request_sha256, p_ttl), included in their
   validation CASE after check_key.sql. Each branch yields 'SQLSTATE message'. */ -}}
        WHEN p_action IS NULL OR p_request_sha256 IS NULL OR p_ttl IS NULL
            THEN '22004 p_action, p_request_sha256 and p_ttl must not be NULL'
        WHEN length(p_action) NOT BETWEEN 1 AND 1000
            THEN '22023 p_action must be 1 to 1000 characters'
        WHEN octet_length(p_request_sha256) <> 32
            THEN format('22023 p_request_sha256 must be 32 bytes, got %s', octet_length(p_request_sha256))
        WHEN p_ttl <= interval '0'
            THEN format('22023 p_ttl must be positive, got %s', p_ttl)

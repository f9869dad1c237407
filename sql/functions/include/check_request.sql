{{- /* check_request: the WHEN branches that validate the request arguments shared by
   idem_begin and idem_save_final (p_action, p_request_sha256, p_ttl, p_request_fields),
   included in their validation CASE after check_key.sql. Each branch yields
   'SQLSTATE message'. A NULL p_ttl means the default (include/defaults.sql). */ -}}
        WHEN p_action IS NULL OR p_request_sha256 IS NULL
            THEN '22004 p_action and p_request_sha256 must not be NULL'
        WHEN length(p_action) NOT BETWEEN 1 AND 1000
            THEN '22023 p_action must be 1 to 1000 characters'
        WHEN octet_length(p_request_sha256) <> 32
            THEN format('22023 p_request_sha256 must be 32 bytes, got %s', octet_length(p_request_sha256))
        WHEN p_ttl IS NOT NULL AND {{ template "include/not_positive.sql" "p_ttl" }}
            THEN format('22023 p_ttl must be positive in every part, got %s', p_ttl)
        WHEN jsonb_typeof(p_request_fields) <> 'object'
             OR jsonb_path_exists(p_request_fields, 'strict $.* ? (@.type() != "string" || !(@ like_regex "^[0-9a-fA-F]{16}"))')
            THEN '22023 p_request_fields must be a JSON object whose values are hex SHA-256 digests (at least 16 hex digits)'

{{- /* fields_blob_lazy: v_fields := p_request_fields as stored in idempotency_keys.request_fields
   (for each field, its name in UTF-8, a NUL byte and the first 8 bytes of its hash), unless
   it was built already; NULL when p_request_fields is NULL, empty for an empty object. For a p_request_fields
   that include/check_fields.sql accepted. */ -}}
            IF p_request_fields IS NOT NULL AND v_fields IS NULL THEN
                SELECT coalesce(string_agg(convert_to(f.key, 'UTF8') || E'\\x00'::bytea || decode(left(f.value #>> '{}', 16), 'hex'), ''::bytea), ''::bytea)
                  INTO v_fields
                  FROM jsonb_each(p_request_fields) AS f;
            END IF;

{{- /* fields_blob: v_fields := p_request_fields ({"name": "hex sha256"}) as stored in
   idempotency_keys.request_fields: for each field, its name in UTF-8, a NUL byte and the
   first 8 bytes of its hash. Eight bytes only name what changed on a mismatch; the full
   p_request_sha256 decides. NULL when p_request_fields is NULL or empty. One query converts
   and checks (a value with a character that is not a hex digit in its first 16 raises decode's
   own 22023; one shorter than 16, or with whitespace there, which decode skips, decodes to fewer
   than 8 bytes), and one test reads its verdict: v_ok is NULL for an empty object and for anything but an object (jsonb_each reads
   nothing then). The argument is the function's name. */ -}}
        IF p_request_fields IS NOT NULL THEN
            SELECT string_agg(convert_to(f.key, 'UTF8') || '\x00'::bytea || decode(left(f.value #>> '{}', 16), 'hex'), ''::bytea),
                   bool_and(jsonb_typeof(f.value) = 'string' AND octet_length(decode(left(f.value #>> '{}', 16), 'hex')) = 8)
              INTO v_fields, v_ok
              FROM jsonb_each(CASE WHEN jsonb_typeof(p_request_fields) = 'object' THEN p_request_fields END) AS f;
            IF NOT coalesce(v_ok, jsonb_typeof(p_request_fields) = 'object') THEN
{{ template "include/bad_fields.sql" . }}
            END IF;
        END IF;

{{- /* fields_blob: p_request_fields ({"name": "hex sha256"}) as stored in
   idempotency_keys.request_fields: for each field, its name in UTF-8, a NUL byte and the
   first 8 bytes of its hash. Eight bytes only name what changed on a mismatch; the full
   p_request_sha256 decides. NULL when p_request_fields is NULL or empty. */ -}}
(SELECT string_agg(convert_to(f.key, 'UTF8') || '\x00'::bytea || decode(left(f.value, 16), 'hex'), ''::bytea)
   FROM jsonb_each_text(p_request_fields) AS f)

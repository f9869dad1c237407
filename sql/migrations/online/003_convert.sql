{{- /* online/003_convert.sql: the select list that turns a 0.1.0 row (the argument: its alias)
   into a row of the new table, in the new table's column order. Shared by the conversion
   function (the trigger's), the online batches and migration 003's copy under its lock. */ -}}
CASE WHEN {{ . }}.state = 'in_progress' AND {{ . }}.lease_expires_at IS NOT NULL
            THEN {{ . }}.lease_expires_at + ({{ . }}.expires_at - {{ . }}.created_at) ELSE {{ . }}.expires_at END,
       {{ . }}.attempt::bigint, hashtextextended({{ . }}.action, 0), {{ . }}.lease_expires_at,
       CASE WHEN {{ . }}.state = 'in_progress' AND {{ . }}.lease_expires_at IS NOT NULL THEN {{ . }}.created_at END,
       NULL::bigint,
       {{ . }}.response_status::smallint,
       CASE {{ . }}.state WHEN 'in_progress' THEN 'p' WHEN 'completed' THEN 'c' ELSE 'r' END::"char",
       {{ . }}.uncompleted, {{ . }}.principal_id, {{ . }}.key, {{ . }}.request_sha256,
       (SELECT string_agg(convert_to(f.key, 'UTF8') || E'\\x00'::bytea ||
                              CASE WHEN f.value #>> '{}' ~ '^[0-9a-fA-F]{16}' THEN decode(left(f.value #>> '{}', 16), 'hex')
                                   ELSE E'\\x0000000000000000'::bytea END,
                          ''::bytea ORDER BY f.key)
          FROM jsonb_each({{ . }}.request_fields) AS f),
       {{ . }}.resource_id, {{ . }}.withheld,
       CASE WHEN {{ . }}.response_status IS NOT NULL THEN coalesce(
       (SELECT jsonb_object_agg(h.key, CASE jsonb_typeof(h.value)
                                           WHEN 'array' THEN to_jsonb(coalesce((SELECT string_agg(v, ', ') FROM jsonb_array_elements_text(h.value) AS v), ''))
                                           WHEN 'string' THEN h.value
                                           ELSE to_jsonb(h.value #>> '{}') END)
          FROM jsonb_each(CASE WHEN jsonb_typeof({{ . }}.response_headers) = 'object' THEN {{ . }}.response_headers END) AS h
         WHERE jsonb_typeof(h.value) <> 'null'), '{}') END,
       {{ . }}.response_body
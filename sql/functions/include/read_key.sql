{{- /* read_key: reads the key's row (p_principal, p_key) into idem_begin's record v_row, NULL
   when there is none (FOUND says which). The argument is a locking clause ("FOR UPDATE") or "". */ -}}
        SELECT k.state, k.expires_at, k.lease_expires_at, k.attempt, k.generation, k.action_hash,
               k.request_sha256, k.request_fields, k.response_status::integer AS response_status,
               k.response_headers, k.response_body, k.resource_id, k.withheld
          INTO v_row FROM idem.idempotency_keys AS k
         WHERE k.principal_id = p_principal COLLATE pg_catalog."default" AND k.key = p_key COLLATE pg_catalog."default"{{ if . }}
           {{ . }}{{ end }};

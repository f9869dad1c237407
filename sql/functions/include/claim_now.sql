{{- /* claim_now: idem_begin's claim of a key whose row it did not find (gone since it was read,
   or never there), as a fresh claim made now: the field hashes as stored, a new token, the
   lease and expiry from clock_timestamp(), then include/claim_insert.sql. Returns 'claimed'
   with the provider key of its new generation; when the key's row exists (the INSERT has
   waited for a transaction writing it first, without a lock), goes on with FOUND false. */ -}}
{{ template "include/fields_blob_lazy.sql" . }}
            v_now := clock_timestamp();
            v_token := nextval('idem.token_seq');
            v_lease := v_now + p_lease;
            v_expires := coalesce(v_lease, v_now) + coalesce(p_ttl, {{ template "default_ttl" }});
{{ template "include/claim_insert.sql" . }}
            IF FOUND THEN
                provider_key := {{ template "include/provider_key.sql" "attempt" }};
                RETURN;
            END IF;
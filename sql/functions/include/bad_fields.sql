{{- /* bad_fields: raises 22023 for a p_request_fields that is not a JSON object of hex
   digests, naming which (include/check_fields.sql, include/fields_blob.sql). The argument is the
   function's name. */ -}}
                IF jsonb_typeof(p_request_fields) <> 'object' THEN
                    RAISE EXCEPTION '{{ . }}: p_request_fields must be a JSON object, got %', jsonb_typeof(p_request_fields)
                        USING ERRCODE = '22023';
                END IF;
                RAISE EXCEPTION '{{ . }}: p_request_fields must be a JSON object whose values are hex SHA-256 digests (at least 16 hex digits)'
                    USING ERRCODE = '22023';

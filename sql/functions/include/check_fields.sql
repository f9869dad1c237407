{{- /* check_fields: p_request_fields ({"name": "hex sha256"}) is NULL, or a JSON object whose
   values are strings that start with 16 hex digits (the part that is stored); anything else
   raises 22023, as include/fields_blob.sql does while it builds the stored form. Only the
   first 16 characters are examined and used: they must be hex digits. For the
   paths that find the key's row and so may never need the stored form: one test (a jsonpath,
   a simple expression) instead of building it (include/fields_blob_lazy.sql builds it where
   it is stored or compared). The argument is the function's name. */ -}}
        IF p_request_fields IS NOT NULL AND (jsonb_typeof(p_request_fields) <> 'object'
               OR p_request_fields @? 'strict $.* ? (@.type() != "string" || !(@ like_regex "^[0-9a-fA-F]{16}"))') THEN
{{ template "include/bad_fields.sql" . }}
        END IF;

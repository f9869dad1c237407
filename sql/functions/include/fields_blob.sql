{{- /* fields_blob: v_fields := p_request_fields ({"name": "hex sha256"}) as stored in
   idempotency_keys.request_fields: for each field, its name in UTF-8, a NUL byte and the
   first 8 bytes of its hash. Eight bytes only name what changed on a mismatch; the full
   p_request_sha256 decides. NULL when p_request_fields is NULL (unknown); empty for an empty
   object, whose fields are known: none (a mismatch with it names every field of the other). One query converts
   and checks. It reads each value as text by its name (->>: a number reads as its text, a null
   as NULL) over jsonb_object_keys, a set of scalars: jsonb_each_text's two OUT columns cost a
   tuple descriptor built twice a call (the function scan's and the function's own), 7,000
   instructions of a fresh claim (D189). A value with a character that is not a hex digit in its
   first 16 raises decode's own 22023; one shorter than 16, or with whitespace there (which
   decode skips), or a null (a NULL part, which string_agg leaves out) makes the stored form
   shorter than its names plus 9 bytes each (v_size), and the test below refuses it, together
   with a value that is not a string (a jsonpath). v_size is NULL for an empty object and for
   anything but an object (jsonb_object_keys reads nothing then). The length test instead of a
   second decode of every value: 3,600 instructions fewer. The argument is the function's
   name. */ -}}
        IF p_request_fields IS NOT NULL THEN
            SELECT coalesce(string_agg(convert_to(f, 'UTF8') || E'\\x00'::bytea || decode(left(p_request_fields ->> f, 16), 'hex'), ''::bytea), ''::bytea),
                   sum(octet_length(convert_to(f, 'UTF8')) + 9)
              INTO v_fields, v_size
              FROM jsonb_object_keys(CASE WHEN jsonb_typeof(p_request_fields) = 'object' THEN p_request_fields END) AS f;
            IF NOT coalesce(octet_length(v_fields) = v_size AND NOT p_request_fields @? '$.* ? (@.type() != "string")', jsonb_typeof(p_request_fields) = 'object') THEN
{{ template "include/bad_fields.sql" . }}
            END IF;
        END IF;

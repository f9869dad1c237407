{{- /* check_begin_args: idem_begin's test of its key and request arguments (22004 or 22023),
   for the paths that did not find a replay: one small test (include/valid_key.sql,
   include/valid_request.sql); the CASE that names the problem runs only when it fails. */ -}}
        IF NOT coalesce({{ template "include/valid_key.sql" }} AND {{ template "include/valid_request.sql" }}, false) THEN
            v_problem := CASE
{{ template "include/check_key.sql" . }}
{{ template "include/check_request.sql" . }}
            END;
{{ template "include/raise.sql" "idem_begin" }}
        END IF;

{{- /* valid_response: the rule of check_response.sql as one test (NULL when an argument is NULL). */ -}}
(p_status BETWEEN 100 AND 599 AND jsonb_typeof(p_headers) = 'object'
 AND NOT jsonb_path_exists(p_headers, 'strict $.* ? (@.type() != "string")')
 AND (p_withheld IS NULL OR (p_withheld COLLATE pg_catalog."default" IN ('one_time_secret', 'too_large') AND p_body IS NULL)))

{{- /* valid_request: the rule of check_request.sql as one test (NULL when an argument is NULL). */ -}}
(length(p_action) BETWEEN 1 AND 1000 AND octet_length(p_request_sha256) = 32)

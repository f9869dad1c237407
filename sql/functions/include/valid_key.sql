{{- /* valid_key: true when p_principal and p_key are valid (NULL when one is NULL): the rule
   of check_key.sql as one small test, for the fast path. A valid call compiles only this; the
   CASE that names what is wrong is compiled when the test fails. */ -}}
(length(p_principal) BETWEEN 1 AND 255 AND octet_length(p_key) BETWEEN 1 AND 255 AND p_key COLLATE pg_catalog."default" !~ '[^!-~]')

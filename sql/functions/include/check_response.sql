{{- /* check_response: the WHEN branches that validate a response to store (p_status,
   p_headers, p_withheld, p_body), shared by idem_complete and idem_save_final. Each branch
   yields 'SQLSTATE message'. */ -}}
        WHEN p_status IS NULL OR p_headers IS NULL
            THEN '22004 p_status and p_headers must not be NULL'
        WHEN p_status NOT BETWEEN 100 AND 599
            THEN format('22023 p_status must be between 100 and 599, got %s', p_status)
        WHEN jsonb_typeof(p_headers) <> 'object' OR jsonb_path_exists(p_headers, 'strict $.* ? (@.type() != "string")')
            THEN '22023 p_headers must be a JSON object whose values are strings'
        WHEN p_withheld COLLATE pg_catalog."default" NOT IN ('one_time_secret', 'too_large') OR (p_withheld IS NOT NULL AND p_body IS NOT NULL)
            THEN '22023 p_withheld must be NULL, one_time_secret or too_large, and p_body NULL when it is set'

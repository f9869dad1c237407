{{- /* check_ttl: refuses a p_ttl that is not positive in every part, or longer than
   max_interval (NULL is the default), and gives one with a year, month or day part in hours
   (include/in_hours.sql). The argument is the function's name.
   Compiled only when p_ttl is given. */ -}}
    IF p_ttl IS NOT NULL THEN
        IF {{ template "include/not_plain_positive.sql" "p_ttl" }} THEN
            IF {{ template "include/not_positive.sql" "p_ttl" }} THEN
                RAISE EXCEPTION '{{ . }}: p_ttl must be positive in every part, got %', p_ttl USING ERRCODE = '22023';
            END IF;
            -- Within the limit only (tested below): the hours are computed in integers.
            IF p_ttl <= interval '{{ template "max_interval" }}' THEN
                p_ttl := {{ template "include/in_hours.sql" "p_ttl" }};
            END IF;
        END IF;
        IF p_ttl > interval '{{ template "max_interval" }}' THEN
            RAISE EXCEPTION '{{ . }}: p_ttl must be at most {{ template "max_interval" }}, got %', p_ttl USING ERRCODE = '22023';
        END IF;
    END IF;

{{- /* raise: the one decoder of the 'SQLSTATE message' strings the validation CASE yields.
   The argument is the function's name, which prefixes the message. */ -}}
    IF v_problem IS NOT NULL THEN
        RAISE EXCEPTION '{{ . }}: %', substr(v_problem, 7) USING ERRCODE = left(v_problem, 5);
    END IF;

{{- /* provider_key_from: the provider key (include/provider_key.sql) of the generation
   (index . 0, a bigint variable) of (p_principal, p_key), with the installation's secret
   already read (index . 1, an expression: NULL for a generation the previous release started).
   A simple expression: PL/pgSQL evaluates it without the executor. */ -}}
encode(sha256(CASE WHEN {{ index . 1 }} IS NULL
            THEN '\x70676964656d2070726f7669646572206b6579207632'::bytea
            ELSE '\x70676964656d2070726f7669646572206b6579207633'::bytea || '\x00'::bytea || {{ index . 1 }} END
        || '\x00'::bytea || convert_to(p_principal, 'UTF8') || '\x00'::bytea
        || convert_to(p_key, 'UTF8') || '\x00'::bytea || convert_to({{ index . 0 }}::text, 'UTF8')), 'hex')

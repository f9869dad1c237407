{{- /* provider_key: the key to hand an outside provider for the request of generation . (a
   bigint variable) of (p_principal, p_key): 64 hex digits of a SHA-256. For a generation
   started since migration 006 (one whose token is at or above a row of
   idem.installation_secrets in its token range), the SHA-256 of the label "pgidem provider key
   v3", the installation's secret (32 bytes), the principal, the key and the generation's number
   in decimal; for a generation that the previous release started, the SHA-256 of the label
   "pgidem provider key v2", the principal, the key and the generation, as that release gave it
   (an upgrade never changes the provider key of a generation that exists). Text in UTF-8, each
   part followed by a NUL byte but the last. The same for every attempt of the generation,
   different for every other generation, principal and installation. A simple expression
   (include/secret_applies.sql, include/secret_of.sql: the secret's sequences are read
   once, only for a generation that has one). */ -}}
encode(sha256(CASE WHEN {{ template "include/secret_applies.sql" . }}
            THEN '\x70676964656d2070726f7669646572206b6579207633'::bytea || '\x00'::bytea || {{ template "include/secret_of.sql" . }}
            ELSE '\x70676964656d2070726f7669646572206b6579207632'::bytea END
        || '\x00'::bytea || convert_to(p_principal, 'UTF8') || '\x00'::bytea
        || convert_to(p_key, 'UTF8') || '\x00'::bytea || convert_to({{ . }}::text, 'UTF8')), 'hex')

{{- /* provider_key: the key to hand an outside provider for the request of generation . (a
   bigint variable) of (p_principal, p_key): 64 hex digits of the SHA-256 of the label
   "pgidem provider key v2", the principal, the key and the generation's number in decimal,
   in UTF-8, each followed by a NUL byte but the last. The same for every attempt of the
   generation, different for every other generation and principal. */ -}}
encode(sha256('\x70676964656d2070726f7669646572206b6579207632'::bytea || '\x00'::bytea || convert_to(p_principal, 'UTF8') || '\x00'::bytea
              || convert_to(p_key, 'UTF8') || '\x00'::bytea || convert_to({{ . }}::text, 'UTF8')), 'hex')

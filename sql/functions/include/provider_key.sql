{{- /* provider_key: the key to hand an outside provider for the request of generation . (a
   bigint variable) of (p_principal, p_key): 64 hex digits of a SHA-256. For a generation
   started since migration 006 (one whose token is at or above a row of
   idem.installation_secrets in its token range), the SHA-256 of the label "pgidem provider key
   v3", the installation's secret (32 bytes), the principal, the key and the generation's number
   in decimal; for a generation that the previous release started, the SHA-256 of the label
   "pgidem provider key v2", the principal, the key and the generation, as that release gave it
   (an upgrade never changes the provider key of a generation that exists). Text in UTF-8, each
   part followed by a NUL byte but the last. The same for every attempt of the generation,
   different for every other generation, principal and installation. Which label and secret
   apply is worked out once a session for every interval of tokens (provider_key_bounds,
   provider_key_prefixes in install.sql, folded into the plan): a call picks its prefix with one
   width_bucket and reads no sequence and no table. A simple expression. Every literal with a
   backslash is an E'' string, read the same whatever the caller's standard_conforming_strings
   (any role may turn it off; '\x00' then reads as a NUL character, D231). */ -}}
encode(sha256((idem.provider_key_prefixes())[width_bucket({{ . }}, idem.provider_key_bounds()) + 1]
        || convert_to(p_principal, 'UTF8') || E'\\x00'::bytea
        || convert_to(p_key, 'UTF8') || E'\\x00'::bytea || convert_to({{ . }}::text, 'UTF8')), 'hex')
{{- /* secret_of: the installation's secret of the generation . (a bigint variable), for a generation
   that has one (include/secret_applies.sql): the secret with the greatest from_token at or below
   it (width_bucket over the sorted first tokens), if that one is in the generation's token range
   (the top 16 bits); its 32 bytes are its four sequences' values. The lists come from IMMUTABLE
   functions whose bodies are literals (include/publish_secrets.sql), and the values from one
   that reads the sequences (installation_secret_values, install.sql), all folded by the
   planner into the plan, once a session: a call reads no sequence and no table. So the
   expression stays simple (PL/pgSQL evaluates it without the executor), and gives every
   transaction the same secret for a token whatever its snapshot. */ -}}
(idem.installation_secret_values())[width_bucket({{ . }}, idem.installation_secret_tokens())]
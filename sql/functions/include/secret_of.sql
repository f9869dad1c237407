{{- /* secret_of: the installation's secret of the generation . (a bigint variable), for a generation
   that has one (include/secret_applies.sql): the secret with the greatest from_token at or below
   it (width_bucket over the sorted first tokens), if that one is in the generation's token range
   (the top 16 bits); its 32 bytes are its four sequences' values. The lists come from IMMUTABLE
   functions whose bodies are literals (include/publish_secrets.sql), which the planner folds
   into the plan; the values are read from the sequences without a snapshot. So the expression
   stays simple (PL/pgSQL evaluates it without the executor), and gives every transaction the
   same secret for a token whatever its snapshot. */ -}}
int8send(pg_sequence_last_value((idem.installation_secret_seqs())[4 * width_bucket({{ . }}, idem.installation_secret_tokens()) - 3]))
 || int8send(pg_sequence_last_value((idem.installation_secret_seqs())[4 * width_bucket({{ . }}, idem.installation_secret_tokens()) - 2]))
 || int8send(pg_sequence_last_value((idem.installation_secret_seqs())[4 * width_bucket({{ . }}, idem.installation_secret_tokens()) - 1]))
 || int8send(pg_sequence_last_value((idem.installation_secret_seqs())[4 * width_bucket({{ . }}, idem.installation_secret_tokens())]))

{{- /* secret_of: the installation's secret of the generation . (a bigint variable), NULL for a
   generation the previous release started: the secret with the greatest from_token at or below
   it (width_bucket over the sorted from_tokens), if that one is in the generation's token range
   (the top 16 bits). The two arrays come from IMMUTABLE functions without arguments, which the
   planner evaluates once when it plans this expression: the expression stays simple, and
   PL/pgSQL evaluates it without the executor, for every call of the session until the function
   is compiled again (idem_new_installation_secret makes sure it is; installation_secrets.sql). */ -}}
(CASE WHEN width_bucket({{ . }}, idem.installation_secret_tokens()) > 0
       AND (idem.installation_secret_tokens())[width_bucket({{ . }}, idem.installation_secret_tokens())] >> 48 = {{ . }} >> 48
      THEN (idem.installation_secret_bytes())[width_bucket({{ . }}, idem.installation_secret_tokens())] END)

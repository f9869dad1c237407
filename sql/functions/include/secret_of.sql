{{- /* secret_of: the installation's secret for the generation . (an expression), NULL for a
   generation the previous release started: the secret with the greatest from_token at or
   below it, in its token range (the top 16 bits). A scalar subquery: inside a statement that
   runs anyway (the read of a key's row) it costs an index probe of a tiny table. */ -}}
(SELECT x.secret FROM idem.installation_secrets AS x
  WHERE x.from_token <= {{ . }} AND x.from_token >> 48 = ({{ . }}) >> 48
  ORDER BY x.from_token DESC LIMIT 1)

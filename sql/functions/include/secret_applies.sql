{{- /* secret_applies: whether the generation . (a bigint variable) has a secret of the
   installation: a secret's first token at or below it (width_bucket over the sorted first
   tokens) in its token range (the top 16 bits). False for a generation the previous release
   started. Folded lists only: no sequence is read. */ -}}
(width_bucket({{ . }}, idem.installation_secret_tokens()) > 0
 AND (idem.installation_secret_tokens())[width_bucket({{ . }}, idem.installation_secret_tokens())] >> 48 = {{ . }} >> 48)

{{- /* publish_secrets (PL/pgSQL statements): writes installation_secret_tokens() and
   installation_secret_seqs() from idem.installation_secrets: IMMUTABLE SQL functions whose
   bodies are the list as literals (the first tokens, sorted, and the four sequences of each
   secret in that order), so that the planner folds them into the provider key's plan (it reads
   no table, and no snapshot). They hold no secret: the values stay in the sequences, which
   only the owner may read. */ -}}
EXECUTE format($fn$CREATE OR REPLACE FUNCTION idem.installation_secret_tokens() RETURNS bigint[]
    LANGUAGE sql IMMUTABLE SECURITY INVOKER SET search_path = pg_catalog, pg_temp AS %L$fn$,
    format('SELECT %L::bigint[]', (SELECT coalesce(array_agg(s.from_token ORDER BY s.from_token), '{}')
                                     FROM idem.installation_secrets AS s)));
EXECUTE format($fn$CREATE OR REPLACE FUNCTION idem.installation_secret_seqs() RETURNS regclass[]
    LANGUAGE sql IMMUTABLE SECURITY INVOKER SET search_path = pg_catalog, pg_temp AS %L$fn$,
    format('SELECT %L::regclass[]', (SELECT coalesce(array_agg(u.q ORDER BY s.from_token, u.o), '{}')
                                       FROM idem.installation_secrets AS s,
                                            unnest(s.secret_seqs) WITH ORDINALITY AS u(q, o))));
COMMENT ON FUNCTION idem.installation_secret_tokens() IS
    'Internal: the first token of each installation secret, sorted; written from idem.installation_secrets, folded into the provider key''s plan.';
COMMENT ON FUNCTION idem.installation_secret_seqs() IS
    'Internal: the four sequences of each installation secret, in the order of installation_secret_tokens; written from idem.installation_secrets.';

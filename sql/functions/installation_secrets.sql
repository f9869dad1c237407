-- installation_secret_tokens, installation_secret_bytes: the installation's secrets for provider
-- keys (idem.installation_secrets), as two arrays sorted by the first token each applies to.
-- Internal; nothing is granted on them (they return the secrets).
--
-- IMMUTABLE on purpose, though they read a table: the planner evaluates them once, when it plans
-- the provider key's expression (include/secret_of.sql), and PL/pgSQL keeps that plan for the
-- session, so a claim reads the secrets without running a query (a scalar subquery made every
-- claim and every replay about 15 microseconds dearer, docs/DECISIONS.md). What keeps the
-- folded value true: the table changes only in the migrate's transaction, which installs the
-- functions again (every session compiles them anew), and in idem_new_installation_secret, which
-- compiles them anew too and waits for every older transaction before any token of the new
-- secret is drawn.
CREATE OR REPLACE FUNCTION idem.installation_secret_tokens()
RETURNS bigint[]
LANGUAGE sql
IMMUTABLE
SECURITY INVOKER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT coalesce(array_agg(s.from_token ORDER BY s.from_token), '{}') FROM idem.installation_secrets AS s
$$;

COMMENT ON FUNCTION idem.installation_secret_tokens() IS
    'Internal: the first token of each installation secret, sorted; folded into the provider key''s plan (IMMUTABLE on purpose).';

CREATE OR REPLACE FUNCTION idem.installation_secret_bytes()
RETURNS bytea[]
LANGUAGE sql
IMMUTABLE
SECURITY INVOKER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT coalesce(array_agg(s.secret ORDER BY s.from_token), '{}') FROM idem.installation_secrets AS s
$$;

COMMENT ON FUNCTION idem.installation_secret_bytes() IS
    'Internal: the installation secrets, in the order of installation_secret_tokens; folded into the provider key''s plan (IMMUTABLE on purpose).';

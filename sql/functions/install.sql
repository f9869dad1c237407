-- The public SQL API of idem, installed (and re-installed) by `server migrate` after the
-- migrations in sql/migrations. Each function lives in its own file; include/ holds the
-- fragments they share (validation, defaults, attributes).

-- The routines of schema idem before this install (none on a first one), for the take-back
-- of default privileges below: it reaches the routines this install creates, never the grants
-- an earlier install made (an earlier application role's API).
DO $$
BEGIN
    PERFORM pg_catalog.set_config('idem.routines_before', coalesce((SELECT pg_catalog.string_agg(p.oid::text, ',')
        FROM pg_catalog.pg_proc AS p WHERE p.pronamespace = pg_catalog.to_regnamespace('idem')), ''), true);
END
$$;

-- Signatures of earlier releases, gone (CHANGELOG.md): 0.1.0's attempt was an integer and
-- idem_save_final had no p_withheld and p_resource_id.
DO $$
BEGIN
    -- CREATE OR REPLACE cannot change a function's OUT parameters: drop an idem_begin whose
    -- OUT columns are not this release's (0.1.0's, whose attempt was an integer; an early
    -- build of 0.2.0's, without provider_key; a pre-release build of 0.3.0's, with
    -- recovery_point and recovery_saved). Release 0.2.0's has the same columns as this one and
    -- is replaced in place: a function dropped under a serving release fails the calls that
    -- planned it before the drop committed (SQLSTATE XX000, "cache lookup failed").
    IF (SELECT NOT ('provider_key' = ANY (p.proargnames)) OR 'recovery_saved' = ANY (p.proargnames)
          FROM pg_catalog.pg_proc AS p
         WHERE p.oid = to_regprocedure('idem.idem_begin(text,text,text,bytea,interval,interval,jsonb,interval)')) THEN
        DROP FUNCTION idem.idem_begin(text, text, text, bytea, interval, interval, jsonb, interval);
    END IF;
END
$$;
-- idem_health with the replication columns (a pre-release build of 0.3.0's; they are
-- idem_replication's now): CREATE OR REPLACE cannot remove OUT parameters. Release 0.2.0's has
-- this release's columns and is replaced in place. Its grants are given again below.
DO $$
BEGIN
    IF (SELECT 'replication' = ANY (p.proargnames) FROM pg_catalog.pg_proc AS p
         WHERE p.oid = to_regprocedure('idem.idem_health()')) THEN
        DROP FUNCTION idem.idem_health();
    END IF;
END
$$;
DROP FUNCTION IF EXISTS idem.idem_complete(text, text, integer, integer, jsonb, bytea, text, text);
DROP FUNCTION IF EXISTS idem.idem_release(text, text, integer);
DROP FUNCTION IF EXISTS idem.idem_save_final(text, text, text, bytea, interval, integer, jsonb, bytea, jsonb);
-- A pre-release of 0.2.0 had a cleanup helper that ran any command on the Citus workers.
DROP FUNCTION IF EXISTS idem.on_workers(text);
-- An early build of this release had idem_new_installation_secret without p_wait.
DROP PROCEDURE IF EXISTS idem.idem_new_installation_secret();

{{ template "answer_expires_at.sql" . }}
-- The lists of the installation's secrets, written from idem.installation_secrets (migration
-- 006) as functions the planner folds into the provider key's plan.
DO $$
BEGIN
{{ template "include/publish_secrets.sql" . }}
END
$$;
-- The secrets' values, 32 bytes each, in the order of installation_secret_tokens(): read from
-- their sequences when the planner folds this IMMUTABLE function into the plan of the provider
-- key's expression, once a session (and again when idem_new_installation_secret has every
-- session compile the functions that compute provider keys anew), so that a call reads no
-- sequence. INVOKER: only the owner may read the sequences, and the folding runs inside the
-- SECURITY DEFINER functions, as the owner; nobody else may call it (below). The values live in
-- the session's plans only; the function's text holds none.
CREATE OR REPLACE FUNCTION idem.installation_secret_values() RETURNS bytea[]
    LANGUAGE sql IMMUTABLE SECURITY INVOKER SET search_path = pg_catalog, pg_temp
AS $$
    SELECT coalesce(array_agg(int8send(pg_sequence_last_value(q.s[4 * i - 3])) || int8send(pg_sequence_last_value(q.s[4 * i - 2]))
                              || int8send(pg_sequence_last_value(q.s[4 * i - 1])) || int8send(pg_sequence_last_value(q.s[4 * i]))
                              ORDER BY i), '{}')
      FROM (SELECT idem.installation_secret_seqs() AS s) AS q, generate_series(1, cardinality(q.s) / 4) AS i
$$;
COMMENT ON FUNCTION idem.installation_secret_values() IS
    'Internal: the 32 bytes of each installation secret, in the order of installation_secret_tokens; folded into the provider key''s plan, for the owner only.';
-- The provider key's prefix (include/provider_key.sql) by token, derived from the lists above
-- and folded into the provider key's plan like them, so that a call picks its prefix with one
-- width_bucket and reads no sequence and no table. The rule: a generation takes the secret whose
-- first token is the greatest at or below it (width_bucket over the sorted first tokens), if
-- that token is in the generation's token range (the top 16 bits); otherwise (a generation the
-- previous release started) none. provider_key_bounds: the sorted lower bounds of the token
-- intervals in which the rule gives one answer (each secret's first token, and the start of the
-- next token range after it when the next secret does not start there first).
-- provider_key_prefixes: for the tokens below the first bound (index 1) and for each interval
-- (index k + 1), the label (v3 with a secret, v2 without) and the secret, each followed by a NUL
-- byte; the rule is applied to the interval's lower bound. Both INVOKER and granted to nobody:
-- the prefixes hold the secrets, and the folding runs inside the SECURITY DEFINER functions.
CREATE OR REPLACE FUNCTION idem.provider_key_bounds() RETURNS bigint[]
    LANGUAGE sql IMMUTABLE SECURITY INVOKER SET search_path = pg_catalog, pg_temp
AS $$
    SELECT coalesce(array_agg(x.b ORDER BY x.b), '{}')
      FROM (SELECT t.t FROM unnest(idem.installation_secret_tokens()) AS t(t)
            UNION ALL
            SELECT ((t.t >> 48) + 1) << 48
              FROM unnest(idem.installation_secret_tokens()) WITH ORDINALITY AS t(t, i)
             WHERE t.t >> 48 < 32767
               AND ((t.t >> 48) + 1) << 48 < coalesce((idem.installation_secret_tokens())[t.i + 1], 9223372036854775807)) AS x(b)
$$;
COMMENT ON FUNCTION idem.provider_key_bounds() IS
    'Internal: the lower bounds of the token intervals that share one provider key prefix; derived from installation_secret_tokens, folded into the provider key''s plan.';
CREATE OR REPLACE FUNCTION idem.provider_key_prefixes() RETURNS bytea[]
    LANGUAGE sql IMMUTABLE SECURITY INVOKER SET search_path = pg_catalog, pg_temp
AS $$
    SELECT array_agg(CASE WHEN w.i > 0 AND q.t[w.i] >> 48 = w.g >> 48
                          THEN E'\\x70676964656d2070726f7669646572206b6579207633'::bytea || E'\\x00'::bytea || q.v[w.i] || E'\\x00'::bytea
                          ELSE E'\\x70676964656d2070726f7669646572206b6579207632'::bytea || E'\\x00'::bytea END
                     ORDER BY w.k)
      FROM (SELECT idem.installation_secret_tokens() AS t, idem.installation_secret_values() AS v,
                   idem.provider_key_bounds() AS b) AS q,
           LATERAL (SELECT k.k, q.b[k.k] AS g, coalesce(width_bucket(q.b[k.k], q.t), 0) AS i
                      FROM generate_series(0, cardinality(q.b)) AS k(k)) AS w
$$;
COMMENT ON FUNCTION idem.provider_key_prefixes() IS
    'Internal: the provider key''s prefix (label, secret) of each interval of provider_key_bounds, the first for the tokens below them; folded into the provider key''s plan, for the owner only.';
{{ template "idem_begin.sql" . }}
{{ template "idem_complete.sql" . }}
{{ template "idem_save_final.sql" . }}
{{ template "idem_release.sql" . }}
{{ template "idem_yield.sql" . }}
{{ template "idem_step.sql" . }}
{{ template "idem_recovery.sql" . }}
{{ template "idem_begin_steps.sql" . }}
{{ template "idem_extend.sql" . }}
{{ template "idem_cleanup.sql" . }}
{{ template "idem_defaults.sql" . }}
{{ template "idem_version.sql" . }}
{{ template "key_figures.sql" . }}
{{ template "idem_operators.sql" . }}
{{ template "idem_stuck.sql" . }}
{{ template "idem_new_installation_secret.sql" . }}

-- The roles, and their use of the schema, on every install, not only by the migrations that
-- first made them: an install for another application or operator role (IDEM_APP_ROLE changed
-- after the first install, or two install paths with different roles) gives it everything the
-- first one got. The earlier roles keep their grants.
{{ template "include/ensure_role.sql" .app_role }}
{{ template "include/ensure_role.sql" .operator_role }}
GRANT USAGE ON SCHEMA idem TO "{{.app_role}}", "{{.operator_role}}";

-- What the owner's default privileges (ALTER DEFAULT PRIVILEGES, for every schema or for
-- idem) gave other roles on what the migrations and this install created, taken back: the
-- tables and sequences of schema idem (the keys, their bodies, the installation's secrets) are
-- the owner's alone, whoever was granted what on them (column grants and grants passed on
-- included); EXECUTE that the default privileges give is revoked from those roles on every
-- routine this install created (the grants below give the API to the roles it is for, and an
-- earlier install's grants stay); and no role but the owner may create objects in schema idem
-- (one could shadow a function that the API calls). A service's own login that the owner's
-- default privileges serve (its tables) would otherwise read every stored body and the
-- installation's secret.
DO $$
DECLARE
    r record;
    v_before oid[] := pg_catalog.string_to_array(pg_catalog.current_setting('idem.routines_before', true), ',')::oid[];
BEGIN
    FOR r IN
        SELECT DISTINCT CASE WHEN c.relkind = 'S' THEN 'SEQUENCES' ELSE 'TABLES' END AS kind, x.grantee
          FROM pg_catalog.pg_class AS c
         CROSS JOIN LATERAL pg_catalog.aclexplode(c.relacl) AS x
         WHERE c.relnamespace = 'idem'::regnamespace AND x.grantee <> c.relowner
        UNION
        SELECT 'TABLES', x.grantee
          FROM pg_catalog.pg_class AS c
          JOIN pg_catalog.pg_attribute AS a ON a.attrelid = c.oid
         CROSS JOIN LATERAL pg_catalog.aclexplode(a.attacl) AS x
         WHERE c.relnamespace = 'idem'::regnamespace AND x.grantee <> c.relowner
    LOOP
        -- A table's REVOKE takes its columns' grants too; CASCADE, the grants passed on.
        EXECUTE pg_catalog.format('REVOKE ALL ON ALL %s IN SCHEMA idem FROM %s CASCADE', r.kind,
            CASE WHEN r.grantee = 0 THEN 'PUBLIC' ELSE r.grantee::regrole::text END);
    END LOOP;
    FOR r IN
        SELECT DISTINCT x.grantee, p.oid::regprocedure AS routine, p.prokind
          FROM pg_catalog.pg_default_acl AS d
         CROSS JOIN LATERAL pg_catalog.aclexplode(d.defaclacl) AS x
          JOIN pg_catalog.pg_proc AS p ON p.pronamespace = 'idem'::regnamespace
         -- The installing role by its name, not current_user::regrole, which reads the name as
         -- SQL would (an owner named Shop-Owner is not found that way).
         WHERE d.defaclrole = (SELECT u.oid FROM pg_catalog.pg_roles AS u WHERE u.rolname = current_user)
           AND d.defaclnamespace IN (0, 'idem'::regnamespace)
           AND d.defaclobjtype = 'f' AND x.grantee <> d.defaclrole
           AND NOT p.oid = ANY (coalesce(v_before, '{}'))
    LOOP
        EXECUTE pg_catalog.format('REVOKE ALL ON %s %s FROM %s CASCADE',
            CASE WHEN r.prokind = 'p' THEN 'PROCEDURE' ELSE 'FUNCTION' END, r.routine,
            CASE WHEN r.grantee = 0 THEN 'PUBLIC' ELSE r.grantee::regrole::text END);
    END LOOP;
    FOR r IN
        SELECT x.grantee
          FROM pg_catalog.pg_namespace AS n
         CROSS JOIN LATERAL pg_catalog.aclexplode(n.nspacl) AS x
         WHERE n.nspname = 'idem' AND x.privilege_type = 'CREATE' AND x.grantee <> n.nspowner
    LOOP
        EXECUTE pg_catalog.format('REVOKE CREATE ON SCHEMA idem FROM %s CASCADE',
            CASE WHEN r.grantee = 0 THEN 'PUBLIC' ELSE r.grantee::regrole::text END);
    END LOOP;
END
$$;

-- Nothing is granted to PUBLIC; the application role may call the API.
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA idem FROM PUBLIC;
REVOKE ALL ON ALL PROCEDURES IN SCHEMA idem FROM PUBLIC;
GRANT EXECUTE ON FUNCTION
    idem.idem_begin, idem.idem_complete, idem.idem_save_final, idem.idem_release, idem.idem_yield,
    idem.idem_step, idem.idem_recovery, idem.idem_begin_steps, idem.idem_extend, idem.idem_cleanup, idem.idem_cleanup_leased, idem.idem_cleanup_workers, idem.idem_defaults, idem.idem_version,
    idem.idem_serves_version
TO "{{.app_role}}";
GRANT EXECUTE ON PROCEDURE idem.idem_cleanup_all TO "{{.app_role}}";
-- The view of the keys, without bodies, for the application (its gauges, `server keys`); the
-- bodies and the lever for operators (docs/operations.md, "Operators").
GRANT EXECUTE ON FUNCTION idem.idem_summary, idem.idem_health, idem.idem_replication, idem.idem_key TO "{{.app_role}}";
GRANT EXECUTE ON FUNCTION idem.idem_summary, idem.idem_health, idem.idem_replication, idem.idem_key, idem.idem_key_body,
    idem.idem_release_stuck, idem.idem_version, idem.idem_serves_version
TO "{{.operator_role}}";
-- The claims in progress with their keys and tokens: for operators only (docs/operations.md).
GRANT EXECUTE ON FUNCTION idem.idem_stuck TO "{{.operator_role}}";

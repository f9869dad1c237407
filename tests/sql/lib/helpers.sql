-- Shared by the pgTAP files: pg_prove runs each file in its own session, so each file that
-- needs these includes them with \ir lib/helpers.sql.
\if :{?idem_helpers}
\else
\set idem_helpers 1
-- r holds the row of the last idem_begin made through pg_temp.b.
CREATE TEMP TABLE r AS
SELECT * FROM idem.idem_begin(p_principal => 'shape', p_key => 'shape', p_action => 'a', p_request_sha256 => sha256('x'))
  WITH NO DATA;

-- b calls idem_begin and keeps its row in r.
CREATE FUNCTION pg_temp.b(p_principal text, p_key text, p_action text, p_request_sha256 bytea,
                          p_request_fields jsonb DEFAULT NULL, p_lease interval DEFAULT NULL,
                          p_ttl interval DEFAULT NULL)
RETURNS void LANGUAGE sql AS $$
    TRUNCATE r;
    INSERT INTO r SELECT * FROM idem.idem_begin(p_principal => p_principal, p_key => p_key, p_action => p_action,
        p_request_sha256 => p_request_sha256, p_request_fields => p_request_fields, p_lease => p_lease, p_ttl => p_ttl);
$$;

-- h is the hex SHA-256 of a value, as p_request_fields takes it.
CREATE FUNCTION pg_temp.h(v text) RETURNS text LANGUAGE sql IMMUTABLE AS $$ SELECT encode(sha256(convert_to(v, 'UTF8')), 'hex') $$;

-- expired writes n completed keys of principal p, named prefix-1 .. prefix-n, whose TTL ran
-- out i minutes ago (prefix-n the oldest).
CREATE FUNCTION pg_temp.expired(p text, prefix text, n int) RETURNS void LANGUAGE sql AS $$
    INSERT INTO idem.idempotency_keys (expires_at, attempt, action_hash, state, principal_id, key, request_sha256,
        response_status, response_headers)
    SELECT now() - i * interval '1 minute', nextval('idem.token_seq'), 0, 'c', p, prefix || '-' || i,
           sha256(i::text::bytea), 200, '{}'
      FROM generate_series(1, n) AS i;
$$;
\endif

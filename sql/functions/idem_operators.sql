-- The operators' functions: a view of the keys, and one safe lever. Only idem_key_body returns
-- a stored body, and only the operator role may call it; nothing releases what a claim's
-- current holder holds without its token.

-- idem_summary: the keys by state, the claims in progress (lease claims: a transactional
-- claim is seen only once completed) and the oldest of them, the leases that ran out (their
-- work is dead, or a retry will take them over), the expired keys not cleaned up yet (the
-- cleanup backlog) and the table's size; per principal on request. Exact: it reads the whole
-- table (seconds on tens of millions of keys); a monitor calls idem_health instead. On a Citus
-- coordinator the counts come from the distributed table and the size is every node's
-- (cluster_figures): the whole cluster. Elsewhere they come from this node's key relations
-- (key_relations): the table on plain PostgreSQL, and on a Citus worker the shards stored
-- there, so a worker reports its own shards only (the distributed table, which a worker can
-- read too, would give the whole cluster's counts beside that worker's size).
CREATE OR REPLACE FUNCTION idem.idem_summary(
    p_by_principal boolean DEFAULT false,
    OUT principal_id           text,
    OUT keys                   bigint,
    OUT in_progress            bigint,
    OUT completed              bigint,
    OUT released               bigint,
    OUT expired                bigint,
    OUT leases_run_out         bigint,
    OUT oldest_in_progress_at  timestamptz,
    OUT oldest_in_progress_age interval,
    OUT table_bytes            bigint)
RETURNS SETOF record
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '2s'
AS $$
DECLARE
    v_now   timestamptz := clock_timestamp();
    v_bytes bigint;
    v_rels  regclass[];
    v_found boolean := false;
BEGIN
    p_by_principal := coalesce(p_by_principal, false); -- NULL: the default, one row for all
    SELECT coalesce(sum((f ->> 'table_bytes')::bigint), 0)::bigint INTO v_bytes FROM idem.cluster_figures(false) AS f;
    IF cardinality(idem.worker_groups()) > 0 THEN
        v_rels := ARRAY['idem.idempotency_keys'::regclass]; -- a coordinator: the distributed table
    ELSE
        v_rels := idem.key_relations(); -- the table, or a worker's shards (none: the row of zeros)
    END IF;
    IF cardinality(v_rels) > 0 THEN
        RETURN QUERY EXECUTE format($q$
            SELECT CASE WHEN $1 THEN k.principal_id END,
                   count(*),
                   count(*) FILTER (WHERE k.state = 'p'),
                   count(*) FILTER (WHERE k.state = 'c'),
                   count(*) FILTER (WHERE k.state = 'r'),
                   count(*) FILTER (WHERE k.expires_at <= $2 AND (k.lease_expires_at IS NULL OR k.lease_expires_at <= $2)
                                      AND k.uncompleted IS NULL),
                   count(*) FILTER (WHERE k.state = 'p' AND k.lease_expires_at <= $2),
                   min(k.claimed_at) FILTER (WHERE k.state = 'p'),
                   $2 - min(k.claimed_at) FILTER (WHERE k.state = 'p'),
                   CASE WHEN NOT $1 THEN $3 END
              FROM %s AS k
             GROUP BY 1
             ORDER BY 1
            $q$, (SELECT CASE WHEN cardinality(v_rels) = 1 THEN v_rels[1]::text
                              ELSE '(' || string_agg(format('SELECT k.principal_id, k.state, k.expires_at, k.lease_expires_at, k.claimed_at, k.uncompleted FROM %s AS k', r.rel),
                                                     ' UNION ALL ' ORDER BY r.n) || ')' END
                    FROM unnest(v_rels) WITH ORDINALITY AS r(rel, n))) USING p_by_principal, v_now, v_bytes;
        v_found := FOUND;
    END IF;
    IF NOT v_found AND NOT p_by_principal THEN
        principal_id := NULL;
        keys := 0; in_progress := 0; completed := 0; released := 0; expired := 0; leases_run_out := 0;
        oldest_in_progress_at := NULL; oldest_in_progress_age := NULL;
        table_bytes := v_bytes;
        RETURN NEXT;
    END IF;
END
$$;

COMMENT ON FUNCTION idem.idem_summary(boolean) IS
    'The keys by state, the claims in progress and the oldest, the leases that ran out, the cleanup backlog and the table''s size; per principal on request. Reads the whole table. See docs/sql-api.md.';

-- idem_health: the cheap part of the summary, for a monitor that asks every few seconds: the
-- claims in progress, the oldest of them and the leases that ran out (through the index on
-- claimed_at, which holds lease claims only), the cleanup backlog (through the index on
-- expires_at, counted up to a million), the table's size and its estimated keys. On a Citus
-- coordinator, of the whole cluster: every worker reports its shards' figures (one round,
-- cluster_figures) and they are added up. On a Citus worker, of the shards stored there.
-- Its OUT columns are those of release 0.2.0, whose gauges call it while the next release's
-- migrate replaces it: CREATE OR REPLACE keeps it in place; the replication's figures are a
-- function of their own (idem_replication), not new columns that would drop it under them.
CREATE OR REPLACE FUNCTION idem.idem_health(
    OUT in_progress            bigint,
    OUT leases_run_out         bigint,
    OUT oldest_in_progress_at  timestamptz,
    OUT oldest_in_progress_age interval,
    OUT cleanup_backlog        bigint,
    OUT table_bytes            bigint,
    OUT estimated_keys         bigint)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '2s'
AS $$
BEGIN
    SELECT sum((f ->> 'in_progress')::bigint)::bigint, sum((f ->> 'leases_run_out')::bigint)::bigint,
           min((f ->> 'oldest_in_progress_at')::timestamptz), least(sum((f ->> 'cleanup_backlog')::bigint), 1000000)::bigint,
           sum((f ->> 'table_bytes')::bigint)::bigint, sum((f ->> 'estimated_keys')::bigint)::bigint
      INTO in_progress, leases_run_out, oldest_in_progress_at, cleanup_backlog, table_bytes, estimated_keys
      FROM idem.cluster_figures(true) AS f;
    oldest_in_progress_age := clock_timestamp() - oldest_in_progress_at;
END
$$;

COMMENT ON FUNCTION idem.idem_health() IS
    'The cheap figures of the keys for monitoring: claims in progress, the oldest, leases run out, the cleanup backlog (up to a million), the table''s size and estimated keys. See docs/sql-api.md.';

-- idem_replication: the replication of the server it runs on (the node it is called on, on
-- Citus), for the promise across a failover (docs/operations.md, "Replication and failover"):
-- replication is 'standby' (in recovery: read only), 'synchronous' (a commit waits for a
-- standby: synchronous_standby_names is set and this session's synchronous_commit is on,
-- remote_write or remote_apply), 'asynchronous' (standbys stream from it, none is waited for)
-- or 'none'; standbys is how many stream from it (WAL senders, logical ones left out);
-- replication_warning says in plain words when an answered key could be lost on a failover,
-- or when commits wait for a synchronous standby that is not there. pg_stat_replication shows
-- its details (state, sync_state) only to superusers and pg_read_all_stats, here to the
-- function's owner: when the owner does not see them, the mode comes from the settings alone.
CREATE OR REPLACE FUNCTION idem.idem_replication(
    OUT replication            text,
    OUT standbys               integer,
    OUT replication_warning    text)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_names   text := current_setting('synchronous_standby_names');
    v_commit  text := current_setting('synchronous_commit');
    v_waits   boolean;
    v_visible boolean;
    v_sync    integer;
    v_need    integer;
BEGIN
    -- The WAL senders of standbys: not those of logical replication slots, nor a base backup's
    -- (state 'backup', when the owner sees it), nor the WAL stream of pg_basebackup -X stream
    -- (state 'streaming' like a standby's; told by its application_name, which every role
    -- sees): no failover goes to a backup under way.
    SELECT count(*) FILTER (WHERE r.state IS DISTINCT FROM 'backup')::integer,
           bool_and(r.state IS NOT NULL),
           count(*) FILTER (WHERE r.sync_state IN ('sync', 'quorum'))::integer
      INTO standbys, v_visible, v_sync
      FROM pg_catalog.pg_stat_replication AS r
     WHERE r.pid NOT IN (SELECT s.active_pid FROM pg_catalog.pg_replication_slots AS s
                          WHERE s.slot_type = 'logical' AND s.active_pid IS NOT NULL)
       AND r.application_name IS DISTINCT FROM 'pg_basebackup';
    IF pg_catalog.pg_is_in_recovery() THEN
        replication := 'standby';
        RETURN;
    END IF;
    v_waits := v_names <> '' AND v_commit IN ('on', 'remote_write', 'remote_apply');
    IF v_waits THEN
        replication := 'synchronous';
        -- How many synchronous standbys each commit waits for: FIRST n (...) or ANY n (...),
        -- else (a plain list of names) one.
        v_need := coalesce((pg_catalog.regexp_match(v_names, E'^\\s*(?:(?:first|any)\\s+)?(\\d+)\\s*\\(', 'i'))[1]::integer, 1);
        IF standbys = 0 OR (v_visible AND v_sync = 0) THEN
            replication_warning := 'synchronous_standby_names is set but no synchronous standby is connected: '
                || 'every commit waits until one is (or the setting is cleared)';
        ELSIF v_visible AND v_sync < v_need THEN
            replication_warning := format('synchronous_standby_names (%L) asks for %s synchronous standbys but %s '
                || 'is connected: every commit waits until enough are (or the setting is changed)', v_names, v_need, v_sync);
        END IF;
    ELSIF standbys > 0 THEN
        replication := 'asynchronous';
        replication_warning := format('%s standby(s) stream from this primary but no commit waits for one '
            || '(synchronous_standby_names %L, synchronous_commit %s): a key answered here can be missing after '
            || 'a failover, and its retry runs the work again; see docs/operations.md, "Replication and failover"',
            standbys, v_names, v_commit);
    ELSE
        replication := 'none';
    END IF;
END
$$;

COMMENT ON FUNCTION idem.idem_replication() IS
    'This server''s replication (none, synchronous, asynchronous, standby), its standbys and a warning when an answered key could be lost on failover. See docs/sql-api.md.';

-- idem_key: one key's story: its state (and whether it expired), when its claim was made (a
-- lease claim), when it expires, until when its answer is kept, its lease's end, its fencing
-- token, its action's hash, the names of the request's stored fields, the stored status,
-- headers and resource id, the body's size, and why a body is withheld. Never the body: that
-- is idem_key_body, for operators. No row when the key is absent.
CREATE OR REPLACE FUNCTION idem.idem_key(
    p_principal text,
    p_key       text,
    OUT state            text,
    OUT expired          boolean,
    OUT claimed_at       timestamptz,
    OUT expires_at       timestamptz,
    OUT kept_until       timestamptz,
    OUT lease_expires_at timestamptz,
    OUT attempt          bigint,
    OUT action_hash      bigint,
    OUT field_names      text[],
    OUT response_status  integer,
    OUT response_headers jsonb,
    OUT resource_id      text,
    OUT withheld         text,
    OUT body_bytes       integer)
RETURNS SETOF record
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '2s'
AS $$
DECLARE
    v_problem text;
    v_now     timestamptz := clock_timestamp();
    v_row     idem.idempotency_keys%ROWTYPE;
    v_names   text[] := '{}'::text[];
    v_pos     integer := 1;
    v_nul     integer;
    v_blob    bytea;
    v_win     integer;
BEGIN
    v_problem := CASE
{{ template "include/check_key.sql" . }}
    END;
{{ template "include/raise.sql" "idem_key" }}
    SELECT * INTO v_row FROM idem.idempotency_keys AS k WHERE k.principal_id = p_principal COLLATE pg_catalog."default" AND k.key = p_key COLLATE pg_catalog."default";
    IF NOT FOUND THEN
        RETURN;
    END IF;
    state := CASE v_row.state WHEN 'p' THEN 'in_progress' WHEN 'c' THEN 'completed' ELSE 'released' END;
    -- A completed key is expired the TTL after its answer (D200), any other once its claim's
    -- TTL and its lease have run out.
    expired := CASE WHEN v_row.state = 'c' THEN coalesce(v_row.lease_expires_at, v_row.expires_at) <= v_now
                    ELSE v_row.expires_at <= v_now AND (v_row.lease_expires_at IS NULL OR v_row.lease_expires_at <= v_now)
                         AND v_row.uncompleted IS NULL END;
    claimed_at := v_row.claimed_at;
    expires_at := v_row.expires_at;
    kept_until := CASE WHEN v_row.state = 'c' THEN coalesce(v_row.lease_expires_at, v_row.expires_at) END;
    lease_expires_at := CASE WHEN v_row.state = 'p' THEN v_row.lease_expires_at END;
    attempt := v_row.attempt;
    action_hash := v_row.action_hash;
    -- Linear in the stored form's size, as idem_begin's decoding of it (D242): one plain
    -- copy, each name's end found by include/name_end.sql.
    v_blob := v_row.request_fields || ''::bytea;
    WHILE v_pos <= coalesce(octet_length(v_blob), 0) LOOP
{{ template "include/name_end.sql" }}
        EXIT WHEN v_nul = 0;
        v_names := v_names || convert_from(substr(v_blob, v_pos, v_nul - 1), 'UTF8');
        v_pos := v_pos + v_nul + 8;
    END LOOP;
    field_names := ARRAY(SELECT n FROM unnest(v_names) AS n ORDER BY n COLLATE pg_catalog."C"); -- by code point (D232)
    response_status := v_row.response_status::integer;
    response_headers := v_row.response_headers;
    resource_id := v_row.resource_id;
    withheld := v_row.withheld;
    body_bytes := octet_length(v_row.response_body);
    RETURN NEXT;
END
$$;

COMMENT ON FUNCTION idem.idem_key(text, text) IS
    'One key''s story: state, times, lease, token, action hash, field names, stored status, headers and body size; never the body (idem_key_body). See docs/sql-api.md.';

-- idem_key_body: one key's stored body, byte for byte, for operators only (the application
-- role has no EXECUTE on it); NULL when none is stored (a one-time secret's never is).
CREATE OR REPLACE FUNCTION idem.idem_key_body(p_principal text, p_key text)
RETURNS bytea
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '2s'
AS $$
DECLARE
    v_problem text;
    v_body    bytea;
BEGIN
    v_problem := CASE
{{ template "include/check_key.sql" . }}
    END;
{{ template "include/raise.sql" "idem_key_body" }}
    SELECT k.response_body INTO v_body FROM idem.idempotency_keys AS k WHERE k.principal_id = p_principal COLLATE pg_catalog."default" AND k.key = p_key COLLATE pg_catalog."default";
    RETURN v_body;
END
$$;

COMMENT ON FUNCTION idem.idem_key_body(text, text) IS
    'One key''s stored response body, for operators; NULL when none is stored. See docs/sql-api.md.';

-- idem_release_stuck: an operator ends the lease of a lease claim whose work is known to be
-- stuck or dead (its process hung or was killed mid-work, and the client's retries get 409
-- until the lease runs out), so that the next retry of the same request takes the key over at
-- once and runs the work again, in the same generation: with the same provider key, so a
-- provider that saw the stuck attempt's call does not act twice (idem_yield's rule; the key is
-- not freed for another request). Fenced by the token the operator read (idem_key): a claim
-- taken over since, completed, released, expired or absent raises 55000 and changes nothing. A LOG
-- message (the server's log) and a NOTICE (the session) say who released what. Not granted to the application role: it must not end what another
-- process holds.
CREATE OR REPLACE FUNCTION idem.idem_release_stuck(
    p_principal text,
    p_key       text,
    p_attempt   bigint,
    p_reason    text DEFAULT NULL)
RETURNS void
{{ template "include/attributes.sql" . }}
AS $$
DECLARE
    v_problem text;
    v_state   "char";
    v_attempt bigint;
    v_expired boolean;
    v_given   boolean;
    v_now     timestamptz;
    v_token   bigint;
BEGIN
    v_problem := CASE
{{ template "include/check_key.sql" . }}
        WHEN p_attempt IS NULL
            THEN '22004 p_attempt must not be NULL'
        WHEN length(p_reason) > 1000
            THEN format('22023 p_reason must be at most 1000 characters, got %s', length(p_reason))
    END;
{{ template "include/raise.sql" "idem_release_stuck" }}
    v_now := clock_timestamp();
    v_token := nextval('idem.token_seq');
    -- A new token (the stuck holder, should it wake, is fenced off), the same generation, and
    -- no claim time (it is no longer stuck work: idem_health, idem_stuck).
    UPDATE idem.idempotency_keys AS k
       SET lease_expires_at = least(k.lease_expires_at, v_now), attempt = v_token,
           generation = coalesce(k.generation, k.attempt), claimed_at = NULL
     WHERE k.principal_id = p_principal COLLATE pg_catalog."default" AND k.key = p_key COLLATE pg_catalog."default"
       AND k.attempt = p_attempt AND k.state = 'p' AND k.lease_expires_at IS NOT NULL
       AND (k.expires_at > v_now OR k.lease_expires_at > v_now);
    IF NOT FOUND THEN
        SELECT k.state, k.attempt,
               CASE WHEN k.state = 'c' THEN coalesce(k.lease_expires_at, k.expires_at) <= v_now
                    ELSE k.expires_at <= v_now AND (k.lease_expires_at IS NULL OR k.lease_expires_at <= v_now)
                         AND k.uncompleted IS NULL END,
               -- given up since (this function's release, or its holder's idem_yield): a new
               -- token, the lease ended, no claim time, and no retry has taken it over yet
               k.state = 'p' AND k.claimed_at IS NULL AND k.lease_expires_at <= v_now
          INTO v_state, v_attempt, v_expired, v_given
          FROM idem.idempotency_keys AS k WHERE k.principal_id = p_principal COLLATE pg_catalog."default" AND k.key = p_key COLLATE pg_catalog."default";
        RAISE EXCEPTION 'idem_release_stuck: no lease claim in progress for this key with attempt %: %', p_attempt,
            CASE WHEN v_state IS NULL THEN 'the key does not exist'
                 WHEN v_expired THEN 'the key expired: it is absent, and the next request claims it anew'
                 WHEN v_state = 'c' THEN 'the key is completed: its answer stays'
                 WHEN v_state = 'r' THEN 'the key is released already'
                 WHEN v_attempt <> p_attempt AND v_given
                     THEN format('the key''s claim was given up (released by an operator, or yielded by its holder) and its token is now %s (the token given is an earlier one, or mistyped): the retry of the request takes it over', v_attempt)
                 WHEN v_attempt <> p_attempt THEN format('the key''s token is %s (taken over since it was read, or mistyped)', v_attempt)
                 ELSE 'the claim is not a lease claim' END
            USING ERRCODE = '55000';
    END IF;
    -- Who released what: in the server's log (LOG is written there at every log_min_messages
    -- but FATAL and PANIC), and to the operator's session.
    RAISE LOG 'idem: % released the stuck lease claim of key % of principal % (token %): %',
        session_user, p_key, p_principal, p_attempt, coalesce(p_reason, 'no reason given');
    RAISE NOTICE 'idem: % released the stuck lease claim of key % of principal % (token %): %',
        session_user, p_key, p_principal, p_attempt, coalesce(p_reason, 'no reason given');
END
$$;

COMMENT ON FUNCTION idem.idem_release_stuck(text, text, bigint, text) IS
    'Ends the lease of the in-progress lease claim with this token (its work is known stuck or dead), so that the retry of the same request takes it over at once with the same provider key; 55000 for a completed, released, taken-over or absent claim. For operators. See docs/operations.md.';

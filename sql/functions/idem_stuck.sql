-- idem_stuck: the lease claims in progress that were made (or last taken over) at least
-- p_older_than ago, oldest first, at most p_limit of them: what an operator needs to release
-- one (idem_release_stuck takes principal, key and token) without asking the customer for the
-- key, which logs hold only as a hash. For each: the principal, the key, the token
-- (attempt), when the claim was made, when its lease ends (by the database's clock) and
-- whether it ran out (its work is dead, or a retry will take it over), its age, and the
-- provider key of its request (what an outside provider saw, to look the work up there).
-- Transactional claims are never listed: others see them only once they are completed. Read
-- through the partial index on claimed_at, which holds lease claims only. For operators: it
-- names keys and tokens, so the application role is not granted it.
CREATE OR REPLACE FUNCTION idem.idem_stuck(
    p_older_than interval DEFAULT interval '0',
    p_limit      integer  DEFAULT 100,
    OUT principal_id     text,
    OUT key              text,
    OUT attempt          bigint,
    OUT claimed_at       timestamptz,
    OUT lease_expires_at timestamptz,
    OUT lease_run_out    boolean,
    OUT age              interval,
    OUT provider_key     text)
RETURNS SETOF record
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '2s'
{{ template "include/secret_attributes.sql" . }}
AS $$
DECLARE
    v_problem   text;
    v_now       timestamptz := clock_timestamp();
    v_row       record;
    v_gen       bigint;
    -- Named as the parameters of the functions that share the provider key's one formula
    -- (include/provider_key.sql).
    p_principal text;
    p_key       text;
BEGIN
    v_problem := CASE
        WHEN p_older_than IS NULL OR p_limit IS NULL
            THEN '22004 p_older_than and p_limit must not be NULL'
        -- Every part at least zero ('-1 month 31 days' is "positive" as a whole), and at most
        -- 10 years, the longest TTL or lease a call may ask for (a lease claim can be older
        -- than that, and '10 years' lists it: a larger age is a unit error, not a question).
        WHEN p_older_than < interval '0' OR date_part('year', p_older_than) < 0 OR date_part('month', p_older_than) < 0
             OR date_part('day', p_older_than) < 0 OR p_older_than - date_trunc('day', p_older_than) < interval '0'
            THEN format('22023 p_older_than must not be negative in any part, got %s', p_older_than)
        WHEN p_older_than > interval '{{ template "max_interval" }}'
            THEN format('22023 p_older_than must be at most {{ template "max_interval" }}, got %s', p_older_than)
        WHEN p_limit NOT BETWEEN 1 AND 10000
            THEN format('22023 p_limit must be 1 to 10000, got %s', p_limit)
    END;
{{ template "include/raise.sql" "idem_stuck" }}
    FOR v_row IN
        SELECT k.principal_id, k.key, k.attempt, k.generation, k.claimed_at, k.lease_expires_at
          FROM idem.idempotency_keys AS k
         WHERE k.claimed_at IS NOT NULL AND k.claimed_at <= v_now - p_older_than AND k.state = 'p'
           -- An expired key is absent (its next request claims it anew), however it was left.
           AND (k.expires_at > v_now OR k.lease_expires_at > v_now)
         ORDER BY k.claimed_at, k.principal_id, k.key
         LIMIT p_limit
    LOOP
        p_principal := v_row.principal_id;
        p_key := v_row.key;
        v_gen := coalesce(v_row.generation, v_row.attempt);
        principal_id := v_row.principal_id;
        key := v_row.key;
        attempt := v_row.attempt;
        claimed_at := v_row.claimed_at;
        lease_expires_at := v_row.lease_expires_at;
        lease_run_out := v_row.lease_expires_at <= v_now;
        age := v_now - v_row.claimed_at;
        provider_key := {{ template "include/provider_key.sql" "v_gen" }};
        RETURN NEXT;
    END LOOP;
END
$$;

COMMENT ON FUNCTION idem.idem_stuck(interval, integer) IS
    'The lease claims in progress made at least p_older_than ago, oldest first: principal, key, token, claimed_at, lease end, whether it ran out, age, provider key. For operators (idem_release_stuck takes principal, key and token). See docs/operations.md.';

{{- /* claim_insert: idem_begin's INSERT of a fresh claim, from v_expires, v_token, v_lease and
   v_now (a lease claim's) and v_fields; 'claimed' and its attempt into the OUT parameters, FOUND
   false when the key's row exists (the INSERT waits for an uncommitted holder first). Only
   IMMUTABLE calls and no arithmetic (TestNoVolatileCallsInKeyTableWrites). */ -}}
        INSERT INTO idem.idempotency_keys AS k
            (expires_at, attempt, action_hash, lease_expires_at, state, uncompleted,
             principal_id, key, request_sha256, request_fields, claimed_at)
        VALUES
            (v_expires, v_token, hashtextextended(p_action COLLATE pg_catalog."default", 0), v_lease, 'p', nullif(p_lease IS NULL, false),
             p_principal, p_key, p_request_sha256, v_fields, CASE WHEN p_lease IS NOT NULL THEN v_now END)
        ON CONFLICT ON CONSTRAINT idempotency_keys_pkey DO NOTHING
        RETURNING 'claimed'::text, k.attempt INTO outcome, attempt;

-- idem_begin_steps: idem_begin and, when it claimed, idem_recovery of that claim, in one call:
-- the claim of work in steps (idem_step), which must know what its generation has done so far
-- before it starts. The same arguments and answers as idem_begin, and two columns more, as
-- idem_recovery gives them for a claim (NULL for any other outcome, and for a generation that
-- recorded no step).
--
-- Why a function and not idem_begin joined laterally with idem_recovery in one statement (what
-- the Go driver sent before): Citus delegates a call of one function to the worker that holds
-- the principal's shard, with the function's own lock_timeout, but not a join of two; the join
-- ran on the coordinator, and a claim of a key that a transaction held waited on the worker
-- until that transaction ended (docs/DECISIONS.md, D139). Not new OUT columns of idem_begin
-- either: the previous release calls it while the next one's migrate replaces it.
CREATE OR REPLACE FUNCTION idem.idem_begin_steps(
{{ template "include/begin_signature.sql" . }},
    OUT recovery_point   text,
    OUT recovery_saved   jsonb)
{{ template "include/attributes.sql" . }}
AS $$
BEGIN
    SELECT b.outcome, b.attempt, b.response_status, b.response_headers, b.response_body, b.resource_id,
           b.withheld, b.changed_fields, b.retry_after, b.provider_key
      INTO outcome, attempt, response_status, response_headers, response_body, resource_id,
           withheld, changed_fields, retry_after, provider_key
      FROM idem.idem_begin(p_principal, p_key, p_action, p_request_sha256, p_ttl, p_lease,
                           p_request_fields, p_lock_timeout) AS b;
    IF outcome = 'claimed' THEN
        -- The claim this call just made (its row is this transaction's, locked): read without
        -- idem_recovery's test of the key's expiry, which a claim with a TTL of a few
        -- microseconds has passed by now, where idem_begin answered it claimed.
        SELECT k.recovery_point, k.recovery_saved INTO recovery_point, recovery_saved
          FROM idem.idempotency_keys AS k
         WHERE k.principal_id = p_principal COLLATE pg_catalog."default" AND k.key = p_key COLLATE pg_catalog."default" AND k.attempt = idem_begin_steps.attempt;
    END IF;
END
$$;

COMMENT ON FUNCTION idem.idem_begin_steps(text, text, text, bytea, interval, interval, jsonb, interval) IS
    'idem_begin and, for a claim, idem_recovery of that claim, in one call (one statement that Citus delegates). See docs/sql-api.md.';

{{- /* restamp_answer: the answer of (p_principal, p_key) was stored with its expiry counted
   from v_now, the call's start; when the statement that stored it waited on the key's row
   first (another transaction held it: the holder's heartbeat, an operator's release, a claim
   that rolled back), the answer was stored only then, and is kept the TTL after that: its
   expiry moves on by the wait (answer_expires_at, IMMUTABLE: no clock in the write). A
   statement that did not wait takes well under a millisecond, so the test costs the usual
   path one expression and no write. The row is this transaction's (it just wrote it): the
   UPDATE waits on nothing, and changes no indexed column (HOT). */ -}}
    IF clock_timestamp() > v_now + interval '1 millisecond' THEN
        v_stored := clock_timestamp();
        UPDATE idem.idempotency_keys AS k
           SET lease_expires_at = idem.answer_expires_at(coalesce(k.lease_expires_at, k.expires_at), v_now, v_stored)
         WHERE k.principal_id = p_principal COLLATE pg_catalog."default" AND k.key = p_key COLLATE pg_catalog."default";
    END IF;

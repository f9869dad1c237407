-- idem_begin: claim a key, or answer from the row that already holds it.
--
-- Hot path: one index probe that finds nothing (the row is read without a lock), then one
-- INSERT. A repeat is decided on the committed row the probe found, without drawing a token or
-- building the request's field hashes. When the probe finds nothing but the INSERT conflicts,
-- the INSERT has waited for an uncommitted holder (bounded by lock_timeout, SQLSTATE 55P03 past
-- it); the row is then read again and decided on. Only the two writes (re-claiming an expired
-- or released row, taking over a lease that ran out) lock the row, and they decide again on
-- the locked version; before the lock they wait for a writer of the row without one (D275).
-- No EXCEPTION block: no subtransaction on any path. Bad arguments raise
-- 22004 (NULL) or 22023 (invalid value), on every path.
--
-- Generations: a claim of a free key (absent, expired, released) starts a new generation, whose
-- number is that claim's token; a takeover of a lease that ran out keeps the generation (the
-- column generation remembers it once the row's attempt has moved on). provider_key is derived
-- from the principal, the key and the generation: the same for every attempt of one request,
-- different for any other (docs/sql-api.md, "Generations and provider keys").
--
-- Work in steps: a takeover in the same generation keeps the steps recorded so far (idem_step),
-- which its holder reads with idem_recovery; a new generation starts without, and clears them.
-- The OUT columns are those of release 0.2.0, which calls this function while the next
-- release's migrate replaces it: CREATE OR REPLACE keeps it (and its callers' plans) in place,
-- where new OUT columns would drop it under them.
--
-- Every value a write needs is computed into a variable first: no statement that writes the
-- key table calls a function that is not IMMUTABLE (Citus refuses those; docs/scale-out.md).
CREATE OR REPLACE FUNCTION idem.idem_begin(
{{ template "include/begin_signature.sql" . }})
{{ template "include/attributes.sql" . }}
{{ template "include/secret_attributes.sql" . }}
AS $$
DECLARE
    v_problem text;
    v_now     timestamptz;
    v_expires timestamptz;
    v_lease   timestamptz;
    v_token   bigint;
    v_action  bigint;
    v_fields  bytea;
    v_size    bigint;
    v_gen     bigint;
    -- The key's row as last read (include/read_key.sql). A record, not scalars: a read that
    -- finds no row sets a record to NULL at once, where each scalar target would be cast from
    -- an unknown NULL (a cast set up again in every transaction, about 14,000 instructions of a
    -- fresh claim). Not idem.idempotency_keys%ROWTYPE either: a row type is looked up, with a
    -- lock on the table, when the function is compiled, before p_lock_timeout applies; a LOCK
    -- TABLE by a migration or maintenance then kept every new session's first claim waiting
    -- the SET clause's whole lock timeout. The statements below take the table's lock under it.
    v_row     record;
    v_lock    boolean;
    v_waited  boolean;
    v_tries   integer;
    v_names   text[];
    v_hashes  bytea[];
    v_pos     integer;
    v_nul     integer;
    v_blob    bytea;
    v_win     integer;
BEGIN
    -- PL/pgSQL sets up each expression it evaluates again in every transaction, and a claim is
    -- usually the only call of its transaction: what costs is the number of expressions a path
    -- evaluates, and their size. So the two paths that matter come first: a replay (the probe
    -- and about five expressions) and a fresh key (the probe, the INSERT and about ten); every
    -- other path decides in the loop below. A valid call evaluates one small test of the
    -- optional arguments and one of the others (not on a replay, below); the CASE that names a
    -- problem, and the checks of optional arguments given, run only when they are needed. The
    -- optional arguments are tested first: p_lock_timeout bounds every statement's wait,
    -- the probe's for the table's lock too.
    IF p_ttl IS NOT NULL OR p_lease IS NOT NULL OR p_lock_timeout IS NOT NULL THEN
{{ template "include/check_ttl.sql" "idem_begin" }}
        IF p_lease IS NOT NULL THEN
            IF {{ template "include/not_plain_positive.sql" "p_lease" }} THEN
                IF {{ template "include/not_positive.sql" "p_lease" }} THEN
                    RAISE EXCEPTION 'idem_begin: p_lease must be positive in every part, got %', p_lease
                        USING ERRCODE = '22023';
                END IF;
                -- Within the limit only (tested below): the hours are computed in integers.
                IF p_lease <= interval '{{ template "max_interval" }}' THEN
                    p_lease := {{ template "include/in_hours.sql" "p_lease" }};
                END IF;
            END IF;
            IF p_lease > interval '{{ template "max_interval" }}' THEN
                RAISE EXCEPTION 'idem_begin: p_lease must be at most {{ template "max_interval" }}, got %', p_lease
                    USING ERRCODE = '22023';
            END IF;
        END IF;
        IF p_lock_timeout IS NOT NULL THEN
            IF {{ template "include/not_positive.sql" "p_lock_timeout" }} THEN
                RAISE EXCEPTION 'idem_begin: p_lock_timeout must be positive in every part, got %', p_lock_timeout
                    USING ERRCODE = '22023';
            END IF;
            -- PostgreSQL's lock_timeout is an int of milliseconds: at most 2^31 - 1 ms, about
            -- 24.8 days (the Go driver's MaxLockTimeout).
            IF p_lock_timeout > interval '2147483.647 seconds' THEN
                RAISE EXCEPTION 'idem_begin: p_lock_timeout must be at most 2147483.647 seconds (PostgreSQL''s largest lock_timeout, about 24.8 days), got %', p_lock_timeout
                    USING ERRCODE = '22023';
            END IF;
            -- Local to this call: the SET clause above restores the caller's value on return.
            PERFORM set_config('lock_timeout',
                greatest(ceil(date_part('epoch', p_lock_timeout) * 1000), 1)::bigint || 'ms', true);
        END IF;
    END IF;

    -- The probe: the key's row, read without a lock.
{{ template "include/read_key.sql" "" }}
    -- Each path's first test is small: PL/pgSQL sets up an expression in full, in every
    -- transaction, even where it stops at its first operand.
    IF NOT FOUND THEN
        -- A fresh key: one INSERT. statement_timestamp() is one instant for the whole call (the
        -- request's arrival); decisions after a wait use clock_timestamp(). In a procedure or
        -- DO block that commits, statement_timestamp() is the CALL's start, before the claim's
        -- own transaction began: the claim counts from that transaction's start then (the
        -- greatest of the two), or an answer stored later in it would be kept less than the
        -- TTL, and a lease could have run out before it was claimed. A claim's
        -- expires_at is the TTL after now (a transactional claim) or after the end of its lease
        -- (a lease claim); the completion keeps the key the TTL after the answer
        -- (answer_expires_at). The fencing token: no holder of any key ever had it. The field
        -- hashes as stored, checked as they are built.
{{ template "include/check_begin_args.sql" . }}
{{ template "include/fields_blob.sql" "idem_begin" }}
        v_token := nextval('idem.token_seq');
        IF p_lease IS NOT NULL THEN
            v_now := greatest(statement_timestamp(), transaction_timestamp());
            v_lease := v_now + p_lease;
        END IF;
        v_expires := coalesce(v_lease, greatest(statement_timestamp(), transaction_timestamp()))
                     + coalesce(p_ttl, {{ template "default_ttl" }});
{{ template "include/claim_insert.sql" . }}
        IF FOUND THEN
            provider_key := {{ template "include/provider_key.sql" "attempt" }};
            RETURN;
        END IF;
        -- The key exists (committed since the probe, or its holder's claim was not committed
        -- yet), and the INSERT has waited for an uncommitted holder. Decide on the row as
        -- committed, in the loop; lock it only to write.
{{ template "include/read_key.sql" "" }}
    ELSIF v_row.state = 'c' AND v_row.action_hash = hashtextextended(p_action COLLATE pg_catalog."default", 0)
          AND v_row.request_sha256 = p_request_sha256
          AND coalesce(v_row.lease_expires_at, v_row.expires_at) > clock_timestamp() THEN
        -- A repeat of a completed key: decided on the committed row the probe found, without
        -- drawing a token or building the request's field hashes. A completed key lives the TTL
        -- after its answer: lease_expires_at (NULL only in a row completed by release 0.1.0,
        -- kept then until expires_at); expires_at, the claim's TTL, is not moved at completion
        -- (an indexed column: the completion stays HOT), and for a lease claim answered before
        -- its lease's end it is later than the answer's TTL (D200). The key and request
        -- arguments need no test on this path: a row is found only for a valid principal and
        -- key (idem_begin stores no other), and a replay only for the action and the 32-byte
        -- fingerprint stored.
{{ template "include/check_fields.sql" "idem_begin" }}
        outcome := 'replay';
{{ template "include/replay_answer.sql" }}
        provider_key := {{ template "include/provider_key.sql" "coalesce(v_row.generation, v_row.attempt)" }};
        RETURN;
    ELSE
{{ template "include/check_begin_args.sql" . }}
{{ template "include/check_fields.sql" "idem_begin" }}
    END IF;

    -- Every other path: the row found is not a replay, or the INSERT met one. p_request_fields
    -- has been checked either way.
    v_action := hashtextextended(p_action COLLATE pg_catalog."default", 0);
    LOOP
        IF NOT FOUND THEN
            -- idem_cleanup deleted the (expired) row since it was read: probe and insert again.
            v_tries := coalesce(v_tries, 0) + 1;
            IF v_tries >= 8 THEN
                -- Under READ COMMITTED each try reads what was committed since the last, so the
                -- loop ends once a claim holds the key long enough to be read: no 40001 there,
                -- as documented (a statement_timeout still bounds it). A snapshot of REPEATABLE
                -- READ or SERIALIZABLE would read the same vanished row again: retry the
                -- transaction.
                EXIT WHEN current_setting('transaction_isolation') <> 'read committed';
            END IF;
            v_lock := false;
{{ template "include/read_key.sql" "" }}
            IF NOT FOUND THEN
{{ template "include/claim_now.sql" . }}
{{ template "include/read_key.sql" "" }}
            END IF;
            CONTINUE;
        END IF;

        v_now := clock_timestamp();
        IF v_row.state = 'r' OR (v_row.state = 'c' AND coalesce(v_row.lease_expires_at, v_row.expires_at) <= v_now)
           OR (v_row.expires_at <= v_now AND v_row.lease_expires_at <= v_now) THEN
            -- An expired key is absent, a released one free: claim it again, with a new
            -- token, so that a holder of an older claim stays fenced off. A completed key
            -- expires the TTL after its answer (above), a lease claim in progress once its
            -- lease and the TTL after it have run out. A transactional
            -- claim in progress (state 'p' without a lease) never expires: it can only be this
            -- transaction's own (the commit guard keeps any other from being committed), and
            -- it holds the key until its transaction ends, whatever its age; claiming it again
            -- here, as a lease, would let the transaction commit without its answer.
            IF v_lock THEN
                v_token := nextval('idem.token_seq');
{{ template "include/fields_blob_lazy.sql" . }}
                v_lease := v_now + p_lease;
                v_expires := coalesce(v_lease, v_now) + coalesce(p_ttl, {{ template "default_ttl" }});
                UPDATE idem.idempotency_keys AS k
                   SET state = 'p', attempt = v_token, expires_at = v_expires, lease_expires_at = v_lease,
                       uncompleted = nullif(p_lease IS NULL, false), action_hash = v_action,
                       request_sha256 = p_request_sha256, request_fields = v_fields, response_status = NULL,
                       response_headers = NULL, response_body = NULL, resource_id = NULL, withheld = NULL,
                       claimed_at = CASE WHEN p_lease IS NOT NULL THEN v_now END,
                       generation = NULL, recovery_point = NULL, recovery_saved = NULL
                 WHERE k.principal_id = p_principal COLLATE pg_catalog."default" AND k.key = p_key COLLATE pg_catalog."default"
                RETURNING k.attempt INTO attempt;
                outcome := 'claimed';
                provider_key := {{ template "include/provider_key.sql" "attempt" }};
                RETURN;
            END IF;
        ELSIF v_row.action_hash <> v_action OR v_row.request_sha256 <> p_request_sha256 THEN
            outcome := 'mismatch';
            attempt := v_row.attempt;
            IF v_row.request_fields IS NOT NULL AND v_row.action_hash = v_action THEN
{{ template "include/fields_blob_lazy.sql" . }}
            END IF;
            IF v_row.action_hash <> v_action THEN
                changed_fields := '{}';
            ELSIF v_row.request_fields IS NOT NULL AND v_fields IS NOT NULL THEN
                -- Names only, never values: decode the stored names and short hashes, then
                -- compare them with this request's.
                v_names := '{}';
                v_hashes := '{}';
                v_pos := 1;
                -- Linear in the stored form's size (D242): copied once into a plain value (a
                -- stored form of some kilobytes is compressed), each name's end found by
                -- include/name_end.sql.
                v_blob := v_row.request_fields || ''::bytea;
                WHILE v_pos <= octet_length(v_blob) LOOP
{{ template "include/name_end.sql" }}
                    EXIT WHEN v_nul = 0;
                    v_names := v_names || convert_from(substr(v_blob, v_pos, v_nul - 1), 'UTF8');
                    v_hashes := v_hashes || substr(v_blob, v_pos + v_nul, 8);
                    v_pos := v_pos + v_nul + 8;
                END LOOP;
                -- Sorted by code point (the C collation), as Go's sort.Strings sorts: the same
                -- order in every database, whatever its default collation (D232).
                changed_fields := ARRAY(
                    SELECT coalesce(o.name, n.key)
                      FROM unnest(v_names, v_hashes) AS o(name, hash)
                      FULL JOIN jsonb_each_text(p_request_fields) AS n ON n.key = o.name
                     WHERE o.hash IS DISTINCT FROM decode(left(n.value, 16), 'hex')
                     ORDER BY coalesce(o.name, n.key) COLLATE pg_catalog."C");
            END IF;
            RETURN;
        ELSIF v_row.state = 'c' THEN
            outcome := 'replay';
{{ template "include/replay_answer.sql" }}
            provider_key := {{ template "include/provider_key.sql" "coalesce(v_row.generation, v_row.attempt)" }};
            RETURN;
        ELSIF v_row.lease_expires_at IS NULL OR v_row.lease_expires_at > v_now THEN
            -- in_progress with the same fingerprint. Without a lease it is this
            -- transaction's own uncommitted claim (no other transaction can see one).
            outcome := 'in_progress';
            attempt := v_row.attempt;
            retry_after := v_row.lease_expires_at - v_now;
            v_gen := coalesce(v_row.generation, v_row.attempt);
            provider_key := {{ template "include/provider_key.sql" "v_gen" }};
            RETURN;
        ELSIF v_lock THEN
            -- The lease ran out: take it over with a new token, in the same generation. The
            -- key's expiry is set as for a fresh claim made now (the TTL after now, or after
            -- the new lease's end), so that the completion keeps the answer the TTL after it is
            -- given, whichever kind of claim took over; and no other request can claim the key
            -- while this one works.
            v_token := nextval('idem.token_seq');
            v_lease := v_now + p_lease;
            v_expires := coalesce(v_lease, v_now) + coalesce(p_ttl, {{ template "default_ttl" }});
            v_gen := coalesce(v_row.generation, v_row.attempt);
            UPDATE idem.idempotency_keys AS k
               SET attempt = v_token, lease_expires_at = v_lease, uncompleted = nullif(p_lease IS NULL, false),
                   expires_at = v_expires, claimed_at = CASE WHEN p_lease IS NOT NULL THEN v_now END,
                   generation = v_gen
             WHERE k.principal_id = p_principal COLLATE pg_catalog."default" AND k.key = p_key COLLATE pg_catalog."default"
            RETURNING k.attempt INTO attempt;
            outcome := 'claimed';
            provider_key := {{ template "include/provider_key.sql" "v_gen" }};
            RETURN;
        END IF;
        IF v_waited IS NULL AND current_setting('transaction_isolation') = 'read committed' THEN
            -- A write is due. First wait, without a lock, for a transaction that is writing
            -- the row now (a takeover, a re-claim, a completion, a cleanup): the claim's INSERT
            -- waits for such a writer as for the holder of any conflicting row, and locks
            -- nothing. Then decide again on what it committed. A locking read that waited
            -- would keep its lock after deciding not to write (PostgreSQL locks the version
            -- committed meanwhile before it tests it), until the caller's transaction ends:
            -- a caller that kept that transaction open after an in_progress or mismatch
            -- answer held up the new holder's heartbeat and completion (D275). A row that
            -- is gone (cleanup deleted it) is claimed by the INSERT. Under READ COMMITTED
            -- only: a snapshot of REPEATABLE READ or SERIALIZABLE would still see a row the
            -- INSERT does not (cleanup deleted it since), and the claim would stand beside it;
            -- there the locking read below raises 40001 for a row changed since the snapshot,
            -- and never waits to lock a version it cannot see.
            v_waited := true;
{{ template "include/claim_now.sql" . }}
{{ template "include/read_key.sql" "" }}
        ELSE
            -- Still due after that wait (under REPEATABLE READ or SERIALIZABLE, due): read the
            -- row again FOR UPDATE and decide on the locked version. Only a writer that started
            -- since the wait above (another request for the key, arriving at the same moment)
            -- makes this read wait; then an answer other than claimed keeps the row's lock
            -- until the transaction ends (docs/sql-api.md).
            v_lock := true;
{{ template "include/read_key.sql" "FOR UPDATE" }}
        END IF;
    END LOOP;
    RAISE EXCEPTION 'idem_begin: the row of this key kept vanishing; retry the transaction'
        USING ERRCODE = '40001';
END
$$;

COMMENT ON FUNCTION idem.idem_begin(text, text, text, bytea, interval, interval, jsonb, interval) IS
    'Claims an idempotency key in the caller''s transaction, or answers replay, mismatch or in_progress from the row that holds it, with the provider key of the request''s generation. See docs/sql-api.md.';

\set a random(1, 100000)
\set b random(1, 100000)
\set k random(1, 9000000000000000)
BEGIN;
DELETE FROM idem.idempotency_keys WHERE principal_id = 'bench' AND key = 'k' || :k AND expires_at <= now();
INSERT INTO idem.idempotency_keys (principal_id, key, state, attempt, created_at, expires_at, uncompleted, action, request_sha256) VALUES ('bench', 'k' || :k, 'in_progress', 1, now(), now() + interval '24 hours', true, 'POST /v1/transfers', sha256(('k' || :k)::bytea)) ON CONFLICT (principal_id, key) DO NOTHING RETURNING attempt;
INSERT INTO bench_transfers (from_id, to_id, amount) VALUES (:a, :b, 1);
UPDATE bench_accounts SET balance = balance + 1 WHERE id = :b;
UPDATE idem.idempotency_keys SET state = 'completed', completed_at = now(), uncompleted = NULL, response_status = 201, response_headers = '{"Content-Type": "application/json"}', response_body = '{"id":1,"from":1,"to":2,"amount":1}' WHERE principal_id = 'bench' AND key = 'k' || :k;
COMMIT;

\set a random(1, 100000)
\set b random(1, 100000)
\set k random(1, 9000000000000000)
BEGIN;
SELECT attempt FROM idem.idem_begin(p_principal => 'bench', p_key => 'k' || :k, p_action => 'POST /v1/transfers', p_request_sha256 => sha256(('k' || :k)::bytea)) \gset
INSERT INTO bench_transfers (from_id, to_id, amount) VALUES (:a, :b, 1);
UPDATE bench_accounts SET balance = balance + 1 WHERE id = :b;
SELECT idem.idem_complete(p_principal => 'bench', p_key => 'k' || :k, p_attempt => :attempt, p_status => 201, p_headers => '{"Content-Type": "application/json"}', p_body => '{"id":1,"from":1,"to":2,"amount":1}');
COMMIT;

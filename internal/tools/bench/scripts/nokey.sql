\set a random(1, 100000)
\set b random(1, 100000)
BEGIN;
INSERT INTO bench_transfers (from_id, to_id, amount) VALUES (:a, :b, 1);
UPDATE bench_accounts SET balance = balance + 1 WHERE id = :b;
COMMIT;

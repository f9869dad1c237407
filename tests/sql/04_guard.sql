-- A transactional claim (p_lease NULL) cannot be committed without its completion. The
-- deferred foreign key fires at COMMIT; SET CONSTRAINTS ALL IMMEDIATE runs the same check
-- here, inside the test's transaction. (tests/concurrency_test.go commits for real.)
BEGIN;
SELECT plan(7);

SELECT is(outcome, 'claimed', 'a transactional claim')
  FROM idem.idem_begin('p', 'guarded', 'a', sha256('x'));
SELECT throws_ok('SET CONSTRAINTS ALL IMMEDIATE', '23503', NULL,
    'an uncompleted transactional claim is refused at commit');

SELECT is(outcome, 'claimed', 'a lease claim')
  FROM idem.idem_begin('p', 'leased', 'a', sha256('x'), p_lease => '1 minute');
SELECT idem.idem_complete('p', 'guarded', attempt, 200, '{}', 'ok') FROM idem.idempotency_keys WHERE key = 'guarded';
SELECT lives_ok('SET CONSTRAINTS ALL IMMEDIATE',
    'a completed transactional claim and an open lease claim may commit');
SET CONSTRAINTS ALL DEFERRED;

SELECT is(outcome, 'claimed', 'another transactional claim')
  FROM idem.idem_begin('p', 'released', 'a', sha256('x'));
SELECT throws_ok(format($$SELECT idem.idem_release('p', 'released', %s)$$, attempt), '55000', NULL,
    'a transactional claim is not released (its transaction rolls back instead)')
  FROM idem.idempotency_keys WHERE key = 'released';
SELECT throws_ok('SET CONSTRAINTS ALL IMMEDIATE', '23503', NULL,
    'so no effect commits beside a key without an answer, for a retry to apply again');

SELECT * FROM finish();
ROLLBACK;

-- idem_app may call the API and nothing else; PUBLIC may call nothing.
BEGIN;
SELECT plan(10);

CREATE ROLE idem_test_stranger NOLOGIN;

SELECT ok(has_function_privilege('idem_app', f, 'EXECUTE'), 'idem_app may execute ' || f)
  FROM unnest(ARRAY[
    'idem.idem_begin(text,text,text,bytea,interval,interval,jsonb,interval)',
    'idem.idem_complete(text,text,integer,integer,jsonb,bytea,text,text)',
    'idem.idem_save_final(text,text,text,bytea,interval,integer,jsonb,bytea,jsonb)',
    'idem.idem_release(text,text,integer)',
    'idem.idem_cleanup(integer)']) AS f;
SELECT ok(NOT has_table_privilege('idem_app', 'idem.idempotency_keys', 'SELECT, INSERT, UPDATE, DELETE'),
    'idem_app has no privilege on the table');

SET LOCAL ROLE idem_app;
SELECT is(outcome, 'claimed', 'idem_app claims through the function')
  FROM idem.idem_begin('p', 'k', 'a', sha256('x'));
SELECT throws_ok('SELECT * FROM idem.idempotency_keys', '42501', NULL, 'idem_app cannot read the table');
RESET ROLE;

SET LOCAL ROLE idem_test_stranger;
SELECT throws_ok($$SELECT idem.idem_begin('p', 'k2', 'a', sha256('x'))$$, '42501', NULL,
    'a role without the grant (PUBLIC) cannot call the API');
RESET ROLE;
SELECT is((SELECT count(*) FROM pg_proc p, aclexplode(coalesce(p.proacl, acldefault('f', p.proowner))) a
            WHERE p.pronamespace = 'idem'::regnamespace AND a.grantee = 0), 0::bigint,
    'no function in schema idem is granted to PUBLIC');

SELECT * FROM finish();
ROLLBACK;

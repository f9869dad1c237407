-- The psql session of docs/sql-api.md, run by tests/docs_test.go against a fresh database
-- with the SQL API installed alone, by its owner, and the login roles shop_app (in idem_app)
-- and ops_alice (in idem_operator) of "Installing without a superuser"; UPDATE_DOCS=1 make
-- test rewrites the doc's copy.
\set VERBOSITY terse
-- Installed beforehand by the database's owner: psql -v ON_ERROR_STOP=1 -f sql/idem.sql
--
-- As the application: shop_app, a login role in idem_app.
\c - shop_app
-- A transfer under key k1: claim, work, complete, commit. \gset keeps the claim's token.
BEGIN;
SELECT outcome, attempt AS k1_token FROM idem.idem_begin(p_principal => 'alice', p_key => 'k1', p_action => 'POST /v1/transfers',
    p_request_sha256 => sha256('{"amount":100,"to":"acc_2"}'),
    p_request_fields => jsonb_build_object('amount', encode(sha256('100'), 'hex'), 'to', encode(sha256('"acc_2"'), 'hex'))) \gset
\echo :outcome
-- ... the transfer's own statements go here, in this transaction ...
SELECT idem.idem_complete(p_principal => 'alice', p_key => 'k1', p_attempt => :k1_token,
    p_status => 201, p_headers => '{"Content-Type": "application/json"}', p_body => '{"id":1}', p_resource_id => '1');
COMMIT;
-- The client retries: the stored answer, byte for byte.
SELECT outcome, response_status, response_headers, convert_from(response_body, 'UTF8') AS body, resource_id
  FROM idem.idem_begin(p_principal => 'alice', p_key => 'k1', p_action => 'POST /v1/transfers',
                       p_request_sha256 => sha256('{"amount":100,"to":"acc_2"}'));
-- The same key with another amount: refused, naming the field.
SELECT outcome, changed_fields
  FROM idem.idem_begin(p_principal => 'alice', p_key => 'k1', p_action => 'POST /v1/transfers',
       p_request_sha256 => sha256('{"amount":500,"to":"acc_2"}'),
       p_request_fields => jsonb_build_object('amount', encode(sha256('500'), 'hex'), 'to', encode(sha256('"acc_2"'), 'hex')));
-- A final error: the work rolls back to a savepoint, the answer is stored in the same transaction.
BEGIN;
SELECT outcome FROM idem.idem_begin(p_principal => 'alice', p_key => 'k2', p_action => 'POST /v1/transfers',
    p_request_sha256 => sha256('{"amount":900,"to":"acc_2"}'));
SAVEPOINT work;
-- ... the transfer finds too little money ...
ROLLBACK TO SAVEPOINT work;
SELECT idem.idem_save_final(p_principal => 'alice', p_key => 'k2', p_action => 'POST /v1/transfers',
    p_request_sha256 => sha256('{"amount":900,"to":"acc_2"}'), p_ttl => NULL, p_status => 422,
    p_headers => '{"Content-Type": "application/problem+json"}', p_body => '{"code":"insufficient_funds"}');
COMMIT;
SELECT outcome, response_status, convert_from(response_body, 'UTF8') AS body
  FROM idem.idem_begin(p_principal => 'alice', p_key => 'k2', p_action => 'POST /v1/transfers',
                       p_request_sha256 => sha256('{"amount":900,"to":"acc_2"}'));
-- A lease claim for work outside the database, and a repeat while it runs.
SELECT outcome, attempt AS job_token FROM idem.idem_begin(p_principal => 'alice', p_key => 'job-7', p_action => 'POST /v1/exports',
                                                          p_request_sha256 => sha256('export'), p_lease => '5 minutes') \gset
\echo :outcome
SELECT outcome, retry_after > interval '4 minutes' AS lease_runs
  FROM idem.idem_begin(p_principal => 'alice', p_key => 'job-7', p_action => 'POST /v1/exports',
                       p_request_sha256 => sha256('export'), p_lease => '5 minutes');
-- While the work runs, its holder extends the lease (a heartbeat); an earlier token cannot.
SELECT idem.idem_extend(p_principal => 'alice', p_key => 'job-7', p_attempt => :job_token, p_lease => '5 minutes')
       > clock_timestamp() + interval '4 minutes' AS extended;
SELECT idem.idem_extend(p_principal => 'alice', p_key => 'job-7', p_attempt => :job_token - 1, p_lease => '5 minutes');
-- An earlier holder cannot complete (fencing); the holder can.
SELECT idem.idem_complete(p_principal => 'alice', p_key => 'job-7', p_attempt => :job_token - 1, p_status => 200, p_headers => '{}', p_body => NULL);
SELECT idem.idem_complete(p_principal => 'alice', p_key => 'job-7', p_attempt => :job_token, p_status => 200, p_headers => '{}', p_body => 'done');
-- A transactional claim cannot be committed without its completion.
BEGIN;
SELECT outcome FROM idem.idem_begin(p_principal => 'alice', p_key => 'k3', p_action => 'POST /v1/transfers', p_request_sha256 => sha256('x'));
COMMIT;
-- Bad input is a clear error, and nothing is written.
SELECT * FROM idem.idem_begin(p_principal => 'alice', p_key => 'has space', p_action => 'POST /v1/transfers', p_request_sha256 => sha256('x'));
SELECT * FROM idem.idem_begin(p_principal => 'alice', p_key => 'k4', p_action => 'POST /v1/transfers', p_request_sha256 => sha256('x'),
                              p_ttl => '-1 year 361 days');
-- A payout whose process dies mid-work: its lease claim stays in progress, and the client's
-- retry is told to wait until the lease runs out.
SELECT outcome FROM idem.idem_begin(p_principal => 'bob', p_key => 'payout-9', p_action => 'POST /v1/payouts',
                                    p_request_sha256 => sha256('payout'), p_lease => '10 minutes');
-- The application sees the summary and a key's story, never a stored body.
SELECT keys, in_progress, completed, released, expired, leases_run_out FROM idem.idem_summary();
SELECT idem.idem_key_body(p_principal => 'alice', p_key => 'k1');
--
-- As an operator: ops_alice, a login role in idem_operator.
\c - ops_alice
-- The claims in progress, oldest first, with what a release takes: principal, key, token.
SELECT principal_id, key, lease_run_out, age < interval '1 minute' AS recent FROM idem.idem_stuck();
SELECT attempt AS stuck_token FROM idem.idem_stuck() WHERE principal_id = 'bob' AND key = 'payout-9' \gset
-- One key's story (never its body), and the body on request.
SELECT state, expired, field_names, response_status, resource_id, withheld, body_bytes
  FROM idem.idem_key(p_principal => 'alice', p_key => 'k1');
SELECT convert_from(idem.idem_key_body(p_principal => 'alice', p_key => 'k1'), 'UTF8') AS body;
-- A completed key cannot be released: its answer stays.
SELECT attempt AS k1_token FROM idem.idem_key(p_principal => 'alice', p_key => 'k1') \gset
SELECT idem.idem_release_stuck(p_principal => 'alice', p_key => 'k1', p_attempt => :k1_token, p_reason => 'test');
-- The payout's process is known dead: release its claim with the token from the list.
SELECT idem.idem_release_stuck(p_principal => 'bob', p_key => 'payout-9', p_attempt => :stuck_token, p_reason => 'process killed');
--
-- As the application again: the client's retry runs the payout now.
\c - shop_app
SELECT outcome FROM idem.idem_begin(p_principal => 'bob', p_key => 'payout-9', p_action => 'POST /v1/payouts',
                                    p_request_sha256 => sha256('payout'), p_lease => '10 minutes');
-- Cleanup, and the defaults.
SELECT idem.idem_cleanup(p_batch_size => 1000);
CALL idem.idem_cleanup_all(5000);
SELECT * FROM idem.idem_defaults();

-- The psql session of docs/sql-api.md, run by tests/docs_test.go against a fresh database
-- with the SQL API installed alone; UPDATE_DOCS=1 make test rewrites the doc's copy.
\set VERBOSITY terse
-- A transfer under key k1: claim, work, complete, commit.
BEGIN;
SELECT * FROM idem.idem_begin(p_principal => 'alice', p_key => 'k1', p_action => 'POST /v1/transfers',
    p_request_sha256 => sha256('{"amount":100,"to":"acc_2"}'),
    p_request_fields => jsonb_build_object('amount', encode(sha256('100'), 'hex'), 'to', encode(sha256('"acc_2"'), 'hex')));
-- ... the transfer's own statements go here, in this transaction ...
SELECT idem.idem_complete(p_principal => 'alice', p_key => 'k1', p_attempt => 1,
    p_status => 201, p_headers => '{"Content-Type": "application/json"}', p_body => '{"id":1}', p_resource_id => '1');
COMMIT;
-- The client retries: the stored answer, byte for byte.
SELECT outcome, attempt, response_status, response_headers, convert_from(response_body, 'UTF8') AS body, resource_id
  FROM idem.idem_begin(p_principal => 'alice', p_key => 'k1', p_action => 'POST /v1/transfers',
                       p_request_sha256 => sha256('{"amount":100,"to":"acc_2"}'));
-- The same key with another amount: refused, naming the field.
SELECT outcome, attempt, changed_fields
  FROM idem.idem_begin(p_principal => 'alice', p_key => 'k1', p_action => 'POST /v1/transfers',
       p_request_sha256 => sha256('{"amount":500,"to":"acc_2"}'),
       p_request_fields => jsonb_build_object('amount', encode(sha256('500'), 'hex'), 'to', encode(sha256('"acc_2"'), 'hex')));
-- A final error: the work rolls back to a savepoint, the answer is stored in the same transaction.
BEGIN;
SELECT outcome, attempt FROM idem.idem_begin(p_principal => 'alice', p_key => 'k2', p_action => 'POST /v1/transfers',
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
SELECT outcome, attempt FROM idem.idem_begin(p_principal => 'alice', p_key => 'job-7', p_action => 'POST /v1/exports',
                                             p_request_sha256 => sha256('export'), p_lease => '5 minutes') \gset job_
\echo :job_outcome with token :job_attempt
SELECT outcome, attempt, retry_after > interval '4 minutes' AS lease_runs
  FROM idem.idem_begin(p_principal => 'alice', p_key => 'job-7', p_action => 'POST /v1/exports',
                       p_request_sha256 => sha256('export'), p_lease => '5 minutes');
-- While the work runs, its holder extends the lease (a heartbeat); a stale token cannot.
SELECT idem.idem_extend(p_principal => 'alice', p_key => 'job-7', p_attempt => :job_attempt, p_lease => '5 minutes')
       > clock_timestamp() + interval '4 minutes' AS extended;
SELECT idem.idem_extend(p_principal => 'alice', p_key => 'job-7', p_attempt => 2, p_lease => '5 minutes');
-- A stale holder cannot complete (fencing); the holder can.
SELECT idem.idem_complete(p_principal => 'alice', p_key => 'job-7', p_attempt => 2, p_status => 200, p_headers => '{}', p_body => NULL);
SELECT idem.idem_complete(p_principal => 'alice', p_key => 'job-7', p_attempt => :job_attempt, p_status => 200, p_headers => '{}', p_body => 'done');
-- A transactional claim cannot be committed without its completion.
BEGIN;
SELECT outcome FROM idem.idem_begin(p_principal => 'alice', p_key => 'k3', p_action => 'POST /v1/transfers', p_request_sha256 => sha256('x'));
COMMIT;
-- Bad input is a clear error, and nothing is written.
SELECT * FROM idem.idem_begin(p_principal => 'alice', p_key => 'has space', p_action => 'POST /v1/transfers', p_request_sha256 => sha256('x'));
SELECT * FROM idem.idem_begin(p_principal => 'alice', p_key => 'k4', p_action => 'POST /v1/transfers', p_request_sha256 => sha256('x'),
                              p_ttl => '-1 year 361 days');
-- For operators: the summary, one key's story (never its body), the body on request.
SELECT keys, in_progress, completed, released, expired, leases_run_out FROM idem.idem_summary();
SELECT state, expired, attempt, field_names, response_status, resource_id, withheld, body_bytes
  FROM idem.idem_key(p_principal => 'alice', p_key => 'k1');
SELECT convert_from(idem.idem_key_body(p_principal => 'alice', p_key => 'k1'), 'UTF8') AS body;
-- A completed key cannot be released; a stuck lease claim can, with its token.
SELECT idem.idem_release_stuck(p_principal => 'alice', p_key => 'k1', p_attempt => 1, p_reason => 'test');
-- Cleanup, and the defaults.
SELECT idem.idem_cleanup(p_batch_size => 1000);
CALL idem.idem_cleanup_all(5000);
SELECT * FROM idem.idem_defaults();

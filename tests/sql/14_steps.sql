-- Work in steps (idem_step): a lease claim records named steps in the caller's transaction,
-- fenced by its token; a takeover of the same generation reads every recorded step and what it
-- saved (idem_recovery); a new generation starts from none; the answer clears them. The gap between a
-- step's transaction and a takeover, held with real row locks on two connections, is proved in
-- internal/dbidem (TestStepFenceRowLock), which pgTAP's one transaction cannot show.
BEGIN;
\ir lib/helpers.sql
SELECT plan(42);

-- Arguments.
SELECT throws_ok($$SELECT idem.idem_step(NULL, 'k', 1, 's')$$, '22004', NULL, 'a NULL principal is refused');
SELECT throws_ok($$SELECT idem.idem_step('p', 'k', NULL, 's')$$, '22004', NULL, 'a NULL attempt is refused');
SELECT throws_ok($$SELECT idem.idem_step('p', 'k', 1, NULL)$$, '22004', NULL, 'a NULL step is refused');
SELECT throws_ok($$SELECT idem.idem_step('p', 'k', 1, '')$$, '22023', 'idem_step: p_step must be 1 to 255 characters, got 0',
    'an empty step name is refused');
SELECT throws_ok($$SELECT idem.idem_step('p', 'k k', 1, 's')$$, '22023', NULL, 'an invalid key is refused');
SELECT throws_ok($$SELECT * FROM idem.idem_recovery('p', 'k', NULL)$$, '22004', NULL, 'idem_recovery refuses a NULL attempt');
SELECT throws_ok($$SELECT * FROM idem.idem_recovery('p', 'k k', 1)$$, '22023', NULL, 'and an invalid key');

-- A lease claim records its steps; the first claim of a generation starts with none.
SELECT pg_temp.b('steps', 'k', 'POST /payouts', sha256('100'), p_lease => '1 minute', p_ttl => '1 hour');
SELECT attempt AS a1, provider_key AS pk FROM r \gset
SELECT is(recovery_point, NULL, 'a fresh claim has no recovery point') FROM idem.idem_recovery('steps', 'k', :a1);
SELECT is(recovery_saved, NULL, 'and nothing saved') FROM idem.idem_recovery('steps', 'k', :a1);
SELECT lives_ok(format($$SELECT idem.idem_step('steps', 'k', %s, 'reserve', '{"reservation": 41}')$$, :a1),
    'the holder records its first step');
SELECT lives_ok(format($$SELECT idem.idem_step('steps', 'k', %s, 'charge')$$, :a1),
    'and a second one, saving nothing');
SELECT throws_ok(format($$SELECT idem.idem_step('steps', 'k', %s, 'reserve', '1')$$, :a1), '23505',
    'idem_step: step reserve is recorded already in this generation of the key',
    'a step recorded already is refused: its writes roll back');
SELECT throws_ok(format($$SELECT idem.idem_step('steps', 'k', %s, 'big', to_jsonb(repeat('x', 8200)))$$, :a1), '22023', NULL,
    'the steps'' saved values are bounded (8192 bytes in all)');
SELECT is(recovery_point, 'charge', 'the row holds the last step') FROM idem.idempotency_keys WHERE principal_id = 'steps' AND key = 'k';
SELECT pg_temp.b('steps', 'k', 'POST /payouts', sha256('100'), p_lease => '1 minute', p_ttl => '1 hour');
SELECT is(outcome, 'in_progress', 'a duplicate while the lease runs does not hold the key') FROM r;
SELECT throws_ok(format($$SELECT * FROM idem.idem_recovery('steps', 'k', %s)$$, :a1 + 1000), '55000',
    format('idem_recovery: no claim in progress for this key with attempt %s', :a1 + 1000),
    'a token that holds nothing reads no steps');

-- The lease runs out; the same request takes it over, in the same generation, and is told the steps.
UPDATE idem.idempotency_keys SET lease_expires_at = clock_timestamp() - interval '1 second' WHERE key = 'k';
SELECT pg_temp.b('steps', 'k', 'POST /payouts', sha256('100'), p_lease => '1 minute', p_ttl => '1 hour');
SELECT attempt AS a2 FROM r \gset
SELECT is(outcome || ' ' || provider_key, 'claimed ' || :'pk', 'the takeover holds the same generation') FROM r;
SELECT is(recovery_point, 'charge', 'it reads the last recovery point') FROM idem.idem_recovery('steps', 'k', :a2);
SELECT is(recovery_saved, '{"reserve": {"reservation": 41}, "charge": null}'::jsonb, 'and every step with what it saved')
  FROM idem.idem_recovery('steps', 'k', :a2);
-- The fence: the holder taken over cannot record a step.
SELECT throws_ok(format($$SELECT idem.idem_step('steps', 'k', %s, 'settle')$$, :a1), '55000',
    format('idem_step: no lease claim in progress for this key with attempt %s', :a1),
    'the holder taken over cannot record a step (its transaction must roll back)');
SELECT throws_ok(format($$SELECT * FROM idem.idem_recovery('steps', 'k', %s)$$, :a1), '55000', NULL,
    'nor read the steps');
SELECT lives_ok(format($$SELECT idem.idem_step('steps', 'k', %s, 'settle', '"s-1"')$$, :a2), 'the new holder goes on');

-- A yield keeps the generation and its steps.
SELECT is(idem.idem_yield('steps', 'k', :a2), true, 'the new holder yields');
SELECT pg_temp.b('steps', 'k', 'POST /payouts', sha256('100'), p_lease => '1 minute', p_ttl => '1 hour');
SELECT attempt AS a3 FROM r \gset
SELECT is(recovery_point || ' ' || (recovery_saved ->> 'settle'), 'settle s-1', 'the retry after a yield reads the steps')
  FROM idem.idem_recovery('steps', 'k', :a3);
SELECT throws_ok(format($$SELECT idem.idem_step('steps', 'k', %s, 'answer')$$, :a2), '55000', NULL, 'a holder that yielded is fenced off');

-- The answer clears them; a new generation starts from none.
SELECT idem.idem_complete('steps', 'k', :a3, 201, '{}', 'paid');
SELECT is(recovery_saved, NULL, 'the answer replaces the recovery point') FROM idem.idempotency_keys WHERE principal_id = 'steps' AND key = 'k';
SELECT throws_ok(format($$SELECT idem.idem_step('steps', 'k', %s, 'late')$$, :a3), '55000', NULL, 'a completed claim records no step');
SELECT throws_ok(format($$SELECT * FROM idem.idem_recovery('steps', 'k', %s)$$, :a3), '55000', NULL, 'and has no steps to read');
SELECT pg_temp.b('steps', 'r', 'POST /payouts', sha256('r'), p_lease => '1 minute', p_ttl => '1 hour');
SELECT attempt AS r1 FROM r \gset
SELECT idem.idem_step('steps', 'r', :r1, 'reserve', '1');
SELECT idem.idem_release('steps', 'r', :r1);
SELECT pg_temp.b('steps', 'r', 'POST /payouts', sha256('r'), p_lease => '1 minute', p_ttl => '1 hour');
SELECT attempt AS r2 FROM r \gset
SELECT is(outcome || ' ' || coalesce(s.recovery_saved::text, 'none'), 'claimed none',
    'a released key''s next generation starts from nothing') FROM r, idem.idem_recovery('steps', 'r', :r2) AS s;
SELECT is(recovery_point, NULL, 'the row''s recovery point went with the generation') FROM idem.idempotency_keys WHERE principal_id = 'steps' AND key = 'r';

-- A transactional claim has no steps (its transaction is its one step).
SELECT pg_temp.b('steps', 'tx', 'POST /t', sha256('tx'));
SELECT attempt AS t1 FROM r \gset
SELECT throws_ok(format($$SELECT idem.idem_step('steps', 'tx', %s, 's')$$, :t1), '55000', NULL, 'a transactional claim records no step');
SELECT idem.idem_complete('steps', 'tx', :t1, 201, '{}', 'ok');

-- idem_begin_steps: idem_begin's answer and, for a claim, idem_recovery's, in one call.
SELECT throws_ok($$SELECT * FROM idem.idem_begin_steps(NULL, 'k', 'a', sha256('x'))$$, '22004', NULL,
    'idem_begin_steps refuses a NULL principal as idem_begin does');
SELECT throws_ok($$SELECT * FROM idem.idem_begin_steps('p', 'k k', 'a', sha256('x'))$$, '22023', NULL, 'and an invalid key');
SELECT is(row(outcome, recovery_point, recovery_saved)::text, '(claimed,,)', 'a fresh claim has no steps')
  FROM idem.idem_begin_steps('steps', 's2', 'POST /payouts', sha256('s2'), p_lease => '1 minute');
SELECT attempt AS s1 FROM idem.idempotency_keys WHERE principal_id = 'steps' AND key = 's2' \gset
SELECT idem.idem_step('steps', 's2', :s1, 'reserve', '{"id": 41}');
SELECT is(row(outcome, recovery_point)::text, '(in_progress,)', 'a duplicate while the lease runs reads no steps')
  FROM idem.idem_begin_steps('steps', 's2', 'POST /payouts', sha256('s2'), p_lease => '1 minute');
SELECT idem.idem_yield('steps', 's2', :s1);
CREATE TEMP TABLE took AS
SELECT * FROM idem.idem_begin_steps('steps', 's2', 'POST /payouts', sha256('s2'), p_lease => '1 minute');
SELECT is(row(t.outcome, t.recovery_point, t.recovery_saved)::text, row('claimed', s.recovery_point, s.recovery_saved)::text,
    'the takeover reads the steps as idem_recovery gives them')
  FROM took AS t, idem.idem_recovery('steps', 's2', t.attempt) AS s;
SELECT is(recovery_saved, '{"reserve": {"id": 41}}'::jsonb, 'every step with what it saved') FROM took;
SELECT is(provider_key, (SELECT provider_key FROM idem.idem_begin('steps', 's2', 'POST /payouts', sha256('s2'), p_lease => '1 minute')),
    'the same generation as idem_begin answers it') FROM took;
SELECT idem.idem_complete('steps', 's2', attempt, 201, '{}', 'paid') FROM took;
SELECT is(row(b.outcome, b.attempt, b.response_status, b.response_body, b.provider_key, b.recovery_point, b.recovery_saved)::text,
          row(a.outcome, a.attempt, a.response_status, a.response_body, a.provider_key, NULL::text, NULL::jsonb)::text,
    'a replay: idem_begin''s answer, without steps')
  FROM idem.idem_begin_steps('steps', 's2', 'POST /payouts', sha256('s2')) AS b,
       idem.idem_begin('steps', 's2', 'POST /payouts', sha256('s2')) AS a;

-- The least-privileged role records steps through the function alone.
SET LOCAL ROLE idem_app;
CREATE TEMP TABLE app_claim AS
SELECT attempt FROM idem.idem_begin('steps', 'app', 'POST /payouts', sha256('app'), p_lease => '1 minute');
SELECT lives_ok($$SELECT idem.idem_step('steps', 'app', (SELECT attempt FROM app_claim), 'reserve', '7')$$,
    'idem_app records a step');
SELECT is(recovery_saved, '{"reserve": 7}'::jsonb, 'and reads it') FROM idem.idem_recovery('steps', 'app', (SELECT attempt FROM app_claim));
SELECT is(outcome, 'in_progress', 'and claims with idem_begin_steps')
  FROM idem.idem_begin_steps('steps', 'app', 'POST /payouts', sha256('app'), p_lease => '1 minute');
RESET ROLE;

SELECT * FROM finish();
ROLLBACK;

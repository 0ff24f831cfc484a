--
-- 30_settings: the idempotency.* settings.  Each is the default of an
-- argument; an explicit argument always wins.
--
\set VERBOSITY default

-- Every test file is a new session, which has not loaded the library yet:
-- a setting given now is a placeholder that PostgreSQL cannot check.  When
-- the library loads, it warns and falls back to the default -- and every
-- call then fails with 22023 rather than run with another policy than the
-- one asked for, until a valid value is set.
SET idempotency.in_flight = 'rasie';
SET idempotency.lease = '0';
SELECT status FROM idem_begin('settings', 'placeholder', NULL);
\echo :SQLSTATE
SET idempotency.in_flight = 'raise';
SELECT status FROM idem_begin('settings', 'placeholder', NULL);
\echo :SQLSTATE
RESET idempotency.lease;
SELECT status FROM idem_begin('settings', 'placeholder', NULL, in_flight => 'Raise');
SELECT idem_abort('settings', 'placeholder', token)
  FROM idem_inspect('settings', 'placeholder');
RESET idempotency.in_flight;

-- The defaults of the four settings idem_begin and idem_finish use.
SHOW idempotency.in_flight;
SHOW idempotency.lease;
SHOW idempotency.ttl;
SHOW idempotency.max_response_size;
SELECT name, setting, unit, context, vartype, min_val, max_val, enumvals
  FROM pg_settings
 WHERE name IN ('idempotency.in_flight', 'idempotency.lease', 'idempotency.ttl',
                'idempotency.max_response_size')
 ORDER BY name;

--
-- Validation.
--
-- ttl: at least one minute
SET idempotency.ttl = '59s';
\echo :SQLSTATE
SET idempotency.ttl = 0;
\echo :SQLSTATE
SET idempotency.ttl = '1min';
SHOW idempotency.ttl;
RESET idempotency.ttl;
-- lease: positive
SET idempotency.lease = 0;
\echo :SQLSTATE
SET idempotency.lease = '-1s';
\echo :SQLSTATE
SET idempotency.lease = '1ms';
SHOW idempotency.lease;
RESET idempotency.lease;
-- in_flight: wait or raise
SET idempotency.in_flight = 'foo';
\echo :SQLSTATE
-- max_response_size: positive, and only a superuser may change it
SET idempotency.max_response_size = 0;
\echo :SQLSTATE
SET ROLE regress_idem_nobody;
SET idempotency.max_response_size = '1MB';
\echo :SQLSTATE
SHOW idempotency.max_response_size;
-- ... while the other settings are anyone's to change.
SET idempotency.in_flight = 'raise';
SET idempotency.lease = '10s';
SET idempotency.ttl = '1h';
RESET ROLE;
RESET idempotency.in_flight;
RESET idempotency.lease;
RESET idempotency.ttl;
SET idempotency.max_response_size = '1MB';
SHOW idempotency.max_response_size;
RESET idempotency.max_response_size;
-- The idempotency. prefix is reserved: a misspelt setting is an error, not
-- a silent placeholder.
SET idempotency.inflight = 'raise';
\echo :SQLSTATE

--
-- idempotency.lease and idempotency.ttl: the lease and retention of a claim
-- that does not pass them.
--
SET idempotency.lease = '2s';
SET idempotency.ttl = '1min';
SELECT token AS s1_token FROM idem_begin('settings', 's1', NULL) \gset
SELECT expires_at - created_at AS lease, ttl FROM idem_record
 WHERE operation = 'settings' AND key = 's1';
SELECT idem_finish('settings', 's1', :s1_token, '{}');
SELECT expires_at - completed_at AS retention FROM idem_record
 WHERE operation = 'settings' AND key = 's1';
-- Explicit arguments win over the settings.
SELECT status FROM idem_begin('settings', 's2', NULL, lease => '3 s', ttl => '2 min');
SELECT expires_at - created_at AS lease, ttl FROM idem_record
 WHERE operation = 'settings' AND key = 's2';
-- The settings are checked against each other when used: a lease longer
-- than the ttl is refused.
SET idempotency.lease = '2min';
SELECT idem_begin('settings', 's3', NULL);
\echo :SQLSTATE
-- ... unless the call passes a ttl that makes it right.
SELECT status FROM idem_begin('settings', 's3', NULL, ttl => '2 min');
RESET idempotency.lease;
RESET idempotency.ttl;

--
-- idempotency.in_flight: what a duplicate of a live claim does.
--
-- A claim committed before an external call, with a 30 s lease.  The
-- default policy would wait for it (up to 30 s); with in_flight = 'raise' a
-- duplicate fails at once with IK409.
SELECT token AS r1_token FROM idem_begin('settings', 'r1', NULL, lease => '30 s') \gset
SET idempotency.in_flight = 'raise';
SELECT idem_begin('settings', 'r1', NULL);
\echo :SQLSTATE
-- An explicit 'raise' does the same under the default setting.
RESET idempotency.in_flight;
SELECT idem_begin('settings', 'r1', NULL, in_flight => 'raise');
\echo :SQLSTATE
SELECT idem_abort('settings', 'r1', :r1_token);

-- 'wait' (the default) sleeps until the claim's lease lapses and then
-- takes the key over with a greater token.  The lease here is 200 ms; the
-- new claim is made after the old lease ended.
SELECT token AS w1_token FROM idem_begin('settings', 'w1', NULL, lease => '200 ms') \gset
SELECT expires_at AS w1_lease_end FROM idem_record
 WHERE operation = 'settings' AND key = 'w1' \gset
SELECT status, token > :w1_token AS greater_token
  FROM idem_begin('settings', 'w1', NULL);
SELECT created_at >= :'w1_lease_end' AS claimed_after_lease_end
  FROM idem_record WHERE operation = 'settings' AND key = 'w1';
-- An explicit 'wait' waits under in_flight = 'raise'.
SELECT token AS w2_token
  FROM idem_begin('settings', 'w2', NULL, lease => '200 ms') \gset
SET idempotency.in_flight = 'raise';
SELECT status, token > :w2_token AS greater_token
  FROM idem_begin('settings', 'w2', NULL, in_flight => 'wait');
RESET idempotency.in_flight;

--
-- A wait honours statement_timeout and lock_timeout, and a cancelled wait
-- changes nothing: the claim is still held by its token.  (The lease is
-- 5 s, so a wait that ignored the timeouts would end in a takeover -- a
-- visible failure -- rather than hang.)
--
SELECT token AS t1_token FROM idem_begin('settings', 't1', NULL, lease => '5 s') \gset
SET statement_timeout = '100ms';
SELECT idem_begin('settings', 't1', NULL);
\echo :SQLSTATE
RESET statement_timeout;
SET lock_timeout = '100ms';
SELECT idem_begin('settings', 't1', NULL);
\echo :SQLSTATE
RESET lock_timeout;
SELECT token = :t1_token AS same_token, completed_at IS NULL AS pending
  FROM idem_record WHERE operation = 'settings' AND key = 't1';
SELECT idem_abort('settings', 't1', :t1_token);

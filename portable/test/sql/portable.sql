--
-- portable: what only the portable edition has to show -- its install, the
-- fingerprint's bytes, role isolation by row-level security, the settings
-- read at each call, the wake lock, and the C-only functions failing with
-- 0A000.  The project's regress and isolation suites test the API itself.
-- Run by pg_regress as a superuser, in a new database, from this directory
-- (the script is read from ../):
--   cd portable/test && pg_regress --inputdir=. portable
--
\set SHOW_CONTEXT never
SET client_min_messages = warning;

-- the psql script installs into schema idempotency, and again changes nothing
\set ECHO none
\i ../idempotency--schema.sql
\i ../idempotency--schema.sql
\set ECHO all
\set ON_ERROR_STOP off
SELECT idempotency.idem_portable_version();
SET search_path = public, idempotency;

-- idem_fingerprint is the C edition's encoding: a byte 0 for NULL, or a byte
-- 1, the length in bytes (four, big-endian) and the text; then SHA-256
SELECT idem_fingerprint('1', 'x')
	   = '\x4f6d750d6d368731c522c203c4a920154c81031f326746fe2da2320e44ef07d8'::bytea AS c_edition_value,
	   idem_fingerprint('é', NULL, '')
	   = sha256('\x01'::bytea || int4send(2) || convert_to('é', 'UTF8') || '\x00'::bytea
				|| '\x01'::bytea || int4send(0)) AS by_hand,
	   idem_fingerprint('a', 'bc') <> idem_fingerprint('ab', 'c') AS split_matters,
	   idem_fingerprint(NULL) <> idem_fingerprint('') AS null_is_not_empty,
	   idem_fingerprint(VARIADIC ARRAY['a', 'bc']) = idem_fingerprint('a', 'bc') AS array_form,
	   idem_fingerprint(VARIADIC NULL::text[]) IS NULL AS variadic_null;
-- one or two arguments of any types are hashed by their text forms (the
-- C edition's idem_fingerprint(1, 'x') is the value above); a literal next
-- to a number keeps its own text
SELECT idem_fingerprint(1, 'x')
	   = '\x4f6d750d6d368731c522c203c4a920154c81031f326746fe2da2320e44ef07d8'::bytea AS mixed_types,
	   idem_fingerprint('order-7', 4200) = idem_fingerprint('order-7', '4200') AS literal_and_int,
	   idem_fingerprint(100) = idem_fingerprint('100') AS one_int,
	   idem_fingerprint(true) = idem_fingerprint('t') AS boolean_text_form,
	   idem_fingerprint('012', 5) = idem_fingerprint('012', '5') AS literal_kept,
	   idem_fingerprint(NULL::int) = idem_fingerprint(NULL::text) AS null_any_type,
	   idem_fingerprint(ROW(NULL, NULL)) = idem_fingerprint('(,)') AS row_of_nulls_is_a_value;
-- three or more arguments not all text fail: never another text form
SELECT idem_fingerprint('order-7', 4200, 'EUR');
SELECT idem_fingerprint('order-7', 4200::text, 'EUR') = idem_fingerprint('order-7', '4200', 'EUR') AS cast_to_text;

-- settings are read at each call, with the C edition's units, and an
-- invalid one fails the call
SET idempotency.lease = '2min';
SELECT status FROM idem_begin('settings', 'k1', NULL);
SELECT lease_until - created_at AS lease FROM idem_inspect('settings', 'k1');
SET idempotency.lease = '90000';		-- milliseconds, as the C setting's unit
SELECT status FROM idem_begin('settings', 'k2', NULL);
SELECT lease_until - created_at AS lease FROM idem_inspect('settings', 'k2');
SET idempotency.lease = 'soon';
SELECT status FROM idem_begin('settings', 'k3', NULL);
SET idempotency.lease = '10kB';
SELECT status FROM idem_begin('settings', 'k3', NULL);
RESET idempotency.lease;
SET idempotency.in_flight = 'RAISE';	-- any case, as the C setting
SELECT status FROM idem_begin('settings', 'k1', NULL);
SET idempotency.in_flight = 'later';
SELECT status FROM idem_begin('settings', 'k1', NULL);
RESET idempotency.in_flight;
SET idempotency.max_response_size = '1kB';
SELECT idem_finish('settings', 'k2', (SELECT token FROM idem_inspect('settings', 'k2')),
				   jsonb_build_object('big', repeat('x', 2000)));
RESET idempotency.max_response_size;

-- a claim holds its backend's wake lock (one per session, not per key),
-- which a waiting duplicate sleeps on
SELECT count(*) AS wake_locks FROM pg_locks
 WHERE locktype = 'advisory' AND pid = pg_backend_pid()
   AND classid = 1229651969 AND objid = pg_backend_pid() AND objsubid = 2 AND granted;
-- DISCARD ALL releases it; the next claim takes it back
DISCARD ALL;
SET search_path = public, idempotency;
SELECT count(*) AS wake_locks_after_discard FROM pg_locks
 WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND classid = 1229651969;
SELECT status FROM idem_begin('settings', 'k4', NULL);
SELECT count(*) AS wake_locks FROM pg_locks
 WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND classid = 1229651969;
-- a 'session' claim names this session, which is alive
SELECT status FROM idem_begin('settings', 'k5', NULL, takeover => 'session');
SELECT holder >> 32 = pg_backend_pid() AS holder_is_me,
	   idempotency._idem_session_alive(holder) AS alive,
	   NOT idempotency._idem_session_alive(holder # 2) AS other_start_is_dead
  FROM idem_record WHERE operation = 'settings' AND key = 'k5';
DELETE FROM idem_record;

-- roles: each reaches its own records only, by any path
CREATE ROLE portable_alice;
CREATE ROLE portable_bob;
SET ROLE portable_alice;
SELECT status FROM idem_begin('charge', 'shared-key', '\x01');
SELECT idem_finish('charge', 'shared-key', (SELECT token FROM idem_inspect('charge', 'shared-key')),
				   '{"card": "alice"}');
SET ROLE portable_bob;
-- the same key is another record for bob
SELECT status FROM idem_begin('charge', 'shared-key', '\x02');
SELECT count(*) AS rows_bob_sees FROM idem_record;
UPDATE idem_record SET response = '{"card": "bob"}' WHERE role_id = 'portable_alice'::regrole;
DELETE FROM idem_record WHERE role_id = 'portable_alice'::regrole;
INSERT INTO idem_record (role_id, operation, key, token, ttl, created_at, expires_at)
VALUES ('portable_alice'::regrole, 'charge', 'planted', 1, '1 day', now(), now() + '1 day');
SELECT operation, pending, completed FROM idem_stats;
SELECT * FROM idem_monitor;
SELECT idem_purge();
SELECT idem_forget('charge', 'shared-key', 'portable_alice');
SELECT idem_set_durability('none');
SELECT setval('idem_token_seq', 1);
SET ROLE portable_alice;
SELECT status, response FROM idem_begin('charge', 'shared-key', '\x01');
RESET ROLE;
SELECT role, operation, state, records FROM idem_monitor ORDER BY role;
SELECT idem_forget('charge', 'shared-key', 'portable_bob', force => true);

-- what needs the C edition fails, saying so
SELECT * FROM idem_stats_counters;
SELECT idem_stats_reset();
SELECT idem_set_durability('completed');
CALL idem_set_durability_online('all');
SELECT idem_distribute();
-- the modes it has: 'all' (logged, the default) and 'none'
SELECT idem_durability();
SELECT idem_set_durability('none');
SELECT idem_durability();
SELECT idem_set_logged(true);
SELECT idem_durability();

-- a BEFORE ROW trigger that skips a write (returns NULL) makes the call fail
-- with 09000, as in the C edition: nothing is reported that did not happen
-- (without the check, idem_begin looked for its claim again and again)
SET statement_timeout = '20s';
CREATE FUNCTION skip_write() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  RETURN NULL;
END $$;
CREATE TRIGGER t BEFORE INSERT ON idem_record FOR EACH ROW EXECUTE FUNCTION skip_write();
SELECT status FROM idem_begin('trigger', 'v0', NULL);
\echo :SQLSTATE
DROP TRIGGER t ON idem_record;
-- v1: a claim whose lease has lapsed; UPDATE (a checkpoint, a finish, a
-- renew, a takeover) and DELETE (an abort) skipped
SELECT token AS v1 FROM idem_begin('trigger', 'v1', NULL) \gset
UPDATE idem_record SET expires_at = now() - interval '1 s' WHERE operation = 'trigger';
CREATE TRIGGER t BEFORE UPDATE ON idem_record FOR EACH ROW EXECUTE FUNCTION skip_write();
\set VERBOSITY terse
SELECT idem_checkpoint('trigger', 'v1', :v1, '{"step": 2}');
\echo :SQLSTATE
SELECT idem_finish('trigger', 'v1', :v1, '"v1"');
\echo :SQLSTATE
SELECT idem_renew('trigger', 'v1', :v1, '1 min');
\echo :SQLSTATE
SELECT status FROM idem_begin('trigger', 'v1', NULL);
\echo :SQLSTATE
DROP TRIGGER t ON idem_record;
CREATE TRIGGER t BEFORE DELETE ON idem_record FOR EACH ROW EXECUTE FUNCTION skip_write();
SELECT idem_abort('trigger', 'v1', :v1);
\echo :SQLSTATE
DROP TRIGGER t ON idem_record;
\set VERBOSITY default
-- v1 is as it was, and without the trigger an abort releases it
SELECT token = :v1 AS v1_holds, state, checkpoint FROM idem_inspect('trigger', 'v1');
SELECT idem_abort('trigger', 'v1', :v1);
SELECT count(*) FROM idem_record WHERE operation = 'trigger';
DROP FUNCTION skip_write();
RESET statement_timeout;

-- a DBA may add columns that are nullable or have a default: every call
-- works, a claim fills the default, a finish keeps the DBA's value
BEGIN;
ALTER TABLE idem_record ADD COLUMN note text, ADD COLUMN origin text DEFAULT 'dba';
SELECT token AS x1 FROM idem_begin('columns', 'x1', NULL) \gset
UPDATE idem_record SET note = 'checked' WHERE operation = 'columns';
SELECT idem_checkpoint('columns', 'x1', :x1, '{"step": 1}');
SELECT idem_renew('columns', 'x1', :x1, '1 min') > now() AS renewed;
SELECT idem_finish('columns', 'x1', :x1, '"x1"');
SELECT status, response FROM idem_begin('columns', 'x1', NULL);
SELECT note, origin, response FROM idem_record WHERE operation = 'columns';
SELECT state FROM idem_inspect('columns', 'x1');
ROLLBACK;

-- times in messages are in ISO form whatever DateStyle is, as the C
-- edition's (pg_regress sets 'Postgres, MDY')
SELECT idem_finish('times', 'r1', (idem_begin('times', 'r1', NULL, remember => '1 day')).token, '"r1"');
UPDATE idem_record SET completed_at = '2020-01-01 12:00:00+00', expires_at = '2020-01-01 12:01:00.5+00',
	   forget_at = '2099-12-31 00:00:00+00' WHERE operation = 'times';
SET TimeZone = 'UTC';
SELECT status FROM idem_begin('times', 'r1', NULL);
RESET TimeZone;
DELETE FROM idem_record WHERE operation = 'times';

-- a schema where every role may create is refused
GRANT CREATE ON SCHEMA idempotency TO PUBLIC;
SELECT idempotency._idem_check_schema();
REVOKE CREATE ON SCHEMA idempotency FROM PUBLIC;

DELETE FROM idem_record;
DROP ROLE portable_alice;
DROP ROLE portable_bob;

--
-- 87_monitoring: what a monitoring role may read (1.4; the state
-- remembered, 1.5).  A member of pg_monitor, and nothing else, sees every
-- role's records counted by role, operation and state in the view
-- idem_monitor, and may call idem_monitor_counters(); it cannot read a key
-- or a response, and cannot write.  PUBLIC may do neither.
--
-- Roles (from 00_setup): regress_idem_a and regress_idem_b are two
-- applications, regress_idem_nobody any unprivileged role.  This file makes
-- regress_idem_monitor (pg_monitor only) and regress_idem_gone (dropped
-- with its records in place), and drops the monitoring role at the end.
--
\set VERBOSITY default
SET client_min_messages = warning;
DROP ROLE IF EXISTS regress_idem_monitor;
DROP ROLE IF EXISTS regress_idem_gone;
RESET client_min_messages;
CREATE ROLE regress_idem_monitor NOLOGIN IN ROLE pg_monitor;
CREATE ROLE regress_idem_gone NOLOGIN;

-- Who may use what: SELECT on the view and EXECUTE on the counters go to
-- pg_monitor, not to PUBLIC; the view has no column of a key, fingerprint
-- or response.
SELECT has_table_privilege('pg_monitor', 'idem_monitor', 'SELECT') AS monitor_select,
       has_table_privilege('pg_monitor', 'idem_monitor', 'INSERT, UPDATE, DELETE, TRUNCATE') AS monitor_write,
       has_function_privilege('pg_monitor', 'idem_monitor_counters()', 'EXECUTE') AS monitor_counters,
       has_table_privilege('regress_idem_nobody', 'idem_monitor', 'SELECT') AS public_select,
       has_function_privilege('regress_idem_nobody', 'idem_monitor_counters()', 'EXECUTE') AS public_counters;
SELECT attname, atttypid::regtype
  FROM pg_attribute
 WHERE attrelid = 'idem_monitor'::regclass AND attnum > 0
 ORDER BY attnum;

--
-- Known records, under operations of this file only ('mon.*'):
--   A, mon.charge: 2 completed, 1 pending, 1 lapsed (lease over)
--   A, mon.refund: 1 completed made expired (retention over), 1 completed
--     with remember made remembered (retention over, key kept: IK410)
--   B, mon.charge: 1 completed, 1 pending claimed an hour ago
--   a dropped role, mon.charge: 1 completed
-- Ages and expiries are set by hand, as only the superuser can.
--
SET ROLE regress_idem_a;
SELECT idem_finish('mon.charge', 'a1', token, '{"secret": "resp-a1"}')
  FROM idem_begin('mon.charge', 'a1', '\xa1');
SELECT idem_finish('mon.charge', 'a2', token, '{"secret": "resp-a2"}')
  FROM idem_begin('mon.charge', 'a2', '\xa2');
SELECT status FROM idem_begin('mon.charge', 'a3', '\xa3');
SELECT status FROM idem_begin('mon.charge', 'a4', '\xa4');
SELECT idem_finish('mon.refund', 'a5', token, '{"secret": "resp-a5"}')
  FROM idem_begin('mon.refund', 'a5', '\xa5');
SELECT idem_finish('mon.refund', 'a6', token, '{"secret": "resp-a6"}')
  FROM idem_begin('mon.refund', 'a6', '\xa6', remember => '30 days');
SET ROLE regress_idem_b;
SELECT idem_finish('mon.charge', 'b1', token, '{"secret": "resp-b1"}')
  FROM idem_begin('mon.charge', 'b1', '\xb1');
SELECT status FROM idem_begin('mon.charge', 'b2', '\xb2');
SET ROLE regress_idem_gone;
SELECT idem_finish('mon.charge', 'g1', token, '{"secret": "resp-g1"}')
  FROM idem_begin('mon.charge', 'g1', '\xc1');
RESET ROLE;
DROP ROLE regress_idem_gone;
UPDATE idem_record SET expires_at = now() - interval '1 second'
 WHERE operation = 'mon.charge' AND key = 'a4';
UPDATE idem_record SET expires_at = now() - interval '1 second'
 WHERE operation = 'mon.refund' AND key IN ('a5', 'a6');
UPDATE idem_record SET created_at = now() - interval '1 hour'
 WHERE operation = 'mon.charge' AND key = 'b2';

--
-- The monitoring role sees every role's records, counted; a dropped role's
-- records have no role name.  oldest_age is the age of the group's oldest
-- record: B's pending claim is an hour old.
--
SET ROLE regress_idem_monitor;
SELECT role, operation, state, records,
       oldest_age >= interval '1 hour' AS hour_old,
       oldest_age < interval '2 hours' AS under_two_hours
  FROM idem_monitor
 WHERE operation LIKE 'mon.%'
 ORDER BY role COLLATE "C" NULLS LAST, operation, state;
-- A's own view of the same records: idem_stats counts the remembered key
-- as remembered, as idem_inspect names it, not as expired.
RESET ROLE;
SET ROLE regress_idem_a;
SELECT * FROM idem_stats WHERE operation LIKE 'mon.%' ORDER BY operation;
SELECT key, state FROM (VALUES ('a5'), ('a6')) k(key), idem_inspect('mon.refund', key)
 ORDER BY key;
-- a retry of the remembered key is refused (IK410), not run again (the
-- message's times are the clock's: only the SQLSTATE is shown)
\set VERBOSITY sqlstate
SELECT status FROM idem_begin('mon.refund', 'a6', '\xa6');
\set VERBOSITY default
SET ROLE regress_idem_monitor;
-- Its own namespace is empty: idem_stats and idem_inspect show its own
-- records, not others'.
SELECT count(*) AS own_stats FROM idem_stats WHERE operation LIKE 'mon.%';
SELECT count(*) AS own_inspect FROM idem_inspect('mon.charge', 'a1');
-- No key, fingerprint or response: the tables are closed to it.
SELECT key, response FROM idem_record WHERE operation = 'mon.charge';
\echo :SQLSTATE
SELECT key, response FROM idem_result;
\echo :SQLSTATE
-- No write: not through the view, not to the tables, not by the
-- administration functions.
DELETE FROM idem_monitor;
\echo :SQLSTATE
UPDATE idem_record SET response = '"forged"' WHERE key = 'a1';
\echo :SQLSTATE
DELETE FROM idem_record;
\echo :SQLSTATE
SELECT idem_purge();
\echo :SQLSTATE
SELECT idem_stats_reset();
\echo :SQLSTATE
SELECT idem_set_durability('all');
\echo :SQLSTATE
-- It may call idem_monitor_counters(): this server has no
-- shared_preload_libraries, so the call fails as idem_counters() does,
-- past the privilege check (55000, not 42501).
SELECT * FROM idem_monitor_counters();
\echo :SQLSTATE
RESET ROLE;

-- PUBLIC may not read the view or call the counters.
SET ROLE regress_idem_nobody;
SELECT count(*) FROM idem_monitor;
\echo :SQLSTATE
SELECT * FROM idem_monitor_counters();
\echo :SQLSTATE
RESET ROLE;

-- The counts do not depend on the table a record is in: in mode
-- 'completed' the completed records move to idem_result (rolled back).
BEGIN;
SELECT idem_set_durability('completed');
SELECT count(*) AS moved_to_idem_result FROM idem_result WHERE operation LIKE 'mon.%';
SET LOCAL ROLE regress_idem_monitor;
SELECT role, operation, state, records
  FROM idem_monitor
 WHERE operation LIKE 'mon.%'
 ORDER BY role COLLATE "C" NULLS LAST, operation, state;
ROLLBACK;

-- Purge deletes the expired record and keeps the remembered one (without
-- its response): afterwards no record of this file is expired, and the
-- remembered key is still counted as remembered.
SELECT idem_purge() >= 1 AS purged;
SELECT key, response FROM idem_record WHERE operation = 'mon.refund' ORDER BY key;
SET ROLE regress_idem_monitor;
SELECT role, operation, state, records
  FROM idem_monitor
 WHERE operation = 'mon.refund'
 ORDER BY role COLLATE "C" NULLS LAST, operation, state;
RESET ROLE;

-- The records of this file go, so that later files do not see them.
DELETE FROM idem_record WHERE operation LIKE 'mon.%';
DROP ROLE regress_idem_monitor;

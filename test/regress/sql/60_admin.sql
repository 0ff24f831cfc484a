--
-- 60_admin: idem_purge and idem_set_logged (their privileges are checked
-- in 70_roles).
--
\set VERBOSITY default

--
-- idem_purge(max_rows) deletes expired records -- completed ones past their
-- retention, pending ones whose lease lapsed -- at most max_rows of them,
-- and returns how many it deleted.  Live records are never touched.
--
-- Start from an empty table so that the counts below are exact.
TRUNCATE idem_record;
-- completed, within its retention
SELECT idem_finish('purge', 'completed-live',
                   (idem_begin('purge', 'completed-live', NULL)).token, '"kept"');
-- completed, past its retention (moved into the past by hand, as in
-- 50_lease, to simulate time passing)
SELECT idem_finish('purge', 'completed-expired',
                   (idem_begin('purge', 'completed-expired', NULL, ttl => '1 min')).token,
                   '"gone"');
UPDATE idem_record SET expires_at = now() - interval '1 s'
 WHERE operation = 'purge' AND key = 'completed-expired';
-- pending, within its lease
SELECT status FROM idem_begin('purge', 'pending-live', NULL, lease => '30 s');
-- pending, lease lapsed (two of them)
SELECT token AS lapsed1_token
  FROM idem_begin('purge', 'pending-lapsed-1', NULL, lease => '100 ms') \gset
SELECT status FROM idem_begin('purge', 'pending-lapsed-2', NULL, lease => '100 ms');
SELECT pg_sleep(0.2);

-- Three expired records: a purge limited to two rows deletes two, the next
-- one the last, then there is nothing left to purge.
SELECT idem_purge(2) AS purged;
SELECT idem_purge(2) AS purged;
SELECT idem_purge() AS purged;
SELECT key FROM idem_record WHERE operation = 'purge' ORDER BY key;
-- A purged lapsed claim is gone for its token too.
SELECT idem_abort('purge', 'pending-lapsed-1', :lapsed1_token);
-- The live ones still behave as before.
SELECT status, response FROM idem_begin('purge', 'completed-live', NULL);
SELECT idem_begin('purge', 'pending-live', NULL, in_flight => 'raise');
\echo :SQLSTATE

-- max_rows must be positive: 22023; NULL: 22004.
SELECT idem_purge(0);
\echo :SQLSTATE
SELECT idem_purge(-1);
\echo :SQLSTATE
SELECT idem_purge(NULL);
\echo :SQLSTATE

-- The caller's search_path does not redirect the purge: a table called
-- idem_record earlier in the path is not the record table.
CREATE SCHEMA decoy;
CREATE TABLE decoy.idem_record (LIKE public.idem_record);
INSERT INTO decoy.idem_record SELECT * FROM public.idem_record;
UPDATE decoy.idem_record SET expires_at = now() - interval '1 s';
SET search_path = decoy, public;
SELECT idem_purge() AS purged;
SELECT count(*) AS decoy_rows FROM decoy.idem_record;
RESET search_path;
DROP SCHEMA decoy CASCADE;

--
-- idem_set_logged(true) makes the record table (and its index) logged,
-- false makes it unlogged again.  The records survive both switches.
--
SELECT relname, relpersistence FROM pg_class
 WHERE oid IN ('idem_record'::regclass, 'idem_record_pkey'::regclass) ORDER BY relname;
SELECT count(*) AS records FROM idem_record;
SELECT idem_set_logged(true);
SELECT relname, relpersistence FROM pg_class
 WHERE oid IN ('idem_record'::regclass, 'idem_record_pkey'::regclass) ORDER BY relname;
SELECT count(*) AS records FROM idem_record;
SELECT status, response FROM idem_begin('purge', 'completed-live', NULL);
-- claims work on the logged table, and survive the switch back
SELECT idem_finish('purge', 'while-logged',
                   (idem_begin('purge', 'while-logged', NULL)).token, '"logged"');
-- switching to the state it is already in changes nothing
SELECT idem_set_logged(true);
SELECT relpersistence FROM pg_class WHERE oid = 'idem_record'::regclass;
SELECT idem_set_logged(false);
SELECT relname, relpersistence FROM pg_class
 WHERE oid IN ('idem_record'::regclass, 'idem_record_pkey'::regclass) ORDER BY relname;
SELECT count(*) AS records FROM idem_record;
SELECT status, response FROM idem_begin('purge', 'while-logged', NULL);
SELECT idem_begin('purge', 'pending-live', NULL, in_flight => 'raise');
\echo :SQLSTATE
-- NULL is an error (22004) that changes nothing.
SELECT idem_set_logged(NULL) IS NULL AS is_null;
SELECT relpersistence FROM pg_class WHERE oid = 'idem_record'::regclass;

-- A rewrite of the table inside the transaction that claimed a key, between
-- idem_begin and idem_finish, moves the claim: the finish still finds it.
BEGIN;
SELECT token AS rewrite_token FROM idem_begin('admin', 'same-xact-rewrite', NULL) \gset
SELECT idem_set_logged(true);
SELECT idem_finish('admin', 'same-xact-rewrite', :rewrite_token, '"finished after a rewrite"');
SELECT idem_set_logged(false);
COMMIT;
SELECT status, response FROM idem_begin('admin', 'same-xact-rewrite', NULL);

-- Row triggers on the record table fire on every write, as they would on
-- an INSERT, UPDATE or DELETE (pg_repack captures writes with one).
CREATE TABLE admin_trigger_log (op text, key text);
CREATE FUNCTION admin_trigger_log() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO admin_trigger_log VALUES (TG_OP, coalesce(NEW.key, OLD.key));
  RETURN NULL;
END $$;
CREATE TRIGGER admin_log AFTER INSERT OR UPDATE OR DELETE ON idem_record
  FOR EACH ROW EXECUTE FUNCTION admin_trigger_log();
SELECT idem_finish('admin', 'trig-1', (idem_begin('admin', 'trig-1', NULL)).token, '"t"');
SELECT idem_abort('admin', 'trig-2', (idem_begin('admin', 'trig-2', NULL)).token);
SELECT * FROM admin_trigger_log;
DROP TRIGGER admin_log ON idem_record;
DROP FUNCTION admin_trigger_log();
DROP TABLE admin_trigger_log;

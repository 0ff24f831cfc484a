--
-- 00_setup: install the extension and the roles the later files use.
--
-- The files of this suite run in order (00_, 10_, ...) in one database;
-- each may rely on what the earlier ones left behind.  They run as a
-- superuser.  Errors are shown with their SQLSTATE (\echo :SQLSTATE right
-- after the failing statement).
--
\set VERBOSITY default

CREATE EXTENSION idempotency;
-- pgcrypto is used only by 40_fingerprint, to show that any bytea works as
-- a fingerprint; the extension itself does not need it.
CREATE EXTENSION pgcrypto;

SELECT extname, extversion, extrelocatable
  FROM pg_extension WHERE extname = 'idempotency';

-- The SQL API.  The three core functions and the fingerprint helper are
-- executable by PUBLIC; the two administration functions (idem_purge,
-- idem_set_logged) are not.  Only the administration functions are
-- SECURITY DEFINER: the core functions must see the caller as
-- current_user, which is the namespace of the records.  (1.1 adds
-- idem_renew, idem_inspect and the statistics functions; of those only
-- idem_stats_reset is withheld from PUBLIC.  1.4 adds
-- idem_monitor_counters, granted to pg_monitor only: 87_monitoring.)
SELECT p.oid::regprocedure AS function,
       p.prorettype::regtype AS returns,
       p.prosecdef AS security_definer,
       p.provolatile AS volatility,
       EXISTS (SELECT FROM aclexplode(p.proacl) a
                WHERE a.grantee = 0 AND a.privilege_type = 'EXECUTE')
         AS public_execute
  FROM pg_proc p
  JOIN pg_depend d ON d.classid = 'pg_proc'::regclass AND d.objid = p.oid
 WHERE d.refclassid = 'pg_extension'::regclass
   AND d.refobjid = (SELECT oid FROM pg_extension WHERE extname = 'idempotency')
 ORDER BY p.proname;

-- A new installation is in durability mode 'completed': the claims'
-- table and the token count are unlogged, the completed records' table and
-- the token epochs logged, and PUBLIC has no rights on any of them.
SELECT idem_durability();
SELECT c.relname, c.relkind, c.relpersistence,
       ARRAY(SELECT a.privilege_type FROM aclexplode(c.relacl) a
              WHERE a.grantee = 0) AS public_privileges
  FROM pg_class c
 WHERE c.relnamespace = 'public'::regnamespace
   AND c.relname IN ('idem_record', 'idem_record_pkey', 'idem_result',
                     'idem_result_pkey', 'idem_token_seq', 'idem_token_epoch')
 ORDER BY c.relname;

-- The files up to 80_batch look at and change idem_record directly, so
-- they run in mode 'none', where every record stays there; 85_durability
-- tests the other modes.
SELECT idem_set_durability('none');

-- The result type of idem_begin.
SELECT attname, atttypid::regtype
  FROM pg_attribute
 WHERE attrelid = 'idem_claim'::regclass AND attnum > 0
 ORDER BY attnum;

-- Roles for 70_roles and 30_settings; 99_cleanup drops them.  A run that
-- stopped half way may have left them behind, so drop them first, quietly
-- (the database is new, so they own nothing in it).
SET client_min_messages = warning;
DROP ROLE IF EXISTS regress_idem_a;
DROP ROLE IF EXISTS regress_idem_b;
DROP ROLE IF EXISTS regress_idem_nobody;
RESET client_min_messages;
CREATE ROLE regress_idem_a NOLOGIN;
CREATE ROLE regress_idem_b NOLOGIN;
CREATE ROLE regress_idem_nobody NOLOGIN;

-- Distributing the records needs a Citus coordinator; without Citus it
-- changes nothing (test/citus/t/030_distributed.pl distributes them)
\set VERBOSITY sqlstate
SELECT idem_distribute();
\set VERBOSITY default
SELECT format_type(atttypid, NULL) AS role_id_type FROM pg_attribute
 WHERE attrelid = 'idem_record'::regclass AND attname = 'role_id';

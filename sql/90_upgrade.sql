--
-- 90_upgrade: DROP / CREATE EXTENSION in a session that has used the
-- extension, the 1.0 and 1.1 SQL definitions running on the current
-- library, and the upgrade scripts, which must give exactly what a fresh
-- install of the default version gives.
--
\set VERBOSITY default

-- Every member object of the extension, with what matters about it: for a
-- function its C symbol, volatility, strictness, SECURITY DEFINER, search_path
-- and whether PUBLIC may execute it; for a relation its kind, persistence
-- and PUBLIC's privileges; and whether the table is dumped as configuration.
CREATE FUNCTION ext_objects() RETURNS SETOF text LANGUAGE sql AS $$
  SELECT pg_describe_object(d.classid, d.objid, 0) ||
         CASE d.classid
           WHEN 'pg_proc'::regclass THEN
             (SELECT format(' -> %s %s strict=%s secdef=%s config=%s returns=%s public_execute=%s',
                            p.prosrc, p.provolatile, p.proisstrict, p.prosecdef,
                            p.proconfig, p.prorettype::regtype,
                            EXISTS (SELECT FROM aclexplode(p.proacl) a
                                     WHERE a.grantee = 0 AND a.privilege_type = 'EXECUTE'))
                FROM pg_proc p WHERE p.oid = d.objid)
           WHEN 'pg_class'::regclass THEN
             (SELECT format(' -> kind=%s persistence=%s public=%s config_dump=%s',
                            c.relkind, c.relpersistence,
                            ARRAY(SELECT a.privilege_type FROM aclexplode(c.relacl) a
                                   WHERE a.grantee = 0 ORDER BY 1),
                            c.oid = ANY (e.extconfig))
                FROM pg_class c WHERE c.oid = d.objid)
           ELSE ''
         END
    FROM pg_depend d
    JOIN pg_extension e ON e.oid = d.refobjid
   WHERE d.refclassid = 'pg_extension'::regclass
     AND e.extname = 'idempotency'
     AND d.deptype = 'e'
     -- row types of tables and views, and array types, are members only
     -- from PostgreSQL 17 on: they follow their relation or element type
     AND NOT (d.classid = 'pg_type'::regclass AND EXISTS (
           SELECT FROM pg_type t LEFT JOIN pg_class c ON c.oid = t.typrelid
            WHERE t.oid = d.objid AND (t.typelem <> 0 OR c.relkind <> 'c')))
$$;

-- This session uses the fresh install (and so remembers its objects) ...
SELECT extversion FROM pg_extension WHERE extname = 'idempotency';
SELECT status FROM idem_begin('upgrade', 'u0', NULL);
CREATE TEMP TABLE fresh_objects AS SELECT o FROM ext_objects() o;
SELECT o AS fresh_install FROM fresh_objects ORDER BY o;

-- ... and still works after the extension is dropped and created again:
-- the new, empty record table is found, not the dropped one.
DROP EXTENSION idempotency;
CREATE EXTENSION idempotency VERSION '1.0';
SELECT extversion FROM pg_extension WHERE extname = 'idempotency';
SELECT count(*) AS records FROM idem_record;
SELECT status FROM idem_begin('upgrade', 'u0', NULL);

-- The 1.0 SQL definitions work with the current library.
SELECT token AS u1_token FROM idem_begin('upgrade', 'u1', idem_fingerprint('u', 1)) \gset
SELECT idem_finish('upgrade', 'u1', :u1_token, '{"version": "1.0"}');
SELECT status, response FROM idem_begin('upgrade', 'u1', idem_fingerprint('u', 1));
SELECT idem_abort('upgrade', 'u2', (idem_begin('upgrade', 'u2', NULL)).token);
SELECT idem_purge() AS purged;
SELECT idem_set_logged(true);
SELECT idem_set_logged(false);

-- 1.1 definitions, with tokens still from the logged sequence.
ALTER EXTENSION idempotency UPDATE TO '1.1';
SELECT extversion FROM pg_extension WHERE extname = 'idempotency';
SELECT setval('idem_token_seq', 900) AS old_token_base;
SELECT token AS u3_token FROM idem_begin('upgrade', 'u3', NULL) \gset
SELECT :u3_token AS u3_token;
SELECT state FROM idem_inspect('upgrade', 'u3');

-- Upgrade to the default version: the same objects, with the same
-- properties, as a fresh install -- nothing missing, nothing extra.
ALTER EXTENSION idempotency UPDATE;
SELECT extversion FROM pg_extension WHERE extname = 'idempotency';
-- An updated installation keeps its durability mode: its record table was
-- unlogged, so it is in mode 'none' (a new one starts in 'completed'; the
-- fresh install above was switched to 'none' by 00_setup).
SELECT idem_durability();
SELECT o AS missing_after_upgrade FROM fresh_objects
EXCEPT SELECT o FROM ext_objects() o;
SELECT o AS extra_after_upgrade FROM ext_objects() o
EXCEPT SELECT o FROM fresh_objects;
-- The records survive the upgrade.
SELECT status, response FROM idem_begin('upgrade', 'u1', idem_fingerprint('u', 1));
SELECT idem_begin('upgrade', 'u0', NULL, in_flight => 'raise');
\echo :SQLSTATE

-- Tokens keep increasing across the updates (1.2 adds epochs, 1.3 orders
-- them by timeline): the first epoch starts above the old sequence, its
-- band from the clock (days since 2020-01-01, plus the timeline), and the
-- claim taken under 1.1 is still held by its token.
SELECT token > :u3_token AS greater,
       token >> 47 > current_date - '2020-01-02'::date AS band_from_clock
  FROM idem_begin('upgrade', 'u4', NULL);
SELECT idem_finish('upgrade', 'u3', :u3_token, '"done under 1.2"');
SELECT status, response FROM idem_begin('upgrade', 'u3', NULL);

-- From 1.2 to 1.3: role_id becomes a regrole, converted in place, so that
-- pg_dump writes role names.  A record of a role dropped before the update
-- is kept (its role_id shows as a number) but left out of dumps.
DROP EXTENSION idempotency;
CREATE EXTENSION idempotency VERSION '1.2';
CREATE ROLE regress_idem_upgrade_kept NOLOGIN;
CREATE ROLE regress_idem_upgrade_gone NOLOGIN;
SET ROLE regress_idem_upgrade_kept;
SELECT idem_finish('upgrade', 'r1', (idem_begin('upgrade', 'r1', NULL)).token, '"kept"');
SET ROLE regress_idem_upgrade_gone;
SELECT idem_finish('upgrade', 'r1', (idem_begin('upgrade', 'r1', NULL)).token, '"gone"');
RESET ROLE;
SELECT token AS r2_token FROM idem_begin('upgrade', 'r2', NULL) \gset
DROP ROLE regress_idem_upgrade_gone;
SELECT count(*) AS records_before FROM idem_record WHERE operation = 'upgrade';
ALTER EXTENSION idempotency UPDATE TO '1.3';
SELECT idem_durability();
SELECT format_type(atttypid, atttypmod) AS role_id_type
  FROM pg_attribute WHERE attrelid = 'idem_record'::regclass AND attname = 'role_id';
SELECT CASE WHEN role_id = current_user::regrole THEN 'me'
            WHEN NOT EXISTS (SELECT FROM pg_roles WHERE oid = role_id) THEN '(dropped)'
            ELSE role_id::text END AS role,
       key, response
  FROM idem_record WHERE operation = 'upgrade' ORDER BY key, response::text;
SET ROLE regress_idem_upgrade_kept;
SELECT status, response FROM idem_begin('upgrade', 'r1', NULL);
RESET ROLE;
-- a claim made under 1.2 is still held by its token; new tokens are greater
SELECT token > :r2_token AS greater FROM idem_begin('upgrade', 'r3', NULL);
SELECT idem_finish('upgrade', 'r2', :r2_token, '"done under 1.3"');
-- a dump leaves out records whose role is gone (config condition)
SELECT pg_catalog.array_to_string(extcondition, ' | ') AS dump_conditions
  FROM pg_extension WHERE extname = 'idempotency';
DELETE FROM idem_record WHERE operation = 'upgrade';
DROP ROLE regress_idem_upgrade_kept;

-- A 1.2 installation whose record table was made logged is in mode 'all'
-- after the update.
DROP EXTENSION idempotency;
CREATE EXTENSION idempotency VERSION '1.2';
SELECT idem_set_logged(true);
ALTER EXTENSION idempotency UPDATE TO '1.3';
SELECT idem_durability();
SELECT relname, relpersistence FROM pg_class
 WHERE relname IN ('idem_record', 'idem_result') ORDER BY relname;

--
-- 90_upgrade: DROP / CREATE EXTENSION in a session that has used the
-- extension, the 1.0 and 1.1 SQL definitions running on the current
-- library, and the upgrade scripts, which must give exactly what a fresh
-- install of the default version gives.
--
\set VERBOSITY default

-- Every member object of the extension, with what matters about it: for a
-- function its C symbol (or its language), volatility, strictness, SECURITY DEFINER, search_path
-- and whether PUBLIC may execute it; for a relation its kind, persistence
-- and PUBLIC's privileges; and whether the table is dumped as configuration.
CREATE FUNCTION ext_objects() RETURNS SETOF text LANGUAGE sql AS $$
  SELECT pg_describe_object(d.classid, d.objid, 0) ||
         CASE d.classid
           WHEN 'pg_proc'::regclass THEN
             (SELECT format(' -> %s %s strict=%s secdef=%s config=%s returns=%s public_execute=%s',
                            CASE WHEN l.lanname = 'c' THEN p.prosrc ELSE '(' || l.lanname || ')' END,
                            p.provolatile, p.proisstrict, p.prosecdef,
                            p.proconfig, p.prorettype::regtype,
                            EXISTS (SELECT FROM aclexplode(p.proacl) a
                                     WHERE a.grantee = 0 AND a.privilege_type = 'EXECUTE'))
                FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang WHERE p.oid = d.objid)
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

-- What ext_objects does not show of the extension's tables: every column
-- (type, NOT NULL, default, collation), constraint and index, and the
-- triggers (none of which is a member of the extension itself).
CREATE FUNCTION ext_tables() RETURNS SETOF text LANGUAGE sql AS $$
  WITH t AS (
    SELECT c.oid, c.relname
      FROM pg_depend d
      JOIN pg_extension e ON e.oid = d.refobjid
      JOIN pg_class c ON c.oid = d.objid
     WHERE d.classid = 'pg_class'::regclass AND d.refclassid = 'pg_extension'::regclass
       AND e.extname = 'idempotency' AND d.deptype = 'e' AND c.relkind = 'r'
  )
  SELECT format('%s column %s %s%s%s%s', t.relname, a.attname,
                format_type(a.atttypid, a.atttypmod),
                CASE WHEN a.attnotnull THEN ' not null' ELSE '' END,
                ' default ' || pg_get_expr(ad.adbin, ad.adrelid),
                ' collate ' || NULLIF(co.collname, 'default'))
    FROM t
    JOIN pg_attribute a ON a.attrelid = t.oid AND a.attnum > 0 AND NOT a.attisdropped
    LEFT JOIN pg_attrdef ad ON ad.adrelid = t.oid AND ad.adnum = a.attnum
    LEFT JOIN pg_collation co ON co.oid = a.attcollation
  UNION ALL
  SELECT format('%s constraint %s %s', t.relname, k.conname, pg_get_constraintdef(k.oid))
    FROM t JOIN pg_constraint k ON k.conrelid = t.oid
   WHERE k.contype <> 'n'    -- PostgreSQL 18 lists NOT NULL as constraints too
  UNION ALL
  SELECT format('%s index %s', t.relname, pg_get_indexdef(i.indexrelid))
    FROM t JOIN pg_index i ON i.indrelid = t.oid
  UNION ALL
  SELECT format('%s trigger %s', t.relname, pg_get_triggerdef(g.oid))
    FROM t JOIN pg_trigger g ON g.tgrelid = t.oid AND NOT g.tgisinternal
$$;

-- This session uses the fresh install (and so remembers its objects) ...
SELECT extversion FROM pg_extension WHERE extname = 'idempotency';
SELECT status FROM idem_begin('upgrade', 'u0', NULL);
CREATE TEMP TABLE fresh_objects AS SELECT o FROM ext_objects() o;
SELECT o AS fresh_install FROM fresh_objects ORDER BY o;
CREATE TEMP TABLE fresh_tables AS SELECT o FROM ext_tables() o;
SELECT o AS fresh_tables FROM fresh_tables ORDER BY o;

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
SELECT o AS missing_after_upgrade FROM fresh_tables
EXCEPT SELECT o FROM ext_tables() o;
SELECT o AS extra_after_upgrade FROM ext_tables() o
EXCEPT SELECT o FROM fresh_tables;
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
-- after the updates, through 1.3 to the default version.
DROP EXTENSION idempotency;
CREATE EXTENSION idempotency VERSION '1.2';
SELECT idem_set_logged(true);
ALTER EXTENSION idempotency UPDATE;
SELECT extversion FROM pg_extension WHERE extname = 'idempotency';
SELECT idem_durability();
SELECT relname, relpersistence FROM pg_class
 WHERE relname IN ('idem_record', 'idem_result') ORDER BY relname;

-- From 1.3 to 1.4 with records in flight: a pending claim that will finish,
-- one that will checkpoint and be taken over, and completed records in
-- both tables.  (A 1.3 made through the update scripts is in mode 'none';
-- making idem_result logged by hand puts it in mode 'completed' and leaves
-- the record completed before where it was, in idem_record: a finish
-- there and then puts the next one in idem_result.)
DROP EXTENSION idempotency;
CREATE EXTENSION idempotency VERSION '1.3';
SELECT idem_durability();
SELECT idem_finish('upgrade', 'n1', (idem_begin('upgrade', 'n1', '\x01')).token, '"n1 under 1.3"');
ALTER TABLE idem_result SET LOGGED;
SELECT idem_durability();
SELECT idem_finish('upgrade', 'c1', (idem_begin('upgrade', 'c1', '\x01')).token, '"c1 under 1.3"');
SELECT token AS p1_token FROM idem_begin('upgrade', 'p1', '\x01') \gset
SELECT token AS p2_token FROM idem_begin('upgrade', 'p2', '\x01') \gset
CREATE FUNCTION where_is() RETURNS TABLE (tab text, key text, completed bool) LANGUAGE sql AS $$
  SELECT 'idem_record', key, completed_at IS NOT NULL FROM idem_record WHERE operation = 'upgrade'
  UNION ALL
  SELECT 'idem_result', key, completed_at IS NOT NULL FROM idem_result WHERE operation = 'upgrade'
  ORDER BY 2
$$;
SELECT * FROM where_is();
SELECT pg_relation_filenode('idem_record') AS record_filenode,
       pg_relation_filenode('idem_result') AS result_filenode \gset

ALTER EXTENSION idempotency UPDATE;
SELECT extversion FROM pg_extension WHERE extname = 'idempotency';
-- The mode is kept; the update settles the completed records where the
-- mode keeps them (n1 moves to idem_result).  The new columns are added
-- without a rewrite of either table: the records in flight get no holder,
-- no checkpoint, no takeover and no remembering.
SELECT idem_durability();
SELECT * FROM where_is();
SELECT pg_relation_filenode('idem_record') = :record_filenode AS record_not_rewritten,
       pg_relation_filenode('idem_result') = :result_filenode AS result_not_rewritten;
SELECT c.relname, a.attname, format_type(a.atttypid, a.atttypmod) AS type, a.attnotnull,
       pg_get_expr(ad.adbin, ad.adrelid) AS "default"
  FROM pg_class c
  JOIN pg_attribute a ON a.attrelid = c.oid
  LEFT JOIN pg_attrdef ad ON ad.adrelid = c.oid AND ad.adnum = a.attnum
 WHERE c.relname IN ('idem_record', 'idem_result')
   AND a.attname IN ('holder', 'checkpoint', 'takeovers', 'forget_at')
 ORDER BY c.relname, a.attnum;
SELECT r.key, r.holder, r.checkpoint, r.takeovers, r.forget_at
  FROM (SELECT * FROM idem_record UNION ALL SELECT * FROM idem_result) r
 WHERE r.operation = 'upgrade' ORDER BY r.key;
-- The completed records replay; a different request is still refused.
SELECT status, response FROM idem_begin('upgrade', 'n1', '\x01');
SELECT status, response FROM idem_begin('upgrade', 'c1', '\x01');
SELECT status FROM idem_begin('upgrade', 'c1', '\x02');
\echo :SQLSTATE
-- p1, claimed under 1.3, is still held and finishes with its token.
SELECT state, checkpoint, takeovers FROM idem_inspect('upgrade', 'p1');
SELECT status FROM idem_begin('upgrade', 'p1', '\x01', in_flight => 'raise');
\echo :SQLSTATE
SELECT idem_finish('upgrade', 'p1', :p1_token, '"p1 under 1.4"');
SELECT status, response FROM idem_begin('upgrade', 'p1', '\x01');
-- p2, claimed under 1.3, checkpoints under 1.4 (which moves it to
-- idem_result), stalls, and is recovered by the next attempt.
SELECT idem_checkpoint('upgrade', 'p2', :p2_token, '{"step": 1}');
UPDATE idem_result SET expires_at = now() - interval '1 s'
 WHERE operation = 'upgrade' AND key = 'p2';
SELECT status, token > :p2_token AS greater_token, response
  FROM idem_begin('upgrade', 'p2', '\x01');
-- (the message names the token, which comes from the clock here: only
-- the SQLSTATE is shown)
\set VERBOSITY sqlstate
SELECT idem_finish('upgrade', 'p2', :p2_token, '"stale"');
\set VERBOSITY default
SELECT * FROM where_is();
SELECT state, checkpoint, takeovers FROM idem_inspect('upgrade', 'p2');
DROP FUNCTION where_is();

-- In the same mode as the fresh install above ('none'), the updated
-- installation has the same objects and the same tables.
SELECT idem_set_durability('none');
SELECT o AS missing_after_update_from_1_3 FROM fresh_objects
EXCEPT SELECT o FROM ext_objects() o;
SELECT o AS extra_after_update_from_1_3 FROM ext_objects() o
EXCEPT SELECT o FROM fresh_objects;
SELECT o AS missing_after_update_from_1_3 FROM fresh_tables
EXCEPT SELECT o FROM ext_tables() o;
SELECT o AS extra_after_update_from_1_3 FROM ext_tables() o
EXCEPT SELECT o FROM fresh_tables;

-- From 1.4 to 1.5: a remembered key (completed, past its ttl, kept for
-- remember so that a retry gets IK410) is counted as 'remembered' by
-- idem_stats and idem_monitor, not as 'expired'.  The 1.4 definitions on
-- the current library still count it as expired: idem_stats has no column
-- remembered there.
DROP EXTENSION idempotency;
CREATE EXTENSION idempotency VERSION '1.4';
SELECT idem_finish('upgrade', 'm1',
                   (idem_begin('upgrade', 'm1', '\x01', remember => '30 days')).token, '"m1"');
SELECT idem_finish('upgrade', 'm2', (idem_begin('upgrade', 'm2', '\x02')).token, '"m2"');
UPDATE idem_record SET expires_at = now() - interval '1 s' WHERE operation = 'upgrade';
SELECT * FROM idem_stats WHERE operation = 'upgrade';
SELECT state, records FROM idem_monitor WHERE operation = 'upgrade' ORDER BY state;
SELECT 'idem_begin(text, text, bytea, text, interval, interval, text, interval)'::regprocedure::oid AS begin_oid,
       'idem_inspect(text, text)'::regprocedure::oid AS inspect_oid \gset
ALTER EXTENSION idempotency UPDATE;
SELECT extversion FROM pg_extension WHERE extname = 'idempotency';
-- idem_begin and idem_inspect are the same functions (the same OIDs),
-- bound to the entry points of their argument and column lists
SELECT proname, prosrc FROM pg_proc
 WHERE oid IN (:begin_oid, :inspect_oid) ORDER BY proname;
SELECT * FROM idem_stats WHERE operation = 'upgrade';
SELECT state, records FROM idem_monitor WHERE operation = 'upgrade' ORDER BY state;
SELECT key, state FROM (VALUES ('m1'), ('m2')) k(key), idem_inspect('upgrade', key) ORDER BY key;
DELETE FROM idem_record WHERE operation = 'upgrade';
-- ... and then has the objects and tables of a fresh install.
SELECT idem_durability();
SELECT o AS missing_after_update_from_1_4 FROM fresh_objects
EXCEPT SELECT o FROM ext_objects() o;
SELECT o AS extra_after_update_from_1_4 FROM ext_objects() o
EXCEPT SELECT o FROM fresh_objects;
SELECT o AS missing_after_update_from_1_4 FROM fresh_tables
EXCEPT SELECT o FROM ext_tables() o;
SELECT o AS extra_after_update_from_1_4 FROM ext_tables() o
EXCEPT SELECT o FROM fresh_tables;

-- From 1.5 to 1.6 with claims in flight: s1, a takeover => 'session' claim
-- of this session, which lives; s2, one whose session has ended (its
-- holder names no session); p1, a lease claim.  The 1.5 definitions on the
-- current library: idem_stats already counts s2 as lapsed, as idem_inspect
-- and idem_begin take it; the 1.5 view idem_monitor, in SQL, still says
-- pending.  After the update every view agrees (s2 lapsed), idem_stats has
-- the column unknown, and s2 is taken over by the next claim.
DROP EXTENSION idempotency;
CREATE EXTENSION idempotency VERSION '1.5';
SELECT status FROM idem_begin('upgrade', 's1', NULL, lease => '1 h', takeover => 'session');
SELECT status FROM idem_begin('upgrade', 's2', NULL, lease => '1 h', takeover => 'session');
SELECT status FROM idem_begin('upgrade', 'p1', NULL, lease => '1 h');
UPDATE idem_record SET holder = 1 WHERE operation = 'upgrade' AND key = 's2';
SELECT * FROM idem_stats WHERE operation = 'upgrade';
SELECT state, records FROM idem_monitor WHERE operation = 'upgrade' ORDER BY state;
SELECT 'idem_begin(text, text, bytea, text, interval, interval, text, interval)'::regprocedure::oid AS begin_oid,
       'idem_inspect(text, text)'::regprocedure::oid AS inspect_oid \gset
ALTER EXTENSION idempotency UPDATE;
SELECT extversion FROM pg_extension WHERE extname = 'idempotency';
-- idem_begin and idem_inspect are the same functions (the same OIDs),
-- bound to the entry points of their argument and column lists
SELECT proname, prosrc FROM pg_proc
 WHERE oid IN (:begin_oid, :inspect_oid) ORDER BY proname;
SELECT * FROM idem_stats WHERE operation = 'upgrade';
SELECT state, records FROM idem_monitor WHERE operation = 'upgrade' ORDER BY state;
SELECT key, state FROM (VALUES ('p1'), ('s1'), ('s2')) k(key), idem_inspect('upgrade', key) ORDER BY key;
SELECT status FROM idem_begin('upgrade', 's2', NULL, in_flight => 'raise');
DELETE FROM idem_record WHERE operation = 'upgrade';
-- ... and then, in the fresh install's mode, has its objects and tables.
SELECT idem_set_durability('none');
SELECT o AS missing_after_update_from_1_5 FROM fresh_objects
EXCEPT SELECT o FROM ext_objects() o;
SELECT o AS extra_after_update_from_1_5 FROM ext_objects() o
EXCEPT SELECT o FROM fresh_objects;
SELECT o AS missing_after_update_from_1_5 FROM fresh_tables
EXCEPT SELECT o FROM ext_tables() o;
SELECT o AS extra_after_update_from_1_5 FROM ext_tables() o
EXCEPT SELECT o FROM fresh_tables;

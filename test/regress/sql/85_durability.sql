--
-- 85_durability: the three durability modes.  'completed' keeps claims in
-- the unlogged idem_record and moves a record to the logged idem_result in
-- the transaction that finishes it; 'none' and 'all' keep every record in
-- idem_record (unlogged, logged).
--
\set VERBOSITY default

CREATE FUNCTION where_is(k text) RETURNS text LANGUAGE sql AS $$
  SELECT coalesce((SELECT 'idem_record ' || CASE WHEN completed_at IS NULL THEN 'pending' ELSE 'completed' END
                     FROM idem_record WHERE operation = 'dur' AND key = k), '') ||
         coalesce((SELECT 'idem_result ' || CASE WHEN completed_at IS NULL THEN 'pending' ELSE 'completed' END
                     FROM idem_result WHERE operation = 'dur' AND key = k), '')
$$;
CREATE FUNCTION persistence() RETURNS text LANGUAGE sql AS $$
  SELECT string_agg(relname || '=' || relpersistence::text, ' ' ORDER BY relname)
    FROM pg_class WHERE relname IN ('idem_record', 'idem_result')
$$;

-- The mode is the tables' persistence.
SELECT idem_durability(), persistence();
SELECT idem_set_durability('completed');
SELECT idem_durability(), persistence();

-- A claim is in idem_record; its finish moves it to idem_result, in the
-- finishing transaction: a rollback leaves the claim where it was.
SELECT token AS c1 FROM idem_begin('dur', 'c1', NULL) \gset
SELECT where_is('c1');
BEGIN;
SELECT idem_finish('dur', 'c1', :c1, '"one"');
SELECT where_is('c1');
ROLLBACK;
SELECT where_is('c1');
SELECT idem_finish('dur', 'c1', :c1, '"one"');
SELECT where_is('c1');
-- a replay finds it there; the token is fenced off
SELECT status, response FROM idem_begin('dur', 'c1', NULL);
SELECT idem_finish('dur', 'c1', :c1, '"again"');
\echo :SQLSTATE
SELECT state, token = :c1 AS same_token FROM idem_inspect('dur', 'c1');

-- In one transaction, as the in-transaction shape does.
BEGIN;
SELECT token AS c2 FROM idem_begin('dur', 'c2', NULL) \gset
SELECT idem_finish('dur', 'c2', :c2, '"two"');
SELECT where_is('c2');
COMMIT;
SELECT status, response FROM idem_begin('dur', 'c2', NULL);

-- An abort and a renew stay in idem_record.
SELECT token AS c3 FROM idem_begin('dur', 'c3', NULL) \gset
SELECT idem_renew('dur', 'c3', :c3, '1 min') > now() AS renewed;
SELECT where_is('c3');
SELECT idem_abort('dur', 'c3', :c3);
SELECT where_is('c3') = '' AS gone;

-- A completed record past its retention is taken over by a new claim: it
-- leaves idem_result, the claim is in idem_record, with a greater token.
UPDATE idem_result SET expires_at = now() - interval '1 s'
 WHERE operation = 'dur' AND key = 'c1';
SELECT status, token > :c1 AS greater FROM idem_begin('dur', 'c1', NULL);
SELECT where_is('c1');

-- Statistics and inspection see both tables.
SELECT * FROM idem_stats WHERE operation = 'dur';
SELECT state FROM idem_inspect('dur', 'c2');

-- A switch moves the completed records to where the new mode keeps them.
SELECT idem_set_durability('none');
SELECT idem_durability(), persistence(), where_is('c2');
SELECT status, response FROM idem_begin('dur', 'c2', NULL);
SELECT idem_set_durability('completed');
SELECT where_is('c2');
SELECT idem_set_durability('all');
SELECT idem_durability(), persistence(), where_is('c2');
-- idem_set_logged is an alias: false is 'none', true is 'all'
SELECT idem_set_logged(false);
SELECT idem_durability();
SELECT idem_set_logged(true);
SELECT idem_durability();
SELECT idem_set_durability('COMPLETED');
SELECT idem_durability();

-- Expired records are purged from both tables.
UPDATE idem_result SET expires_at = now() - interval '1 s' WHERE operation = 'dur';
UPDATE idem_record SET expires_at = now() - interval '1 s' WHERE operation = 'dur';
-- (other files' records may have expired by now too: count only ours)
SELECT idem_purge() >= 2 AS purged_ours;
SELECT count(*) AS left_over FROM idem_record WHERE operation = 'dur';
SELECT count(*) AS left_over FROM idem_result WHERE operation = 'dur';

-- Bad input changes nothing.
SELECT idem_set_durability('some');
\echo :SQLSTATE
SELECT idem_set_durability(NULL);
\echo :SQLSTATE
SELECT idem_durability();
-- Only the extension's owner may switch (or read) the mode.
SET ROLE regress_idem_nobody;
SELECT idem_set_durability('none');
\echo :SQLSTATE
RESET ROLE;

SELECT idem_set_durability('none');
DROP FUNCTION where_is(text);
DROP FUNCTION persistence();

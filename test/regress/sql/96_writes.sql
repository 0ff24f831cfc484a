--
-- 96_writes: the writes of one transaction to the record table, with DDL,
-- triggers, savepoints and errors between them.  Each write builds its own
-- executor state and frees it: whatever the transaction does to the table
-- between two writes is seen by the next one, and nothing a write holds
-- outlives it.
--
\set VERBOSITY default

DROP EXTENSION idempotency;
CREATE EXTENSION idempotency;
SELECT idem_set_durability('none');
CREATE EXTENSION IF NOT EXISTS amcheck;

-- Each index of idem_record holds exactly the table's rows: amcheck's
-- heapallindexed check raises an error otherwise.
CREATE FUNCTION check_indexes() RETURNS SETOF text
LANGUAGE sql AS $$
  SELECT format('%s: checked%s', c.relname, bt_index_check(c.oid, true))
    FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
   WHERE i.indrelid = 'idem_record'::regclass
   ORDER BY c.relname
$$;

-- 1. An index created in the transaction between a claim and its finish:
-- the finish writes it (a HOT update is not possible once the index covers
-- a changed column).
BEGIN;
SELECT (idem_begin('writes', 'k1', NULL)).token AS t1 \gset
CREATE INDEX writes_completed ON idem_record (completed_at);
SELECT idem_finish('writes', 'k1', :t1, '"one"');
SELECT (idem_begin('writes', 'k2', NULL)).status;
COMMIT;
SELECT * FROM check_indexes();
SELECT count(*) FROM idem_record WHERE completed_at IS NOT NULL AND operation = 'writes';
-- ... and dropped in the transaction after writes: no write holds a
-- reference that makes DROP INDEX refuse
BEGIN;
SELECT (idem_begin('writes', 'k3', NULL)).token AS t3 \gset
DROP INDEX writes_completed;
SELECT idem_finish('writes', 'k3', :t3, '"three"');
COMMIT;
SELECT * FROM check_indexes();

-- 2. A column of the DBA's added between a claim and its finish: the finish
-- keeps the value the claim's version got (the default), a claim after the
-- ALTER fills it with its default.
BEGIN;
SELECT (idem_begin('writes', 'k4', NULL)).token AS t4 \gset
ALTER TABLE idem_record ADD COLUMN note text DEFAULT 'dba';
SELECT idem_finish('writes', 'k4', :t4, '"four"');
ALTER TABLE idem_record ALTER COLUMN note SET DEFAULT 'dba2';
SELECT (idem_begin('writes', 'k5', NULL)).status;
COMMIT;
SELECT key, note FROM idem_record WHERE operation = 'writes' AND key IN ('k4', 'k5') ORDER BY key;
ALTER TABLE idem_record DROP COLUMN note;

-- 3. A trigger created between a claim and its finish is honoured by the
-- finish: one that skips the write is caught (09000), and nothing changes.
CREATE FUNCTION skip_row() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  RETURN NULL;
END $$;
BEGIN;
SELECT (idem_begin('writes', 'k6', NULL)).token AS t6 \gset
CREATE TRIGGER skip BEFORE UPDATE ON idem_record FOR EACH ROW EXECUTE FUNCTION skip_row();
SELECT idem_finish('writes', 'k6', :t6, '"six"');
ROLLBACK;
SELECT count(*) FROM idem_record WHERE operation = 'writes' AND key = 'k6';
-- ... and dropped again: the next write of the same transaction is not
-- skipped
BEGIN;
SELECT (idem_begin('writes', 'k6', NULL)).token AS t6 \gset
CREATE TRIGGER skip BEFORE UPDATE ON idem_record FOR EACH ROW EXECUTE FUNCTION skip_row();
DROP TRIGGER skip ON idem_record;
SELECT idem_finish('writes', 'k6', :t6, '"six"');
COMMIT;
SELECT (idem_begin('writes', 'k6', NULL)).response;

-- 4. A write that fails part-way inside a savepoint (a BEFORE trigger
-- raises in the middle of it): the transaction goes on writing, without a
-- warning about a leaked reference or pin.
CREATE FUNCTION fail_on_bad() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF NEW.key = 'bad' THEN
    RAISE EXCEPTION 'bad key';
  END IF;
  RETURN NEW;
END $$;
CREATE TRIGGER fail_on_bad BEFORE INSERT OR UPDATE ON idem_record
  FOR EACH ROW EXECUTE FUNCTION fail_on_bad();
BEGIN;
SELECT (idem_begin('writes', 'k7', NULL)).token AS t7 \gset
SAVEPOINT s;
SELECT idem_begin('writes', 'bad', NULL);
ROLLBACK TO SAVEPOINT s;
SELECT idem_finish('writes', 'k7', :t7, '"seven"');
-- the same in PL/pgSQL, many times: an exception block is a savepoint
DO $$
BEGIN
  FOR i IN 1..50 LOOP
    BEGIN
      PERFORM idem_begin('writes', 'bad', NULL);
    EXCEPTION WHEN raise_exception THEN
      NULL;
    END;
    PERFORM idem_finish('writes', 'loop' || i,
                        (idem_begin('writes', 'loop' || i, NULL)).token, '"l"');
  END LOOP;
END $$;
COMMIT;
SELECT count(*) FROM idem_record WHERE operation = 'writes' AND completed_at IS NOT NULL;
DROP TRIGGER fail_on_bad ON idem_record;
-- a savepoint whose write was rolled back, not part-way
BEGIN;
SAVEPOINT s;
SELECT (idem_begin('writes', 'k8', NULL)).status;
ROLLBACK TO SAVEPOINT s;
SELECT idem_finish('writes', 'k8', (idem_begin('writes', 'k8', NULL)).token, '"eight"');
COMMIT;
SELECT (idem_begin('writes', 'k8', NULL)).response;

-- 5. A write from within a write: a trigger on idem_record that claims
-- another key.  The inner write has a state of its own.
CREATE FUNCTION claim_audit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF NEW.operation = 'writes' AND NEW.key = 'outer' THEN
    PERFORM idem_begin('writes', 'inner', NULL);
  END IF;
  RETURN NEW;
END $$;
CREATE TRIGGER claim_audit AFTER INSERT ON idem_record
  FOR EACH ROW EXECUTE FUNCTION claim_audit();
SELECT (idem_begin('writes', 'outer', NULL)).status;
DROP TRIGGER claim_audit ON idem_record;
SELECT key FROM idem_record WHERE operation = 'writes' AND key IN ('outer', 'inner') ORDER BY key;

-- 6. A row trigger whose function is SECURITY DEFINER with a setting of its
-- own (as pg_repack's log trigger is): its call information, filled in at
-- the claim's write, is still good at the finish's, a statement later.
CREATE TABLE writes_log (key text, at text);
CREATE FUNCTION log_write() RETURNS trigger LANGUAGE plpgsql
  SECURITY DEFINER SET search_path = pg_catalog, public AS $$
BEGIN
  INSERT INTO writes_log VALUES (NEW.key, TG_OP);
  RETURN NEW;
END $$;
CREATE TRIGGER log_write AFTER INSERT OR UPDATE ON idem_record
  FOR EACH ROW EXECUTE FUNCTION log_write();
BEGIN;
SELECT (idem_begin('writes', 'sd', NULL)).token AS tsd \gset
SELECT repeat('x', 100000) IS NOT NULL AS other_work;
SELECT idem_finish('writes', 'sd', :tsd, '"sd"');
SELECT idem_finish('writes', 'sd2', (idem_begin('writes', 'sd2', NULL)).token, '"sd2"');
COMMIT;
DROP TRIGGER log_write ON idem_record;
SELECT key, at FROM writes_log ORDER BY key, at;
DROP TABLE writes_log;
DROP FUNCTION log_write();

-- 7. TRUNCATE and a rewrite in the transaction after writes, then more
-- writes: no write holds a reference that makes them refuse.
BEGIN;
SELECT (idem_begin('writes', 'k9', NULL)).status;
TRUNCATE idem_record;
SELECT idem_finish('writes', 'k9', (idem_begin('writes', 'k9', NULL)).token, '"nine"');
CLUSTER idem_record USING idem_record_pkey;
SELECT (idem_begin('writes', 'k10', NULL)).status;
COMMIT;
SELECT 'k9' AS key, state FROM idem_inspect('writes', 'k9') UNION ALL
SELECT 'k10', state FROM idem_inspect('writes', 'k10');
SELECT * FROM check_indexes();

-- 8. Many writes in one transaction leave nothing behind: from 200 keys
-- to 20,200 (40,000 writes more) the backend's memory grows by less than
-- 1 MB -- not counting the combo command ids, which any transaction that
-- updates its own rows needs (an executor state left behind would be
-- kilobytes a write).
BEGIN;
SELECT count(idem_finish('writes', 'many' || i,
                         (idem_begin('writes', 'many' || i, NULL)).token, '"m"'))
  FROM generate_series(1, 200) i;
SELECT sum(total_bytes) AS bytes_after_200 FROM pg_backend_memory_contexts
 WHERE name <> 'Combo CIDs' \gset
SELECT count(idem_finish('writes', 'more' || i,
                         (idem_begin('writes', 'more' || i, NULL)).token, '"m"'))
  FROM generate_series(1, 20000) i;
SELECT sum(total_bytes) - :bytes_after_200 < 1024 * 1024 AS no_growth
  FROM pg_backend_memory_contexts WHERE name <> 'Combo CIDs';
COMMIT;

-- 9. CREATE EXTENSION and claims rolled back in the same transaction, by a
-- savepoint and by a PL/pgSQL exception block: no reference to a table is
-- left behind (no WARNING about a relcache entry's refcount at the end).
DROP EXTENSION idempotency;
BEGIN;
CREATE EXTENSION idempotency;
SAVEPOINT s;
SELECT status FROM idem_begin('writes', 'sp1', NULL);
ROLLBACK TO SAVEPOINT s;
DO $$
BEGIN
  PERFORM idem_begin('writes', 'sp2', NULL);
  RAISE EXCEPTION 'undo';
EXCEPTION WHEN raise_exception THEN
  NULL;
END $$;
SELECT status FROM idem_begin('writes', 'sp3', NULL);
COMMIT;
SELECT key FROM idem_record WHERE operation = 'writes' ORDER BY key;
SELECT idem_set_durability('none');

DROP FUNCTION check_indexes();
DROP FUNCTION skip_row();
DROP FUNCTION fail_on_bad();
DROP FUNCTION claim_audit();

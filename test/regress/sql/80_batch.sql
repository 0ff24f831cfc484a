--
-- 80_batch: one transaction claims many keys (a batch procedure).
--
-- Per-key locks held until commit would fill the shared lock table: it has
-- room for max_locks_per_transaction * (max_connections +
-- max_prepared_transactions) locks, a few thousand under the defaults.  The
-- extension holds a key's lock only while it looks at and writes the
-- record, so 100000 claims in one transaction succeed with the defaults.
--
\set VERBOSITY default
SHOW max_locks_per_transaction;

BEGIN;
DO $$
DECLARE
  c idem_claim;
BEGIN
  FOR i IN 1 .. 100000 LOOP
    c := idem_begin('batch', 'key-' || i, NULL);
    IF c.status <> 'new' THEN
      RAISE EXCEPTION 'key-%: status %', i, c.status;
    END IF;
    PERFORM idem_finish('batch', 'key-' || i, c.token, to_jsonb(i));
  END LOOP;
END
$$;
SELECT count(*) AS claimed FROM idem_record WHERE operation = 'batch';
-- Not even this transaction holds an advisory lock any more.
SELECT count(*) AS advisory_locks_held
  FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid();
COMMIT;
-- After commit, no idempotency lock is left anywhere.
SELECT count(*) AS advisory_locks FROM pg_locks
 WHERE locktype = 'advisory'
   AND database = (SELECT oid FROM pg_database WHERE datname = current_database());

-- The batch's records are all there and replay.
SELECT count(*) AS completed FROM idem_record
 WHERE operation = 'batch' AND completed_at IS NOT NULL;
SELECT k, r.status, r.response
  FROM unnest(ARRAY[1, 50000, 100000]) k,
       LATERAL idem_begin('batch', 'key-' || k, NULL) r
 ORDER BY k;

-- The same batch under 'raise', with nothing pending: all replays.
BEGIN;
DO $$
DECLARE
  c idem_claim;
  replays int := 0;
BEGIN
  FOR i IN 1 .. 100000 LOOP
    c := idem_begin('batch', 'key-' || i, NULL, in_flight => 'raise');
    IF c.status = 'replay' AND c.response = to_jsonb(i) THEN
      replays := replays + 1;
    END IF;
  END LOOP;
  RAISE NOTICE 'replays: %', replays;
END
$$;
COMMIT;

-- Remove the batch (directly, as a superuser) so that later files work on a
-- small table.
DELETE FROM idem_record WHERE operation = 'batch';

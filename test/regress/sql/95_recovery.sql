--
-- 95_recovery: what version 1.4 adds -- checkpoints and the status
-- 'recover', remembered keys, the settings idempotency.takeover and
-- idempotency.remember, idem_inspect's new columns, the tables' shape and
-- verified writes.
--
-- Time: leases and retentions are made to pass by moving a record's
-- expires_at (or forget_at) into the past by hand, as a superuser, instead
-- of waiting.
--
\set VERBOSITY default

-- 90_upgrade leaves an updated installation behind: start from a new one,
-- in mode 'none' (every record in idem_record) as the files up to 80_batch
-- do; the part on mode 'completed' switches.
DROP EXTENSION idempotency;
CREATE EXTENSION idempotency;
SELECT idem_set_durability('none');

-- IK412 messages name the token: after a first claim (which starts the
-- token epoch), move the count to a known value, as 10_claim does; the
-- next token is (1 << 32) + 95000001 = 4389967297.
SELECT idem_abort('recovery', 'first', (idem_begin('recovery', 'first', NULL)).token);
SELECT setval('idem_token_seq', (1::int8 << 32) + 95000000) AS token_base;

-- The record of a key as idem_inspect shows it, and which table holds it.
CREATE FUNCTION rec(k text)
RETURNS TABLE (in_table text, state text, checkpoint jsonb, takeovers int4,
               response jsonb)
LANGUAGE sql AS $$
  SELECT CASE WHEN EXISTS (SELECT FROM idem_record r
                            WHERE r.operation = 'recovery' AND r.key = k) THEN 'idem_record'
              WHEN EXISTS (SELECT FROM idem_result r
                            WHERE r.operation = 'recovery' AND r.key = k) THEN 'idem_result'
         END,
         i.state, i.checkpoint, i.takeovers, i.response
    FROM idem_inspect('recovery', k) i
$$;
-- Make the lease of a pending claim lapse, wherever it is.
CREATE FUNCTION lapse(k text) RETURNS void LANGUAGE sql AS $$
  UPDATE idem_record SET expires_at = now() - interval '1 s'
   WHERE operation = 'recovery' AND key = k AND completed_at IS NULL;
  UPDATE idem_result SET expires_at = now() - interval '1 s'
   WHERE operation = 'recovery' AND key = k AND completed_at IS NULL;
$$;

--
-- Checkpoints and 'recover'.
--

-- A claim has no checkpoint and has not been taken over.
SELECT token AS c1_first FROM idem_begin('recovery', 'c1', '\x01') \gset
SELECT * FROM rec('c1');
-- idem_checkpoint records progress on the caller's pending claim; the last
-- one is kept.  The claim stays pending under its lease: a duplicate is
-- still refused (IK409 under 'raise').
SELECT idem_checkpoint('recovery', 'c1', :c1_first, '{"step": 1}');
SELECT idem_checkpoint('recovery', 'c1', :c1_first, '{"step": 2, "charge": "ch_1"}');
SELECT * FROM rec('c1');
SELECT status FROM idem_begin('recovery', 'c1', '\x01', in_flight => 'raise');
\echo :SQLSTATE

-- The lease lapses: the next attempt takes the key over with status
-- 'recover', a greater token, and the last checkpoint's state as the
-- response.  The record keeps the checkpoint and counts one takeover.
SELECT lapse('c1');
SELECT state FROM idem_inspect('recovery', 'c1');
SELECT status, token > :c1_first AS greater_token, response
  FROM idem_begin('recovery', 'c1', '\x01');
SELECT token AS c1_second FROM idem_record WHERE operation = 'recovery' AND key = 'c1' \gset
SELECT * FROM rec('c1');

-- The first worker's token no longer holds the key: its checkpoint and its
-- finish are refused with IK412, its abort returns false, and the record is
-- unchanged.
SELECT idem_checkpoint('recovery', 'c1', :c1_first, '{"step": 3, "by": "first"}');
\echo :SQLSTATE
SELECT idem_finish('recovery', 'c1', :c1_first, '"first"');
\echo :SQLSTATE
SELECT idem_abort('recovery', 'c1', :c1_first);
SELECT (SELECT token FROM idem_inspect('recovery', 'c1')) = :c1_second AS second_holds,
       * FROM rec('c1');

-- The second worker goes on, checkpoints, and stalls too: a second takeover
-- recovers again, from the second worker's checkpoint, with takeovers = 2.
SELECT idem_checkpoint('recovery', 'c1', :c1_second, '{"step": 3, "by": "second"}');
SELECT lapse('c1');
SELECT status, token > :c1_second AS greater_token, response
  FROM idem_begin('recovery', 'c1', '\x01');
SELECT token AS c1_third FROM idem_record WHERE operation = 'recovery' AND key = 'c1' \gset
SELECT * FROM rec('c1');

-- The finish stores the response and clears the checkpoint: a retry
-- replays the response, not the state.
SELECT idem_finish('recovery', 'c1', :c1_third, '{"charge": "ch_1", "done": true}');
SELECT * FROM rec('c1');
SELECT * FROM idem_begin('recovery', 'c1', '\x01');
-- A checkpoint on the completed record: IK412, whatever token.
SELECT idem_checkpoint('recovery', 'c1', :c1_third, '{"step": 4}');
\echo :SQLSTATE
SELECT checkpoint, response FROM rec('c1');

-- Without a checkpoint a takeover is 'new', as in 1.3 (the takeover is
-- still counted).
SELECT token AS c2_first FROM idem_begin('recovery', 'c2', NULL) \gset
SELECT lapse('c2');
SELECT status, token > :c2_first AS greater_token, response
  FROM idem_begin('recovery', 'c2', NULL);
SELECT * FROM rec('c2');

-- An abort of a checkpointed claim releases the key, checkpoint and all:
-- the next claim is 'new', not 'recover'.
SELECT token AS c3_first FROM idem_begin('recovery', 'c3', NULL) \gset
SELECT idem_checkpoint('recovery', 'c3', :c3_first, '{"step": 1}');
SELECT idem_abort('recovery', 'c3', :c3_first);
SELECT count(*) AS records FROM idem_record WHERE operation = 'recovery' AND key = 'c3';
SELECT status, response FROM idem_begin('recovery', 'c3', NULL);
SELECT * FROM rec('c3');

-- A checkpoint that rolls back was never made.
SELECT token AS c4 FROM idem_begin('recovery', 'c4', NULL) \gset
SELECT idem_checkpoint('recovery', 'c4', :c4, '{"step": 1}');
BEGIN;
SELECT idem_checkpoint('recovery', 'c4', :c4, '{"step": 2}');
ROLLBACK;
SELECT checkpoint FROM rec('c4');

-- Bad calls change nothing: a token never issued for the key, a key with
-- no record, another role's key (records are per role), a NULL state
-- (22004, like every NULL argument), a state larger than
-- idempotency.max_response_size (54000).
SELECT idem_checkpoint('recovery', 'c4', :c4 + 1000, '{"step": 9}');
\echo :SQLSTATE
SELECT idem_checkpoint('recovery', 'no-such-key', :c4, '{"step": 9}');
\echo :SQLSTATE
SET ROLE regress_idem_a;
SELECT idem_checkpoint('recovery', 'c4', :c4, '{"step": 9}');
\echo :SQLSTATE
RESET ROLE;
SELECT idem_checkpoint('recovery', 'c4', :c4, NULL);
\echo :SQLSTATE
SELECT idem_checkpoint('recovery', 'c4', NULL, '{"step": 9}');
\echo :SQLSTATE
SET idempotency.max_response_size = 100;
SELECT idem_checkpoint('recovery', 'c4', :c4, jsonb_build_object('blob', repeat('x', 200)));
\echo :SQLSTATE
RESET idempotency.max_response_size;
SELECT * FROM rec('c4');
SELECT idem_abort('recovery', 'c4', :c4);

--
-- Mode 'completed': a claim with a checkpoint is kept in the logged
-- idem_result (it must survive a crash); a claim without one stays in the
-- unlogged idem_record.
--
SELECT idem_set_durability('completed');
SELECT token AS d1_first FROM idem_begin('recovery', 'd1', NULL) \gset
SELECT in_table, state FROM rec('d1');
SELECT idem_checkpoint('recovery', 'd1', :d1_first, '{"step": 1}');
SELECT in_table, state, checkpoint FROM rec('d1');
-- a checkpoint rolled back leaves the claim where it was
SELECT token AS d2 FROM idem_begin('recovery', 'd2', NULL) \gset
BEGIN;
SELECT idem_checkpoint('recovery', 'd2', :d2, '{"step": 1}');
SELECT in_table FROM rec('d2');
ROLLBACK;
SELECT in_table, checkpoint FROM rec('d2');
-- a takeover there recovers, and the claim stays in idem_result ...
SELECT lapse('d1');
SELECT status, token > :d1_first AS greater_token, response
  FROM idem_begin('recovery', 'd1', NULL);
SELECT token AS d1_second FROM idem_result WHERE operation = 'recovery' AND key = 'd1' \gset
SELECT * FROM rec('d1');
SELECT idem_checkpoint('recovery', 'd1', :d1_first, '{"step": 2}');
\echo :SQLSTATE
-- ... and its finish leaves it there, completed, the checkpoint cleared.
SELECT idem_finish('recovery', 'd1', :d1_second, '"d1 done"');
SELECT * FROM rec('d1');
SELECT status, response FROM idem_begin('recovery', 'd1', NULL);
-- An abort of a checkpointed claim deletes it from idem_result.
SELECT token AS d3 FROM idem_begin('recovery', 'd3', NULL) \gset
SELECT idem_checkpoint('recovery', 'd3', :d3, '{"step": 1}');
SELECT idem_abort('recovery', 'd3', :d3);
SELECT count(*) AS records FROM (SELECT FROM idem_record WHERE operation = 'recovery' AND key = 'd3'
                                 UNION ALL
                                 SELECT FROM idem_result WHERE operation = 'recovery' AND key = 'd3') r;
-- A switch of mode moves checkpointed claims with the completed records:
-- back to idem_record in 'none', to idem_result in 'completed'.
SELECT idem_checkpoint('recovery', 'd2', :d2, '{"step": 1}');
SELECT in_table FROM rec('d2');
SELECT idem_set_durability('none');
SELECT in_table, state, checkpoint FROM rec('d2');
SELECT idem_set_durability('completed');
SELECT in_table, state, checkpoint FROM rec('d2');
SELECT idem_abort('recovery', 'd2', :d2);
SELECT idem_set_durability('none');

--
-- Remembered keys: remember => interval keeps a completed key known after
-- its response expired (at the ttl), until completed_at + remember.  A
-- retry then gets IK410 (same fingerprint) or IK422 (another one) instead
-- of running the request again.
--
SELECT token AS m1 FROM idem_begin('recovery', 'm1', '\x01', ttl => '1 min', remember => '1 h') \gset
SELECT idem_finish('recovery', 'm1', :m1, '{"charge": "ch_m1"}');
SELECT state, remembered_until - completed_at AS remembered, expires_at - completed_at AS ttl
  FROM idem_inspect('recovery', 'm1');
-- While its response is kept, a retry replays it.
SELECT status, response FROM idem_begin('recovery', 'm1', '\x01');
-- The ttl passes.  (The times are set to fixed values, so that the DETAIL
-- below is stable: completed 2020-01-01 12:00 UTC, response kept for a
-- minute, remembered until 2100.)
UPDATE idem_record
   SET completed_at = '2020-01-01 12:00:00+00', expires_at = '2020-01-01 12:01:00+00',
       forget_at = '2100-01-01 00:00:00+00'
 WHERE operation = 'recovery' AND key = 'm1';
SELECT state, response, remembered_until FROM idem_inspect('recovery', 'm1');
-- The same request: IK410 (it ran; its response is gone), under either
-- in_flight policy.  Another request with the key: IK422.
SELECT status FROM idem_begin('recovery', 'm1', '\x01');
\echo :SQLSTATE
SELECT status FROM idem_begin('recovery', 'm1', '\x01', in_flight => 'raise');
\echo :SQLSTATE
SELECT status FROM idem_begin('recovery', 'm1', '\x02');
\echo :SQLSTATE
-- idem_purge drops the response at the ttl and keeps the row (it counts
-- only deleted rows); the key is still refused.
SELECT idem_purge() AS purged;
SELECT count(*) AS rows, bool_and(response IS NULL) AS response_dropped
  FROM idem_record WHERE operation = 'recovery' AND key = 'm1';
SELECT state, response FROM idem_inspect('recovery', 'm1');
SELECT status FROM idem_begin('recovery', 'm1', '\x01');
\echo :SQLSTATE
-- At completed_at + remember the key is forgotten: 'expired', purged, and
-- then new again, with a greater token.
UPDATE idem_record SET forget_at = now() - interval '1 s'
 WHERE operation = 'recovery' AND key = 'm1';
SELECT state FROM idem_inspect('recovery', 'm1');
SELECT idem_purge() AS purged;
SELECT count(*) AS rows FROM idem_record WHERE operation = 'recovery' AND key = 'm1';
SELECT status, token > :m1 AS greater_token FROM idem_begin('recovery', 'm1', '\x02');
-- Without remember, a key past its ttl is new at once (as in 1.3), and
-- idem_inspect says 'expired'.
SELECT idem_finish('recovery', 'm2', (idem_begin('recovery', 'm2', NULL, ttl => '1 min')).token, '1');
SELECT remembered_until FROM idem_inspect('recovery', 'm2');
UPDATE idem_record SET expires_at = now() - interval '1 s'
 WHERE operation = 'recovery' AND key = 'm2';
SELECT state FROM idem_inspect('recovery', 'm2');
SELECT status FROM idem_begin('recovery', 'm2', NULL);

-- remember must be 0 (off) or not shorter than the ttl: 22023; equal is
-- fine.  Nothing is claimed by a refused call.
SELECT status FROM idem_begin('recovery', 'm3', NULL, ttl => '1 h', remember => '30 min');
\echo :SQLSTATE
SELECT status FROM idem_begin('recovery', 'm3', NULL, ttl => '1 h', remember => '-1 h');
\echo :SQLSTATE
SELECT count(*) AS records FROM idem_record WHERE operation = 'recovery' AND key = 'm3';
SELECT idem_finish('recovery', 'm3',
                   (idem_begin('recovery', 'm3', NULL, ttl => '1 h', remember => '1 h')).token, '1');
SELECT remembered_until - expires_at AS after_ttl FROM idem_inspect('recovery', 'm3');

--
-- Settings.
--

-- The defaults: takeover 'lease' (as in 1.3), remember 0 (off).
SHOW idempotency.takeover;
SHOW idempotency.remember;
SELECT name, setting, unit, context, vartype, min_val, max_val, enumvals
  FROM pg_settings
 WHERE name IN ('idempotency.takeover', 'idempotency.remember')
 ORDER BY name;
-- takeover: 'lease' or 'session', in any case; anything else is 22023, as
-- is an unknown takeover argument.
SET idempotency.takeover = 'Session';
SHOW idempotency.takeover;
SET idempotency.takeover = 'bogus';
\echo :SQLSTATE
SHOW idempotency.takeover;
RESET idempotency.takeover;
SELECT status FROM idem_begin('recovery', 's0', NULL, takeover => 'bogus');
\echo :SQLSTATE
SELECT status FROM idem_begin('recovery', 's0', NULL, takeover => NULL);
SELECT holder IS NULL AS no_holder FROM idem_record WHERE operation = 'recovery' AND key = 's0';
-- A 'session' claim names this session as its holder; the session holds
-- two session-level locks until it exits: the advisory lock of class
-- 0x494D = 18765 and its anchor, class 0x494F = 18767.
SELECT status FROM idem_begin('recovery', 's1', NULL, takeover => 'session');
SELECT holder IS NOT NULL AS has_holder FROM idem_record WHERE operation = 'recovery' AND key = 's1';
SELECT locktype, objsubid, mode, granted FROM pg_locks
 WHERE locktype = 'advisory' AND pid = pg_backend_pid() ORDER BY objsubid;
-- remember: seconds, never negative (the message's range differs between
-- PostgreSQL versions: only the SQLSTATE is shown); the setting is the
-- default of the argument, which wins when given (0 turns it off).
\set VERBOSITY sqlstate
SET idempotency.remember = -1;
\set VERBOSITY default
SET idempotency.remember = '90min';
SHOW idempotency.remember;
SELECT idem_finish('recovery', 'r1', (idem_begin('recovery', 'r1', NULL, ttl => '1 min')).token, '1');
SELECT remembered_until - completed_at AS remembered FROM idem_inspect('recovery', 'r1');
SELECT idem_finish('recovery', 'r2', (idem_begin('recovery', 'r2', NULL, ttl => '1 min', remember => '0')).token, '1');
SELECT remembered_until FROM idem_inspect('recovery', 'r2');
-- the setting shorter than the ttl (here the default, 24 h) adds nothing
-- to the call: its key is kept for the ttl, as with 0; an argument that
-- short is still an error
SELECT status FROM idem_begin('recovery', 'r3', NULL);
SELECT remembered_until FROM idem_inspect('recovery', 'r3');
SELECT status FROM idem_begin('recovery', 'r3b', NULL, remember => '1 min');
\echo :SQLSTATE
RESET idempotency.remember;

--
-- idem_inspect: the new columns, and every state.
--
SELECT p.proargnames[12:] AS new_columns
  FROM pg_proc p WHERE p.oid = 'idem_inspect(text, text)'::regprocedure;
SELECT k, i.state, i.checkpoint, i.takeovers, i.remembered_until IS NOT NULL AS remembered
  FROM unnest(ARRAY['c1', 'c2', 'm1', 'm3']) k, idem_inspect('recovery', k) i
 ORDER BY k;
SELECT lapse('c2');
UPDATE idem_record SET expires_at = now() - interval '1 s'
 WHERE operation = 'recovery' AND key IN ('m3', 'r1');
UPDATE idem_record SET forget_at = now() - interval '1 s'
 WHERE operation = 'recovery' AND key = 'r1';
SELECT k, i.state
  FROM unnest(ARRAY['c1', 'c2', 'm1', 'm3', 'r1', 'no-such-key']) k
  LEFT JOIN LATERAL idem_inspect('recovery', k) i ON true
 ORDER BY k;

--
-- The tables' shape.  Each change is made in a transaction that is rolled
-- back, so the table is restored; a record made before (c1) shows that
-- nothing else changed.
--

-- A DBA may add columns that are nullable or have a default: claims work,
-- a write fills the default, an update of the record keeps the DBA's value.
BEGIN;
ALTER TABLE idem_record ADD COLUMN note text, ADD COLUMN origin text DEFAULT 'dba';
SELECT token AS x1 FROM idem_begin('recovery', 'x1', NULL) \gset
SELECT note, origin FROM idem_record WHERE operation = 'recovery' AND key = 'x1';
UPDATE idem_record SET note = 'checked', origin = 'mine'
 WHERE operation = 'recovery' AND key = 'x1';
SELECT idem_checkpoint('recovery', 'x1', :x1, '{"step": 1}');
SELECT idem_renew('recovery', 'x1', :x1, '1 min') > now() AS renewed;
SELECT idem_finish('recovery', 'x1', :x1, '"x1"');
SELECT note, origin, response FROM idem_record WHERE operation = 'recovery' AND key = 'x1';
SELECT status, response FROM idem_begin('recovery', 'x1', NULL);
ROLLBACK;
-- A NOT NULL column without a default: ALTER itself refuses it (the table
-- has rows) ...
BEGIN;
ALTER TABLE idem_record ADD COLUMN must text NOT NULL;
\echo :SQLSTATE
ROLLBACK;
-- ... and one whose default is dropped later makes every call fail, before
-- any write: 55000, with a DETAIL saying what is wrong.
BEGIN;
ALTER TABLE idem_record ADD COLUMN must text NOT NULL DEFAULT 'x';
ALTER TABLE idem_record ALTER COLUMN must DROP DEFAULT;
SELECT status FROM idem_begin('recovery', 'x2', NULL);
\echo :SQLSTATE
ROLLBACK;
-- One of our columns dropped, retyped or renamed: 55000.
BEGIN;
ALTER TABLE idem_record DROP COLUMN checkpoint;
SELECT status FROM idem_begin('recovery', 'x2', NULL);
\echo :SQLSTATE
ROLLBACK;
BEGIN;
ALTER TABLE idem_record DROP COLUMN fingerprint;
SELECT status FROM idem_begin('recovery', 'c1', NULL);
\echo :SQLSTATE
ROLLBACK;
BEGIN;
ALTER TABLE idem_record ALTER COLUMN takeovers TYPE int8;
SELECT state FROM idem_inspect('recovery', 'c1');
\echo :SQLSTATE
ROLLBACK;
BEGIN;
ALTER TABLE idem_record RENAME COLUMN holder TO session_holder;
SELECT idem_finish('recovery', 'c2', 1, '{}');
\echo :SQLSTATE
ROLLBACK;
-- The primary key dropped, or replaced by one on other columns: 55000.
BEGIN;
ALTER TABLE idem_record DROP CONSTRAINT idem_record_pkey;
SELECT status FROM idem_begin('recovery', 'x2', NULL);
\echo :SQLSTATE
ROLLBACK;
BEGIN;
ALTER TABLE idem_record DROP CONSTRAINT idem_record_pkey;
ALTER TABLE idem_record ADD PRIMARY KEY (role_id, operation, key, token);
SELECT status FROM idem_begin('recovery', 'x2', NULL);
\echo :SQLSTATE
ROLLBACK;
-- The same for idem_result, which every call reads in mode 'completed' (in
-- the other modes, once it has held a row).
BEGIN;
SELECT idem_set_durability('completed');
ALTER TABLE idem_result DROP COLUMN takeovers;
SELECT status FROM idem_begin('recovery', 'x2', NULL);
\echo :SQLSTATE
ROLLBACK;
-- After the rollbacks everything works as before.
SELECT * FROM rec('c1');
SELECT status, response FROM idem_begin('recovery', 'c1', '\x01');
SELECT status FROM idem_begin('recovery', 'x2', NULL);
SELECT count(*) AS records FROM idem_record WHERE operation = 'recovery' AND key = 'x1';

--
-- Verified writes.  A BEFORE ROW trigger that skips a write (returns NULL)
-- or changes the extension's columns makes the call fail with 09000:
-- nothing is reported that did not happen, and nothing is changed.  A
-- trigger that changes only a DBA's own columns is fine.
--
CREATE FUNCTION skip_write() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  RETURN NULL;
END $$;
CREATE FUNCTION change_key() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  NEW.key := NEW.key || '-changed';
  RETURN NEW;
END $$;
CREATE FUNCTION change_state() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  NEW.checkpoint := '"forged"';
  NEW.response := '"forged"';
  RETURN NEW;
END $$;
CREATE FUNCTION counts() RETURNS TABLE (in_record int8, in_result int8) LANGUAGE sql AS $$
  SELECT (SELECT count(*) FROM idem_record WHERE operation = 'recovery'),
         (SELECT count(*) FROM idem_result WHERE operation = 'recovery')
$$;
SELECT * FROM counts();

-- idem_record, INSERT (a claim): skipped, changed.
CREATE TRIGGER t BEFORE INSERT ON idem_record FOR EACH ROW EXECUTE FUNCTION skip_write();
SELECT status FROM idem_begin('recovery', 'v0', NULL);
\echo :SQLSTATE
DROP TRIGGER t ON idem_record;
-- (the DETAIL and HINT are the same for every case: shown once)
\set VERBOSITY terse
CREATE TRIGGER t BEFORE INSERT ON idem_record FOR EACH ROW EXECUTE FUNCTION change_key();
SELECT status FROM idem_begin('recovery', 'v0', NULL);
\echo :SQLSTATE
DROP TRIGGER t ON idem_record;
SELECT * FROM counts();

-- idem_record, UPDATE (a checkpoint, a finish, a renew, a takeover):
-- skipped, changed.  v1 is a checkpointed claim whose lease has lapsed.
SELECT token AS v1 FROM idem_begin('recovery', 'v1', NULL) \gset
SELECT idem_checkpoint('recovery', 'v1', :v1, '{"step": 1}');
SELECT lapse('v1');
CREATE TRIGGER t BEFORE UPDATE ON idem_record FOR EACH ROW EXECUTE FUNCTION skip_write();
SELECT idem_checkpoint('recovery', 'v1', :v1, '{"step": 2}');
\echo :SQLSTATE
SELECT idem_finish('recovery', 'v1', :v1, '"v1"');
\echo :SQLSTATE
SELECT idem_renew('recovery', 'v1', :v1, '1 min');
\echo :SQLSTATE
SELECT status FROM idem_begin('recovery', 'v1', NULL);
\echo :SQLSTATE
DROP TRIGGER t ON idem_record;
CREATE TRIGGER t BEFORE UPDATE ON idem_record FOR EACH ROW EXECUTE FUNCTION change_state();
SELECT idem_checkpoint('recovery', 'v1', :v1, '{"step": 2}');
\echo :SQLSTATE
SELECT idem_finish('recovery', 'v1', :v1, '"v1"');
\echo :SQLSTATE
DROP TRIGGER t ON idem_record;
CREATE TRIGGER t BEFORE UPDATE ON idem_record FOR EACH ROW EXECUTE FUNCTION change_key();
SELECT idem_renew('recovery', 'v1', :v1, '1 min');
\echo :SQLSTATE
SELECT status FROM idem_begin('recovery', 'v1', NULL);
\echo :SQLSTATE
DROP TRIGGER t ON idem_record;
-- idem_record, DELETE (an abort): skipped.
CREATE TRIGGER t BEFORE DELETE ON idem_record FOR EACH ROW EXECUTE FUNCTION skip_write();
SELECT idem_abort('recovery', 'v1', :v1);
\echo :SQLSTATE
DROP TRIGGER t ON idem_record;
-- v1 is as it was: lapsed, its checkpoint, no takeover, held by its token.
SELECT token = :v1 AS v1_holds, state, checkpoint, takeovers, response
  FROM idem_inspect('recovery', 'v1');
SELECT * FROM counts();
-- A trigger that changes only a column of the DBA's is fine.
ALTER TABLE idem_record ADD COLUMN note text;
CREATE FUNCTION set_note() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  NEW.note := TG_OP;
  RETURN NEW;
END $$;
CREATE TRIGGER t BEFORE INSERT OR UPDATE ON idem_record FOR EACH ROW EXECUTE FUNCTION set_note();
SELECT idem_checkpoint('recovery', 'v1', :v1, '{"step": 2}');
SELECT note, checkpoint FROM idem_record WHERE operation = 'recovery' AND key = 'v1';
SELECT status FROM idem_begin('recovery', 'v2', NULL);
SELECT note FROM idem_record WHERE operation = 'recovery' AND key = 'v2';
DROP TRIGGER t ON idem_record;
ALTER TABLE idem_record DROP COLUMN note;
SELECT idem_abort('recovery', 'v1', :v1);

-- idem_result, in mode 'completed': INSERT (a finish, or a first
-- checkpoint, moves a claim there; the DELETE from idem_record is checked
-- too), UPDATE (a checkpoint, a finish, a takeover of a claim there),
-- DELETE (an abort of a claim there).
SELECT idem_set_durability('completed');
SELECT token AS v3 FROM idem_begin('recovery', 'v3', NULL) \gset
SELECT * FROM counts();
CREATE TRIGGER t BEFORE INSERT ON idem_result FOR EACH ROW EXECUTE FUNCTION skip_write();
SELECT idem_finish('recovery', 'v3', :v3, '"v3"');
\echo :SQLSTATE
SELECT idem_checkpoint('recovery', 'v3', :v3, '{"step": 1}');
\echo :SQLSTATE
DROP TRIGGER t ON idem_result;
CREATE TRIGGER t BEFORE INSERT ON idem_result FOR EACH ROW EXECUTE FUNCTION change_key();
SELECT idem_finish('recovery', 'v3', :v3, '"v3"');
\echo :SQLSTATE
DROP TRIGGER t ON idem_result;
CREATE TRIGGER t BEFORE INSERT ON idem_result FOR EACH ROW EXECUTE FUNCTION change_state();
SELECT idem_finish('recovery', 'v3', :v3, '"v3"');
\echo :SQLSTATE
SELECT idem_checkpoint('recovery', 'v3', :v3, '{"step": 1}');
\echo :SQLSTATE
DROP TRIGGER t ON idem_result;
CREATE TRIGGER t BEFORE DELETE ON idem_record FOR EACH ROW EXECUTE FUNCTION skip_write();
SELECT idem_finish('recovery', 'v3', :v3, '"v3"');
\echo :SQLSTATE
DROP TRIGGER t ON idem_record;
SELECT (SELECT token FROM idem_inspect('recovery', 'v3')) = :v3 AS v3_holds,
       * FROM rec('v3');
SELECT * FROM counts();
-- v4 is a checkpointed claim, in idem_result, its lease lapsed.
SELECT token AS v4 FROM idem_begin('recovery', 'v4', NULL) \gset
SELECT idem_checkpoint('recovery', 'v4', :v4, '{"step": 1}');
SELECT lapse('v4');
SELECT * FROM counts();
CREATE TRIGGER t BEFORE UPDATE ON idem_result FOR EACH ROW EXECUTE FUNCTION skip_write();
SELECT idem_checkpoint('recovery', 'v4', :v4, '{"step": 2}');
\echo :SQLSTATE
SELECT idem_finish('recovery', 'v4', :v4, '"v4"');
\echo :SQLSTATE
SELECT status FROM idem_begin('recovery', 'v4', NULL);
\echo :SQLSTATE
DROP TRIGGER t ON idem_result;
CREATE TRIGGER t BEFORE UPDATE ON idem_result FOR EACH ROW EXECUTE FUNCTION change_state();
SELECT idem_checkpoint('recovery', 'v4', :v4, '{"step": 2}');
\echo :SQLSTATE
SELECT idem_finish('recovery', 'v4', :v4, '"v4"');
\echo :SQLSTATE
DROP TRIGGER t ON idem_result;
CREATE TRIGGER t BEFORE UPDATE ON idem_result FOR EACH ROW EXECUTE FUNCTION change_key();
SELECT status FROM idem_begin('recovery', 'v4', NULL);
\echo :SQLSTATE
DROP TRIGGER t ON idem_result;
CREATE TRIGGER t BEFORE DELETE ON idem_result FOR EACH ROW EXECUTE FUNCTION skip_write();
SELECT idem_abort('recovery', 'v4', :v4);
\echo :SQLSTATE
DROP TRIGGER t ON idem_result;
SELECT (SELECT token FROM idem_inspect('recovery', 'v4')) = :v4 AS v4_holds,
       * FROM rec('v4');
SELECT * FROM counts();
SELECT idem_abort('recovery', 'v4', :v4);

-- idem_set_durability's move is checked the same way: a trigger that skips
-- the insert into the target or the delete from the source, or changes the
-- extension's columns, stops the switch, and the mode and the records stay
-- as they were.
SELECT idem_finish('recovery', 'v3', :v3, '"v3"');
SELECT in_table FROM rec('v3');
CREATE TRIGGER t BEFORE INSERT ON idem_record FOR EACH ROW EXECUTE FUNCTION skip_write();
SELECT idem_set_durability('none');
\echo :SQLSTATE
DROP TRIGGER t ON idem_record;
CREATE TRIGGER t BEFORE DELETE ON idem_result FOR EACH ROW EXECUTE FUNCTION skip_write();
SELECT idem_set_durability('none');
\echo :SQLSTATE
DROP TRIGGER t ON idem_result;
-- (the message of this case is the implementation's choice: only the
-- SQLSTATE is shown)
\set VERBOSITY sqlstate
CREATE TRIGGER t BEFORE INSERT ON idem_record FOR EACH ROW EXECUTE FUNCTION change_key();
SELECT idem_set_durability('none');
DROP TRIGGER t ON idem_record;
CREATE TRIGGER t BEFORE INSERT ON idem_record FOR EACH ROW EXECUTE FUNCTION change_state();
SELECT idem_set_durability('none');
DROP TRIGGER t ON idem_record;
\set VERBOSITY default
SELECT idem_durability();
SELECT * FROM counts();
SELECT * FROM rec('v3');
SELECT status, response FROM idem_begin('recovery', 'v3', NULL);
-- without triggers the switch goes through
SELECT idem_set_durability('none');
SELECT * FROM counts();
SELECT * FROM rec('v3');

DROP FUNCTION rec(text);
DROP FUNCTION lapse(text);
DROP FUNCTION counts();
DROP FUNCTION skip_write();
DROP FUNCTION change_key();
DROP FUNCTION change_state();
DROP FUNCTION set_note();

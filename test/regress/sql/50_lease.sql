--
-- 50_lease: expiry.  A pending claim whose lease lapsed, and a completed
-- record past its retention, count as absent: the next request takes the
-- key.  Fencing: a takeover gets a greater token, and the stale token can
-- neither finish nor abort the new claim.
--
-- IK412 messages name the token: start this file's tokens at a known value,
-- (1 << 32) + 50000001 (forward only; no earlier file came near it).
--
\set VERBOSITY default
SELECT setval('idem_token_seq', (1::int8 << 32) + 50000000) AS token_base;

-- Five claims with a 100 ms lease, committed (the external-call shape) and
-- then left to lapse.  Each key below plays out one case.
SELECT token AS l1_token FROM idem_begin('lease', 'l1', '\x01', lease => '100 ms') \gset
SELECT token AS l2_token FROM idem_begin('lease', 'l2', '\x01', lease => '100 ms') \gset
SELECT token AS l3_token FROM idem_begin('lease', 'l3', '\x01', lease => '100 ms') \gset
SELECT token AS l4_token FROM idem_begin('lease', 'l4', '\x01', lease => '100 ms') \gset
SELECT token AS l5_token FROM idem_begin('lease', 'l5', '\x01', lease => '100 ms') \gset
SELECT pg_sleep(0.2);
-- The records are still there, pending, with their leases over.
SELECT key, completed_at IS NULL AS pending, expires_at < clock_timestamp() AS lapsed
  FROM idem_record WHERE operation = 'lease' ORDER BY key;

-- l1: the next request takes the key over at once (no waiting: the lapsed
-- claim counts as absent), with a greater token.  Still one record.
SELECT status, token > :l1_token AS greater_token
  FROM idem_begin('lease', 'l1', '\x01');
SELECT token AS l1_new_token FROM idem_record WHERE operation = 'lease' AND key = 'l1' \gset
SELECT count(*) AS records, :l1_new_token > :l1_token AS record_has_new_token
  FROM idem_record WHERE operation = 'lease' AND key = 'l1';
-- The slow worker wakes up: its token no longer holds the key.  Its finish
-- fails with IK412 and its abort returns false; neither touches the new
-- claim.
SELECT idem_finish('lease', 'l1', :l1_token, '{"charge": "ch_stale"}');
\echo :SQLSTATE
SELECT idem_abort('lease', 'l1', :l1_token);
SELECT token = :l1_new_token AS new_claim_intact, completed_at IS NULL AS pending
  FROM idem_record WHERE operation = 'lease' AND key = 'l1';
-- The new owner finishes; everyone replays its response.
SELECT idem_finish('lease', 'l1', :l1_new_token, '{"charge": "ch_new"}');
SELECT status, response FROM idem_begin('lease', 'l1', '\x01');
-- The stale token still cannot finish or abort the completed record.
SELECT idem_finish('lease', 'l1', :l1_token, '{"charge": "ch_stale"}');
\echo :SQLSTATE
SELECT idem_abort('lease', 'l1', :l1_token);

-- l2: a lapsed claim is absent for every purpose: 'raise' does not raise,
-- and a different fingerprint is not a key reuse (no IK422).
SELECT status, token > :l2_token AS greater_token
  FROM idem_begin('lease', 'l2', '\x02', in_flight => 'raise');
SELECT fingerprint FROM idem_record WHERE operation = 'lease' AND key = 'l2';

-- l3: a lapsed claim that nobody took over can still be finished by its
-- token.
SELECT idem_finish('lease', 'l3', :l3_token, '{"charge": "ch_l3"}');
SELECT status, response FROM idem_begin('lease', 'l3', '\x01');

-- l4: ... or aborted by it, which frees the key.
SELECT idem_abort('lease', 'l4', :l4_token);
SELECT status, token > :l4_token AS greater_token FROM idem_begin('lease', 'l4', '\x01');

-- l5: a takeover that rolls back never happened: the lapsed claim is back,
-- and its token can still finish it.
BEGIN;
SELECT status, token > :l5_token AS greater_token FROM idem_begin('lease', 'l5', '\x01');
ROLLBACK;
SELECT token = :l5_token AS old_claim_back FROM idem_record
 WHERE operation = 'lease' AND key = 'l5';
SELECT idem_finish('lease', 'l5', :l5_token, '{"charge": "ch_l5"}');
SELECT status, response FROM idem_begin('lease', 'l5', '\x01');

--
-- Retention.  A completed record past its retention counts as absent,
-- purged or not.  The shortest retention is a minute; to simulate time
-- passing, this test moves the record's expires_at into the past by hand
-- (as a superuser) instead of waiting.
--
SELECT token AS e1_token FROM idem_begin('lease', 'e1', '\x01', ttl => '1 min') \gset
SELECT idem_finish('lease', 'e1', :e1_token, '{"charge": "ch_e1"}');
SELECT status, response FROM idem_begin('lease', 'e1', '\x01');
UPDATE idem_record SET expires_at = now() - interval '1 s'
 WHERE operation = 'lease' AND key = 'e1';
-- Now the key is free: 'new', with a greater token, and the old
-- fingerprint no longer binds it.
SELECT status, token > :e1_token AS greater_token, response
  FROM idem_begin('lease', 'e1', '\x02');
SELECT token AS e1_new_token FROM idem_record WHERE operation = 'lease' AND key = 'e1' \gset
-- The old token cannot touch the new claim.
SELECT idem_abort('lease', 'e1', :e1_token);
SELECT idem_finish('lease', 'e1', :e1_new_token, '{"charge": "ch_e1_again"}');
SELECT status, response FROM idem_begin('lease', 'e1', '\x02');
SELECT count(*) AS records FROM idem_record WHERE operation = 'lease' AND key = 'e1';

-- idem_renew cannot extend a lease past the claim's ttl (22023); the DETAIL
-- shows both.  The claim keeps its lease and can still be finished.
SELECT token AS r1_token FROM idem_begin('lease', 'r1', NULL, lease => '1 s', ttl => '1 min') \gset
SELECT idem_renew('lease', 'r1', :r1_token, '2 min');
\echo :SQLSTATE
SELECT idem_finish('lease', 'r1', :r1_token, '"renewed"');

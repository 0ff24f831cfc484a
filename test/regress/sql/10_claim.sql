--
-- 10_claim: the life of a claim -- idem_begin, idem_finish, idem_abort.
--
\set VERBOSITY default

-- A token is epoch << 25 | count, an epoch band << 22 | serial.  The
-- first claim in a database starts an epoch, recorded with the timeline in
-- the logged idem_token_epoch (timeline << 38 | epoch) and flushed; the
-- count comes from the unlogged idem_token_seq.  The first epoch of an
-- installation starts from the clock: band = days since 2020-01-01 UTC
-- plus the timeline (1 here), serial = seconds of the day plus one; that
-- orders tokens across a DROP EXTENSION and CREATE EXTENSION.
SELECT token >> 47 AS band, token >> 25 & 4194303 AS serial,
       token & 33554431 AS count
  FROM idem_begin('token.epoch', 'e1', NULL) \gset
SELECT last_value >> 38 AS timeline,
       last_value & 274877906943 = :band::int8 << 22 | :serial AS epoch_recorded,
       :band - 1 BETWEEN (current_date - 1 - '2020-01-01'::date)
                     AND (current_date + 1 - '2020-01-01'::date) AS band_from_days,
       :serial BETWEEN 1 AND 86400 AS serial_from_seconds,
       :count AS count
  FROM idem_token_epoch;
SELECT idem_abort('token.epoch', 'e1', ((:band::int8 << 47) | (:serial::int8 << 25)) + 1);

-- Tokens are compared below, not printed, except in the IK412 messages,
-- which name the token: this file moves the count to a known value (a test
-- only; tokens never go back by themselves) so that those messages are
-- stable: the next token is (1 << 32) + 10000001 = 4304967297.
SELECT setval('idem_token_seq', (1::int8 << 32) + 10000000) AS token_base;

-- A first claim of a key: status 'new', a token, no response.
SELECT status, token IS NOT NULL AS has_token, response
  FROM idem_begin('order.create', 'k1', idem_fingerprint('order-1', 100));

-- The claim above is committed and pending with the default 30 s lease: a
-- duplicate under the 'raise' policy is refused at once with IK409.  (Under
-- 'wait' it would sleep until the claim is finished, aborted or its lease
-- ends; 30_settings and 50_lease show that with short leases.)
SELECT status FROM idem_begin('order.create', 'k1', idem_fingerprint('order-1', 100),
                              in_flight => 'raise');
\echo :SQLSTATE

-- The record while pending: no completion time, no response, the lease
-- (30 s by default) ends expires_at, the retention (24 h by default) is
-- kept for later.
SELECT role_id::regrole AS role, operation, key, token = 4304967297 AS first_token,
       fingerprint = idem_fingerprint('order-1', 100) AS fingerprint_kept,
       ttl, completed_at IS NULL AS pending, response,
       expires_at - created_at AS lease
  FROM idem_record WHERE operation = 'order.create' AND key = 'k1';

-- Finish it with the response; the retention starts at completion.
SELECT idem_finish('order.create', 'k1', 4304967297,
                   '{"charge": "ch_1", "amount": 100}');
SELECT completed_at IS NOT NULL AS completed, response,
       expires_at - completed_at AS retention
  FROM idem_record WHERE operation = 'order.create' AND key = 'k1';

-- A retry with the same fingerprint replays the stored response; a replay
-- carries no token.
SELECT * FROM idem_begin('order.create', 'k1', idem_fingerprint('order-1', 100));
-- ... as often as it is asked, in any policy.
SELECT * FROM idem_begin('order.create', 'k1', idem_fingerprint('order-1', 100),
                         in_flight => 'raise');

-- The token that finished the claim no longer holds the key: a second
-- finish is refused with IK412 and the stored response is unchanged; an
-- abort with it returns false and deletes nothing.
SELECT idem_finish('order.create', 'k1', 4304967297, '{"charge": "ch_2"}');
\echo :SQLSTATE
SELECT idem_abort('order.create', 'k1', 4304967297);
SELECT response FROM idem_begin('order.create', 'k1', idem_fingerprint('order-1', 100));

-- A token that was never issued for the key: IK412 for finish, false for
-- abort -- both for a key that has a record and for one that has none.
-- The DETAIL says what the record shows: a greater token, a smaller one,
-- or no record.
SELECT idem_finish('order.create', 'k1', 999, '{}');
\echo :SQLSTATE
SELECT idem_finish('order.create', 'k1', 9223372036854775807, '{}');
\echo :SQLSTATE
SELECT idem_finish('order.create', 'no-such-key', 999, '{}');
\echo :SQLSTATE
SELECT idem_abort('order.create', 'no-such-key', 999);

-- The replay returns the stored response exactly (as jsonb: numbers keep
-- their scale and precision, strings their escapes, nesting is kept).
SELECT token AS k2_token FROM idem_begin('order.create', 'k2', NULL) \gset
SELECT idem_finish('order.create', 'k2', :k2_token,
  '{"id": "ch_\"1\"", "amount": 1.50, "big": 123456789012345678901234567890,
    "tiny": 1e-30, "none": null, "flags": [true, false], "text": "é ✓ \\n",
    "nested": {"items": [{"sku": "a", "qty": 1}, {"sku": "b", "qty": 2}], "empty": {}}}');
SELECT status, token, response::text
  FROM idem_begin('order.create', 'k2', NULL);
SELECT response = '{"id": "ch_\"1\"", "amount": 1.50, "big": 123456789012345678901234567890,
    "tiny": 1e-30, "none": null, "flags": [true, false], "text": "é ✓ \\n",
    "nested": {"items": [{"sku": "a", "qty": 1}, {"sku": "b", "qty": 2}], "empty": {}}}'::jsonb
       AS identical
  FROM idem_begin('order.create', 'k2', NULL);
-- Any JSON value is a response, a scalar too.
SELECT (idem_begin('order.create', 'k3', NULL)).token AS k3_token \gset
SELECT idem_finish('order.create', 'k3', :k3_token, '"accepted"');
SELECT status, response FROM idem_begin('order.create', 'k3', NULL);

-- Errors are not cached: idem_abort releases the claim (true), and the next
-- attempt gets the key again with a greater token.  A second abort with the
-- same token, or a finish with it, finds nothing to release.
SELECT token AS a1_token FROM idem_begin('payment.charge', 'a1', NULL) \gset
SELECT idem_abort('payment.charge', 'a1', :a1_token);
SELECT idem_abort('payment.charge', 'a1', :a1_token);
SELECT idem_finish('payment.charge', 'a1', :a1_token, '{}');
\echo :SQLSTATE
SELECT count(*) AS records FROM idem_record WHERE operation = 'payment.charge' AND key = 'a1';
SELECT status, token > :a1_token AS greater_token
  FROM idem_begin('payment.charge', 'a1', NULL);

-- Operations scope keys: the same key under 'order.cancel' is a record of
-- its own, next to the one under 'order.create'.
SELECT status FROM idem_begin('order.cancel', 'k1', NULL);
SELECT operation, key, completed_at IS NOT NULL AS completed
  FROM idem_record WHERE key = 'k1' ORDER BY operation;
-- Keys and operations are compared exactly: no case folding, no trimming.
SELECT status FROM idem_begin('order.create', 'K1', NULL);
SELECT status FROM idem_begin('order.create', 'k1 ', NULL);
SELECT status FROM idem_begin('Order.Create', 'k1', NULL);

--
-- The in-transaction shape: claim, effect and response commit or roll back
-- together.
--
CREATE TABLE charges (key text PRIMARY KEY, amount int);

-- Rolled back: no record is left, the key is free again (and the next claim
-- gets a greater token: the sequence does not roll back).
BEGIN;
SELECT token AS t1_token FROM idem_begin('payment.charge', 'tx1', NULL) \gset
INSERT INTO charges VALUES ('tx1', 100);
SELECT idem_finish('payment.charge', 'tx1', :t1_token, '{"charge": "ch_tx1"}');
ROLLBACK;
SELECT count(*) AS records FROM idem_record WHERE key = 'tx1';
BEGIN;
SELECT status, token > :t1_token AS greater_token
  FROM idem_begin('payment.charge', 'tx1', NULL);
ROLLBACK;

-- Committed: the effect and the response are there together.
BEGIN;
SELECT token AS t2_token FROM idem_begin('payment.charge', 'tx2', NULL) \gset
INSERT INTO charges VALUES ('tx2', 200);
SELECT idem_finish('payment.charge', 'tx2', :t2_token, '{"charge": "ch_tx2"}');
COMMIT;
SELECT c.amount, r.response
  FROM charges c, idem_begin('payment.charge', 'tx2', NULL) r WHERE c.key = 'tx2';

-- A transaction never waits on itself: a second idem_begin for a key it
-- already holds fails at once with IK409, in either policy ...
BEGIN;
SELECT token AS t3_token FROM idem_begin('payment.charge', 'tx3', NULL) \gset
SAVEPOINT s;
SELECT status FROM idem_begin('payment.charge', 'tx3', NULL, in_flight => 'wait');
\echo :SQLSTATE
ROLLBACK TO s;
SELECT status FROM idem_begin('payment.charge', 'tx3', NULL, in_flight => 'raise');
\echo :SQLSTATE
ROLLBACK TO s;
-- ... and once it has finished the claim, the same transaction gets a replay.
SELECT idem_finish('payment.charge', 'tx3', :t3_token, '{"charge": "ch_tx3"}');
SELECT * FROM idem_begin('payment.charge', 'tx3', NULL);
COMMIT;
SELECT * FROM idem_begin('payment.charge', 'tx3', NULL);

-- A claim aborted inside the transaction can be claimed again by the same
-- transaction.
BEGIN;
SELECT token AS t4_token FROM idem_begin('payment.charge', 'tx4', NULL) \gset
SELECT idem_abort('payment.charge', 'tx4', :t4_token);
SELECT status, token > :t4_token AS greater_token
  FROM idem_begin('payment.charge', 'tx4', NULL);
ROLLBACK;

-- Savepoints: a claim rolled back to a savepoint is gone; a claim made in
-- a released savepoint belongs to the transaction (IK409 on a re-begin); a
-- finish rolled back to a savepoint leaves the claim pending, still held by
-- its token.
BEGIN;
SAVEPOINT s;
SELECT status FROM idem_begin('payment.charge', 'tx5', NULL);
ROLLBACK TO s;
SELECT token AS t5_token FROM idem_begin('payment.charge', 'tx5', NULL) \gset
SAVEPOINT s;
SELECT status FROM idem_begin('payment.charge', 'tx6', NULL);
RELEASE s;
SAVEPOINT s;
SELECT status FROM idem_begin('payment.charge', 'tx6', NULL);
\echo :SQLSTATE
ROLLBACK TO s;
SAVEPOINT s;
SELECT idem_finish('payment.charge', 'tx5', :t5_token, '"rolled back"');
ROLLBACK TO s;
SELECT completed_at IS NULL AS pending FROM idem_record
 WHERE operation = 'payment.charge' AND key = 'tx5';
SELECT idem_finish('payment.charge', 'tx5', :t5_token, '"kept"');
COMMIT;
SELECT status, response FROM idem_begin('payment.charge', 'tx5', NULL);

-- Claim and finish inside one statement: idem_finish sees the claim that
-- idem_begin made earlier in the same SELECT.
SELECT idem_finish('order.create', 'one-statement',
                   (idem_begin('order.create', 'one-statement', NULL)).token,
                   '{"done": true}');
SELECT status, response FROM idem_begin('order.create', 'one-statement', NULL);
-- The same in a CTE, over many keys at once.
WITH claims AS (
  SELECT k, (idem_begin('order.create', 'many-' || k, NULL)).token AS token
    FROM generate_series(1, 5) k
)
SELECT count(idem_finish('order.create', 'many-' || k, token, to_jsonb(k))) AS finished
  FROM claims;
SELECT string_agg(r.response::text, ',' ORDER BY k) AS replays
  FROM generate_series(1, 5) k,
       LATERAL idem_begin('order.create', 'many-' || k, NULL) r;

-- Nothing can be claimed, finished or aborted in a read-only transaction:
-- 25006.
BEGIN READ ONLY;
SELECT status FROM idem_begin('order.create', 'read-only', NULL);
\echo :SQLSTATE
ROLLBACK;
BEGIN READ ONLY;
SELECT idem_finish('order.create', 'read-only', 1, '{}');
\echo :SQLSTATE
ROLLBACK;
BEGIN READ ONLY;
SELECT idem_abort('order.create', 'read-only', 1);
\echo :SQLSTATE
ROLLBACK;
SET default_transaction_read_only = on;
SELECT status FROM idem_begin('order.create', 'read-only', NULL);
\echo :SQLSTATE
RESET default_transaction_read_only;
SELECT count(*) AS records FROM idem_record WHERE key = 'read-only';

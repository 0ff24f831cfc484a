--
-- 98_forget: idem_forget, an administrator's way to delete one key's
-- record on purpose (a support team that stored a wrong response).  The
-- next attempt gets 'new', with a greater token; a pending claim a live
-- attempt holds is refused unless forced, and its finish then fails with
-- IK412; a record of another role is named by the role argument.  Not
-- granted to PUBLIC.
--
\set VERBOSITY default

-- a completed key: forgotten, then claimed anew
SELECT (idem_begin('forget', 'k1', NULL)).token AS t1 \gset
SELECT idem_finish('forget', 'k1', :t1, '"wrong response"');
SELECT status, response FROM idem_begin('forget', 'k1', NULL);
SELECT idem_forget('forget', 'k1');
SELECT status, token > :t1 AS greater_token FROM idem_begin('forget', 'k1', NULL);
SELECT count(*) FROM idem_inspect('forget', 'k1');

-- no record: NULL, nothing changed
SELECT idem_forget('forget', 'nothing') IS NULL AS no_record;

-- a pending claim of a live attempt: refused, unless forced
SELECT (idem_begin('forget', 'k2', NULL, lease => '1 hour')).token AS t2 \gset
\set VERBOSITY terse
SELECT idem_forget('forget', 'k2');
\echo :SQLSTATE
\set VERBOSITY default
SELECT state FROM idem_inspect('forget', 'k2');
SELECT idem_forget('forget', 'k2', force => true);
\set VERBOSITY sqlstate
SELECT idem_finish('forget', 'k2', :t2, '"late"');
\set VERBOSITY default
SELECT status FROM idem_begin('forget', 'k2', NULL);

-- a lapsed claim needs no force
SELECT status FROM idem_begin('forget', 'k3', NULL, lease => '1 ms');
SELECT pg_sleep(0.05);
SELECT idem_forget('forget', 'k3');

-- another role's record, by its name; an unknown role is an error
SET ROLE regress_idem_a;
SELECT (idem_begin('forget', 'k4', NULL)).token AS t4 \gset
SELECT idem_finish('forget', 'k4', :t4, '"a"');
RESET ROLE;
SELECT idem_forget('forget', 'k4') IS NULL AS not_mine;
SELECT idem_forget('forget', 'k4', role => 'regress_idem_a');
SET ROLE regress_idem_a;
SELECT status FROM idem_begin('forget', 'k4', NULL);
RESET ROLE;
SELECT idem_forget('forget', 'k4', role => 'no_such_role');
\echo :SQLSTATE
SELECT idem_forget('forget', 'k4', role => NULL);
\echo :SQLSTATE

-- not for PUBLIC
SET ROLE regress_idem_nobody;
SELECT idem_forget('forget', 'k1');
\echo :SQLSTATE
RESET ROLE;

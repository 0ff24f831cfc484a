--
-- 97_names: the extension's tables must stay where CREATE EXTENSION put
-- them.  A table renamed or moved is a clear error naming it, never taken
-- for an installation without that table (which would change the mode),
-- and renaming it back is enough: nothing stale is kept.  A move into a
-- schema published FOR TABLES IN SCHEMA is refused by the publication
-- guard.
--
\set VERBOSITY default
SET client_min_messages = warning;

SELECT idem_durability();
SELECT status FROM idem_begin('names', 'k1', NULL);
SELECT idem_finish('names', 'k1', token, '"one"') IS NULL AS finished
  FROM idem_inspect('names', 'k1');

-- idem_result renamed: every call says which table is missing and where
-- it went, the mode is not taken for 'none'
ALTER TABLE idem_result RENAME TO idem_result_old;
SELECT status FROM idem_begin('names', 'k1', NULL);
\echo :SQLSTATE
SELECT idem_durability();
\echo :SQLSTATE
SELECT count(*) FROM idem_inspect('names', 'k1');
\echo :SQLSTATE

-- renamed back, the same session replays at once
ALTER TABLE idem_result_old RENAME TO idem_result;
SELECT status, response FROM idem_begin('names', 'k1', NULL);
SELECT idem_durability();

-- moved to another schema: the same
CREATE SCHEMA elsewhere;
ALTER TABLE idem_result SET SCHEMA elsewhere;
SELECT status FROM idem_begin('names', 'k1', NULL);
\echo :SQLSTATE
ALTER TABLE elsewhere.idem_result SET SCHEMA public;
SELECT status, response FROM idem_begin('names', 'k1', NULL);

-- idem_record and the token sequence renamed
ALTER TABLE idem_record RENAME TO idem_claims;
SELECT status FROM idem_begin('names', 'k2', NULL);
\echo :SQLSTATE
ALTER TABLE idem_claims RENAME TO idem_record;
ALTER SEQUENCE idem_token_seq RENAME TO idem_tokens;
SELECT status FROM idem_begin('names', 'k2', NULL);
\echo :SQLSTATE
ALTER SEQUENCE idem_tokens RENAME TO idem_token_seq;
SELECT status FROM idem_begin('names', 'k2', NULL);

-- idem_mode renamed: a switch would no longer record the mode for dumps
ALTER TABLE idem_mode RENAME TO idem_mode_old;
SELECT idem_set_durability('completed');
\echo :SQLSTATE
ALTER TABLE idem_mode_old RENAME TO idem_mode;

-- a move into a schema that a publication takes whole is refused (in mode
-- 'completed', where idem_result is logged: unlogged tables are never
-- published)
SELECT idem_set_durability('completed');
SET client_min_messages = error;
CREATE PUBLICATION names_pub FOR TABLES IN SCHEMA elsewhere;
SET client_min_messages = warning;
ALTER TABLE idem_result SET SCHEMA elsewhere;
\echo :SQLSTATE
SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
 WHERE c.relname = 'idem_result';
DROP PUBLICATION names_pub;
DROP SCHEMA elsewhere;
SELECT status, response FROM idem_begin('names', 'k1', NULL);
SELECT idem_set_durability('none');

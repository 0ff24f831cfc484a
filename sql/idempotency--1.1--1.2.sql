/* idempotency--1.1--1.2.sql: fencing tokens without a disk flush per claim */

\echo Use "ALTER EXTENSION idempotency UPDATE TO '1.2'" to load this file. \quit

/*
 * A token is now epoch << 32 | count (src/storage.c).
 *
 * idem_token_seq becomes the count within one epoch: unlogged, so drawing a
 * token writes no WAL, and crash recovery resets it to 1, which starts a new
 * epoch.  Its exclusive lock, taken first, keeps claims from drawing tokens
 * until this update commits.
 */
ALTER SEQUENCE @extschema@.idem_token_seq SET UNLOGGED;

/*
 * idem_token_epoch numbers the epochs: logged, and flushed before an
 * epoch's first token is used, so an epoch is never handed out twice.  It
 * starts above every token of the old sequence, so tokens keep increasing
 * across this update.  Its maximum keeps epoch << 32 within int8.  It is
 * dumped; the count is not (a restore starts a new epoch).
 *
 * Names are unqualified inside quotes: the update puts the extension's
 * schema first in search_path, and the schema placeholder must never
 * appear inside quotes.
 */
CREATE SEQUENCE @extschema@.idem_token_epoch AS pg_catalog.int8
	MINVALUE 1 MAXVALUE 2147483647 NO CYCLE;
REVOKE ALL ON SEQUENCE @extschema@.idem_token_epoch FROM PUBLIC;
SELECT pg_catalog.pg_extension_config_dump('idem_token_epoch', '');

SELECT pg_catalog.setval('idem_token_epoch',
						 (s.last_value OPERATOR(pg_catalog.>>) 32)
						 OPERATOR(pg_catalog.+) 1,
						 false)
  FROM @extschema@.idem_token_seq s;

/*
 * The count starts over at 1, in the main fork and in the init fork that
 * crash recovery copies (SET UNLOGGED copied the old value there).
 */
ALTER SEQUENCE @extschema@.idem_token_seq RESTART WITH 1;

/* Stop dumping the count: leaving the extension drops it from the dump list */
ALTER EXTENSION idempotency DROP SEQUENCE @extschema@.idem_token_seq;
ALTER EXTENSION idempotency ADD SEQUENCE @extschema@.idem_token_seq;

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
 * crash recovery copies (SET UNLOGGED copied the old value there).  Its
 * minimum goes down to -2^63: a new epoch parks it there while it waits.
 */
ALTER SEQUENCE @extschema@.idem_token_seq
	MINVALUE -9223372036854775808 RESTART WITH 1;

/*
 * Stop dumping the count: take it off the extension's configuration list,
 * as pg_extension_config_dump put it there (ALTER EXTENSION DROP and ADD
 * would do it too, but would make grants on it look like initial
 * privileges to pg_dump).
 */
UPDATE pg_catalog.pg_extension e
   SET extconfig = k.config, extcondition = k.condition
  FROM (SELECT pg_catalog.array_agg(u.config ORDER BY u.n) AS config,
			   pg_catalog.array_agg(u.condition ORDER BY u.n) AS condition
		  FROM pg_catalog.pg_extension x,
			   ROWS FROM (pg_catalog.unnest(x.extconfig),
						  pg_catalog.unnest(x.extcondition))
				 WITH ORDINALITY AS u(config, condition, n)
		 WHERE x.extname OPERATOR(pg_catalog.=) 'idempotency'
		   AND u.config OPERATOR(pg_catalog.<>)
			   'idem_token_seq'::pg_catalog.regclass::pg_catalog.oid) k
 WHERE e.extname OPERATOR(pg_catalog.=) 'idempotency';

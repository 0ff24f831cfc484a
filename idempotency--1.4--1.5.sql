/* idempotency--1.4--1.5.sql: ALTER EXTENSION idempotency UPDATE TO '1.5' */

\echo Use "ALTER EXTENSION idempotency UPDATE TO '1.5'" to load this file. \quit

/*
 * Records that an online switch cut short left in the table the mode does
 * not keep them in are moved where it does, so that the mode promised
 * holds from here on.
 */
SELECT @extschema@.idem_set_durability(@extschema@.idem_durability());

/*
 * The publication guard also runs at the end of ALTER TABLE, which may move
 * one of the extension's tables into a schema published FOR TABLES IN
 * SCHEMA.
 */
DROP EVENT TRIGGER idempotency_publication_guard;
CREATE EVENT TRIGGER idempotency_publication_guard ON ddl_command_end
	WHEN TAG IN ('CREATE PUBLICATION', 'ALTER PUBLICATION', 'ALTER TABLE')
	EXECUTE FUNCTION @extschema@.idem_publication_guard();

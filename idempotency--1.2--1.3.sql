/* idempotency--1.2--1.3.sql: records keyed by role name in dumps; edges */

\echo Use "ALTER EXTENSION idempotency UPDATE TO '1.3'" to load this file. \quit

/*
 * role_id becomes a regrole: the same OID on disk, but pg_dump writes the
 * role's name and a restore reads it back as that role's OID wherever the
 * dump is restored.  A record whose role does not exist there fails the
 * restore of this table's data ("role ... does not exist") instead of
 * attaching to another role.  oid and regrole are binary compatible: the
 * table is not rewritten.
 */
ALTER TABLE @extschema@.idem_record
	ALTER COLUMN role_id TYPE pg_catalog.regrole;

/*
 * A dump leaves out the records of roles dropped since they were written
 * (before this update or after it): their OID would be written as a number
 * and could name another role where the dump is restored.
 */
SELECT pg_catalog.pg_extension_config_dump('idem_record',
	'WHERE role_id::pg_catalog.oid OPERATOR(pg_catalog.=) ANY (SELECT oid FROM pg_catalog.pg_roles)');

/* NULL is an error (22004), not a silent no-op */
ALTER FUNCTION @extschema@.idem_set_logged(pg_catalog.bool) CALLED ON NULL INPUT;
ALTER FUNCTION @extschema@.idem_inspect(pg_catalog.text, pg_catalog.text) CALLED ON NULL INPUT;

/*
 * pg_dump reads every configuration table and sequence of an extension, so
 * a database owner who is not a superuser -- the usual case on managed
 * services -- could not dump the database at all once the extension was
 * installed.  The owner may read the records and the token epoch (never
 * write them): their dumps then hold every role's records, which is what
 * keeps a restored database from running completed requests again.
 * Loading those records back needs a superuser (README, "Backups").
 */
GRANT SELECT ON @extschema@.idem_record TO pg_database_owner;
GRANT SELECT ON SEQUENCE @extschema@.idem_token_epoch TO pg_database_owner;

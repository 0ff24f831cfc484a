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

/*
 * Token epochs ordered by timeline (src/tokens.c): a token becomes
 * epoch << 25 | count, and idem_token_epoch holds the last epoch with the
 * timeline it started on, which needs all of int8.  Its value stays as it
 * is: the first claim after this update reads it as version 1.2's epoch
 * number and starts the first epoch above every token of 1.2.  The count
 * starts over, so that this first claim starts that epoch.
 */
ALTER SEQUENCE @extschema@.idem_token_epoch NO MAXVALUE;
ALTER SEQUENCE @extschema@.idem_token_seq RESTART WITH 1;

/*
 * Durability modes.  idem_result holds completed records in mode
 * 'completed': logged, while idem_record, which holds the claims, stays
 * unlogged; a finish moves its record there in the finishing transaction
 * (src/admin.c describes the modes).  It has idem_record's shape; the C
 * code reads both by column number.
 */
CREATE UNLOGGED TABLE @extschema@.idem_result (
	role_id			pg_catalog.regrole NOT NULL,
	operation		pg_catalog.text COLLATE "C" NOT NULL,
	key				pg_catalog.text COLLATE "C" NOT NULL,
	token			pg_catalog.int8 NOT NULL,
	fingerprint		pg_catalog.bytea,
	ttl				pg_catalog.interval NOT NULL,
	created_at		pg_catalog.timestamptz NOT NULL,
	completed_at	pg_catalog.timestamptz,
	expires_at		pg_catalog.timestamptz NOT NULL,
	response		pg_catalog.jsonb,
	CONSTRAINT idem_result_pkey PRIMARY KEY (role_id, operation, key)
);
REVOKE ALL ON @extschema@.idem_result FROM PUBLIC;
GRANT SELECT ON @extschema@.idem_result TO pg_database_owner;
SELECT pg_catalog.pg_extension_config_dump('idem_result',
	'WHERE role_id::pg_catalog.oid OPERATOR(pg_catalog.=) ANY (SELECT oid FROM pg_catalog.pg_roles)');

COMMENT ON TABLE @extschema@.idem_result IS
	'Completed idempotency records in durability mode ''completed''. Read and written only through the idem_* functions.';

CREATE FUNCTION @extschema@.idem_set_durability(mode pg_catalog.text)
RETURNS pg_catalog.void
AS 'MODULE_PATHNAME', 'idem_set_durability'
LANGUAGE C VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp;

CREATE FUNCTION @extschema@.idem_durability()
RETURNS pg_catalog.text
AS 'MODULE_PATHNAME', 'idem_durability'
LANGUAGE C STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp;

REVOKE ALL ON FUNCTION
	@extschema@.idem_set_durability(pg_catalog.text),
	@extschema@.idem_durability()
FROM PUBLIC;

/*
 * An installation keeps its behaviour: an unlogged record table is mode
 * 'none' (both tables unlogged, as created above), a logged one mode 'all'.
 * README, "Upgrading", says how to move to 'completed'.
 */
SELECT @extschema@.idem_set_durability('all')
  FROM pg_catalog.pg_class
 WHERE oid OPERATOR(pg_catalog.=) 'idem_record'::pg_catalog.regclass
   AND relpersistence OPERATOR(pg_catalog.=) 'p';

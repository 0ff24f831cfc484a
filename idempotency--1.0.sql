/* idempotency--1.0.sql: contract 1.0 */

\echo Use "CREATE EXTENSION idempotency" to load this file. \quit

/*
 * The record store.  One row per (calling role, operation, key).
 *
 * A row is pending while completed_at is NULL; expires_at is then the end
 * of its lease.  Once completed, expires_at is the end of its retention
 * (completed_at + ttl).  A row whose expires_at has passed counts as absent.
 *
 * The C code reads and writes this table directly by column number
 * (src/storage.c): the column order is part of the on-disk contract and
 * upgrade scripts must never reorder it.
 */
CREATE UNLOGGED TABLE @extschema@.idem_record (
	role_id			pg_catalog.oid NOT NULL,
	operation		pg_catalog.text COLLATE "C" NOT NULL,
	key				pg_catalog.text COLLATE "C" NOT NULL,
	token			pg_catalog.int8 NOT NULL,
	fingerprint		pg_catalog.bytea,
	ttl				pg_catalog.interval NOT NULL,
	created_at		pg_catalog.timestamptz NOT NULL,
	completed_at	pg_catalog.timestamptz,
	expires_at		pg_catalog.timestamptz NOT NULL,
	response		pg_catalog.jsonb,
	CONSTRAINT idem_record_pkey PRIMARY KEY (role_id, operation, key)
);
REVOKE ALL ON @extschema@.idem_record FROM PUBLIC;
-- unqualified: CREATE EXTENSION puts the target schema first in search_path,
-- and the schema placeholder must never appear inside quotes
SELECT pg_catalog.pg_extension_config_dump('idem_record', '');

COMMENT ON TABLE @extschema@.idem_record IS
	'Idempotency records, namespaced by role. Read and written only through the idem_* functions.';

/*
 * Fencing tokens.  One sequence for all keys: a later claim always gets a
 * greater token than any earlier one, whatever happened to the earlier
 * record (aborted, purged, lost in a crash of the unlogged table).  It is
 * logged on purpose and has no cache, and a claim whose token is not on
 * disk yet flushes it at commit (src/storage.c), so it never goes
 * backwards, not even across a crash.
 */
CREATE SEQUENCE @extschema@.idem_token_seq AS pg_catalog.int8 NO CYCLE;
REVOKE ALL ON SEQUENCE @extschema@.idem_token_seq FROM PUBLIC;
SELECT pg_catalog.pg_extension_config_dump('idem_token_seq', '');

CREATE TYPE @extschema@.idem_claim AS (
	status		pg_catalog.text,
	token		pg_catalog.int8,
	response	pg_catalog.jsonb
);

CREATE FUNCTION @extschema@.idem_begin(
	operation	pg_catalog.text,
	key			pg_catalog.text,
	fingerprint	pg_catalog.bytea,
	in_flight	pg_catalog.text DEFAULT NULL,
	lease		pg_catalog.interval DEFAULT NULL,
	ttl			pg_catalog.interval DEFAULT NULL)
RETURNS @extschema@.idem_claim
AS 'MODULE_PATHNAME', 'idem_begin'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION @extschema@.idem_finish(
	operation	pg_catalog.text,
	key			pg_catalog.text,
	token		pg_catalog.int8,
	response	pg_catalog.jsonb)
RETURNS pg_catalog.void
AS 'MODULE_PATHNAME', 'idem_finish'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION @extschema@.idem_abort(
	operation	pg_catalog.text,
	key			pg_catalog.text,
	token		pg_catalog.int8)
RETURNS pg_catalog.bool
AS 'MODULE_PATHNAME', 'idem_abort'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION @extschema@.idem_fingerprint(VARIADIC "any")
RETURNS pg_catalog.bytea
AS 'MODULE_PATHNAME', 'idem_fingerprint'
LANGUAGE C STABLE PARALLEL SAFE;

GRANT EXECUTE ON FUNCTION
	@extschema@.idem_begin(pg_catalog.text, pg_catalog.text, pg_catalog.bytea,
						   pg_catalog.text, pg_catalog.interval, pg_catalog.interval),
	@extschema@.idem_finish(pg_catalog.text, pg_catalog.text, pg_catalog.int8, pg_catalog.jsonb),
	@extschema@.idem_abort(pg_catalog.text, pg_catalog.text, pg_catalog.int8),
	@extschema@.idem_fingerprint("any")
TO PUBLIC;

/*
 * Administration, not granted to PUBLIC.  Both run with the extension
 * owner's rights so that a role granted EXECUTE needs no privilege on the
 * table itself; their search_path is pinned.
 */
CREATE FUNCTION @extschema@.idem_purge(max_rows pg_catalog.int4 DEFAULT 10000)
RETURNS pg_catalog.int8
AS 'MODULE_PATHNAME', 'idem_purge'
LANGUAGE C VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp;

CREATE FUNCTION @extschema@.idem_set_logged(logged pg_catalog.bool)
RETURNS pg_catalog.void
AS 'MODULE_PATHNAME', 'idem_set_logged'
LANGUAGE C VOLATILE STRICT SECURITY DEFINER
SET search_path = pg_catalog, pg_temp;

REVOKE ALL ON FUNCTION
	@extschema@.idem_purge(pg_catalog.int4),
	@extschema@.idem_set_logged(pg_catalog.bool)
FROM PUBLIC;

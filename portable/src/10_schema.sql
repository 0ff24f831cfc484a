/*
 * 10_schema.sql: the portable edition's stored objects -- the record table,
 * its row-level security, the token sequence and the result type.  These
 * hold records: an install creates them once, an update changes them only
 * through an update script (../update/), never by re-creating them.
 *
 * idem_record
 *		One row per (role_id, operation, key), the primary key, in the C
 *		collation, as in the C edition (role_id is a regrole: pg_dump
 *		carries it by name).  A claim is pending while completed_at is NULL:
 *		expires_at is then its lease's end; once completed, response is the
 *		stored response, expires_at the end of its ttl and forget_at the end
 *		of remembering.  holder names the session of a takeover =>
 *		'session' claim (process ID << 32 | the low 32 bits of its start
 *		time in microseconds since 2000, as the C edition computes it).
 *		Two columns only this edition has:
 *		  waker		the process ID of the backend that made the claim:
 *					duplicates wait on that backend's wake lock
 *					(20_wait.sql)
 *		  writer	the transaction that wrote this version: the claim is
 *					"ours" while it is the current transaction
 *		The table is logged: durability mode 'all' (the C edition's
 *		default, 'completed', keeps pending claims unlogged, which needs a
 *		second table; see README.md).
 *		Every role reaches the table only through row-level security: its
 *		own rows (role_id is the current role), whatever path it takes --
 *		the idem_* functions, which run with the caller's rights, or SQL of
 *		its own.
 */

CREATE TABLE @extschema@.idem_record (
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
	holder			pg_catalog.int8,
	checkpoint		pg_catalog.jsonb,
	takeovers		pg_catalog.int4 NOT NULL DEFAULT 0,
	forget_at		pg_catalog.timestamptz,
	waker			pg_catalog.int4,
	writer			pg_catalog.xid8,
	CONSTRAINT idem_record_pkey PRIMARY KEY (role_id, operation, key)
);

COMMENT ON TABLE @extschema@.idem_record IS
	'Idempotency records, namespaced by role (row-level security). Read and written through the idem_* functions.';

ALTER TABLE @extschema@.idem_record ENABLE ROW LEVEL SECURITY;

/* a role's own records: role_id is the current role (quoted: regrole parses a name) */
CREATE POLICY idem_own_records ON @extschema@.idem_record
	USING (role_id OPERATOR(pg_catalog.=)
		   pg_catalog.quote_ident(CURRENT_USER)::pg_catalog.regrole)
	WITH CHECK (role_id OPERATOR(pg_catalog.=)
				pg_catalog.quote_ident(CURRENT_USER)::pg_catalog.regrole);

REVOKE ALL ON @extschema@.idem_record FROM PUBLIC;
GRANT SELECT, INSERT, UPDATE, DELETE ON @extschema@.idem_record TO PUBLIC;

/* tokens above 2^53, as the C edition's: a client that reads them as a
   double (a JavaScript number) fails at its first finish, not later */
CREATE SEQUENCE @extschema@.idem_token_seq AS pg_catalog.int8 START 9007199254740993;
REVOKE ALL ON SEQUENCE @extschema@.idem_token_seq FROM PUBLIC;
/* the functions take tokens with the caller's rights; no role may set it */
GRANT USAGE ON SEQUENCE @extschema@.idem_token_seq TO PUBLIC;

SELECT pg_catalog.pg_extension_config_dump('idem_record', '');
SELECT pg_catalog.pg_extension_config_dump('idem_token_seq', '');

CREATE TYPE @extschema@.idem_claim AS (
	status		pg_catalog.text,
	token		pg_catalog.int8,
	response	pg_catalog.jsonb
);

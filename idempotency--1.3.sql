/* idempotency--1.3.sql: version 1.3, for CREATE EXTENSION */

\echo Use "CREATE EXTENSION idempotency" to load this file. \quit

/*
 * A new installation of 1.3 is exactly what an installation of 1.0 brought
 * to 1.3 by the update scripts is -- the same objects, privileges and
 * configuration -- so this file is those scripts, in order, followed by the
 * one thing a new installation does differently: it starts in durability
 * mode 'completed' (an updated one keeps the mode it had).
 */

/* ---------------- from idempotency--1.0.sql ---------------- */

/* idempotency--1.0.sql: contract 1.0 */


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

/* ---------------- from idempotency--1.0--1.1.sql ---------------- */

/* idempotency--1.0--1.1.sql: lease renewal, inspection, statistics */


/* Extend a live claim for a long action; returns the new end of its lease */
CREATE FUNCTION @extschema@.idem_renew(
	operation	pg_catalog.text,
	key			pg_catalog.text,
	token		pg_catalog.int8,
	lease		pg_catalog.interval)
RETURNS pg_catalog.timestamptz
AS 'MODULE_PATHNAME', 'idem_renew'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

/*
 * The calling role's record for one key: no row when there is none.
 * state: pending | lapsed (pending, lease over) | completed | expired
 * (completed, retention over).  uncommitted: the newest version is being
 * written by a transaction that has not committed yet.
 */
CREATE FUNCTION @extschema@.idem_inspect(
	operation	pg_catalog.text,
	key			pg_catalog.text,
	OUT state		pg_catalog.text,
	OUT token		pg_catalog.int8,
	OUT fingerprint	pg_catalog.bytea,
	OUT created_at	pg_catalog.timestamptz,
	OUT lease_until	pg_catalog.timestamptz,
	OUT completed_at pg_catalog.timestamptz,
	OUT expires_at	pg_catalog.timestamptz,
	OUT uncommitted	pg_catalog.bool,
	OUT response	pg_catalog.jsonb)
RETURNS SETOF record
AS 'MODULE_PATHNAME', 'idem_inspect'
LANGUAGE C VOLATILE STRICT PARALLEL UNSAFE ROWS 1;

/* The calling role's records per operation, as the current snapshot sees them */
CREATE FUNCTION @extschema@.idem_stats_records(
	OUT operation	pg_catalog.text,
	OUT pending		pg_catalog.int8,
	OUT lapsed		pg_catalog.int8,
	OUT completed	pg_catalog.int8,
	OUT expired		pg_catalog.int8)
RETURNS SETOF record
AS 'MODULE_PATHNAME', 'idem_stats_records'
LANGUAGE C STABLE PARALLEL UNSAFE;

CREATE VIEW @extschema@.idem_stats AS
	SELECT operation, pending, lapsed, completed, expired
	  FROM @extschema@.idem_stats_records();

/*
 * Server-wide counters since the last reset; they live in shared memory, so
 * they need idempotency in shared_preload_libraries (without it, reading
 * them is an error that says so).
 */
CREATE FUNCTION @extschema@.idem_counters(
	OUT claims				pg_catalog.int8,
	OUT replays				pg_catalog.int8,
	OUT waits				pg_catalog.int8,
	OUT wait_time_ms		pg_catalog.float8,
	OUT in_progress_refusals pg_catalog.int8,
	OUT key_reuse_refusals	pg_catalog.int8,
	OUT takeovers			pg_catalog.int8,
	OUT fencing_refusals	pg_catalog.int8,
	OUT aborts				pg_catalog.int8,
	OUT purged				pg_catalog.int8,
	OUT stats_reset			pg_catalog.timestamptz)
RETURNS record
AS 'MODULE_PATHNAME', 'idem_counters'
LANGUAGE C VOLATILE PARALLEL SAFE;

CREATE VIEW @extschema@.idem_stats_counters AS
	SELECT * FROM @extschema@.idem_counters();

CREATE FUNCTION @extschema@.idem_stats_reset()
RETURNS pg_catalog.void
AS 'MODULE_PATHNAME', 'idem_stats_reset'
LANGUAGE C VOLATILE PARALLEL SAFE;

GRANT EXECUTE ON FUNCTION
	@extschema@.idem_renew(pg_catalog.text, pg_catalog.text, pg_catalog.int8, pg_catalog.interval),
	@extschema@.idem_inspect(pg_catalog.text, pg_catalog.text),
	@extschema@.idem_stats_records(),
	@extschema@.idem_counters()
TO PUBLIC;
GRANT SELECT ON @extschema@.idem_stats, @extschema@.idem_stats_counters TO PUBLIC;
REVOKE ALL ON FUNCTION @extschema@.idem_stats_reset() FROM PUBLIC;

/* ---------------- from idempotency--1.1--1.2.sql ---------------- */

/* idempotency--1.1--1.2.sql: fencing tokens without a disk flush per claim */


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

/* ---------------- from idempotency--1.2--1.3.sql ---------------- */

/* idempotency--1.2--1.3.sql: records keyed by role name in dumps; edges */


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

/* ---------------- new installations ---------------- */

SELECT @extschema@.idem_set_durability('completed');

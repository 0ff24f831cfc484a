/* idempotency--1.0--1.1.sql: lease renewal, inspection, statistics */

\echo Use "ALTER EXTENSION idempotency UPDATE TO '1.1'" to load this file. \quit

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
